"""Request bodies of the OpenAI-compatible API (pydantic v2), and vLLM's /tokenize, /detokenize.

Unknown fields are ignored, as OpenAI and vLLM do, so clients that send extras (`user`,
`metadata`, ...) keep working. Fields that OpenAI or vLLM define but specserve cannot honour are
refused by name before these models see the body (compat.py); the fields declared here are the
ones honoured.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from specserve.chat import RESERVED_TEMPLATE_KWARGS
from specserve.sampling_params import InvalidRequestError, SamplingParams
from specserve.server.errors import bad_request
from specserve.structured.params import StructuredOutputsParams

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128  # samples per prompt
# engine requests one HTTP request may queue (prompts x n): a small body cannot flood the queue
MAX_ENGINE_REQUESTS = 256
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries

Granularity = Literal["step", "token"]


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage so far on every chunk


class _Base(BaseModel):
    # NaN / Infinity are valid Python JSON but no valid parameter value
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _SamplingRequest(_Base):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stream_granularity: Granularity | None = None  # specserve extension: "step" (default) | "token"
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool | None = None  # vLLM: token ids (and the prompt's) in each choice
    return_tokens_as_token_ids: bool | None = None  # vLLM: logprob tokens as "token_id:ID"
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    best_of: int | None = None
    request_id: str | None = None  # vLLM: the response id (engine ids stay unique regardless)
    user: str | None = None
    # structured outputs: vLLM's structured_outputs and older guided_* fields, OpenAI's
    # response_format (compat.py refuses the types and options not honoured)
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    response_format: dict[str, Any] | None = None

    def structured_spec(self) -> tuple[StructuredOutputsParams | None, str]:
        """(the request's output constraint, the field it came from); a 400 naming the field
        when it is malformed or when two fields constrain the output."""
        found: list[tuple[str, dict[str, Any]]] = []
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar")):  # fmt: skip
            if getattr(self, name) is not None:
                found.append((name, {key: getattr(self, name)}))
        rf = self.response_format
        if rf is not None and rf.get("type", "text") != "text":
            found.append(("response_format", _response_format_spec(rf)))
        if not found:
            return None, ""
        if len(found) > 1:
            raise bad_request(
                f"{found[1][0]} cannot be combined with {found[0][0]}: one output constraint "
                "per request",
                found[1][0],
            )
        name, spec = found[0]
        try:
            return StructuredOutputsParams.from_dict(spec), name
        except (InvalidRequestError, TypeError) as e:
            raise bad_request(str(e).replace("structured_outputs", name, 1), name) from None

    def check_common(self) -> None:
        """Checks pydantic's types cannot express; raise a 400 naming the field."""
        if not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be in [1, {MAX_N}], got {self.n}", "n")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (only best_of == n)", "best_of")
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise bad_request("seed must fit in a signed 64-bit integer", "seed")
        if self.top_k is not None and not -1 <= self.top_k <= INT32_MAX:
            raise bad_request(f"top_k must be -1, 0 or a positive count, got {self.top_k}", "top_k")
        if not 0 <= self.min_tokens <= INT32_MAX:
            raise bad_request(f"min_tokens must be in [0, {INT32_MAX}]", "min_tokens")
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if ids is not None and any(not 0 <= t <= INT32_MAX for t in ids):
                raise bad_request(f"{name} must be non-negative token ids", name)
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise bad_request("allowed_token_ids must not be empty", "allowed_token_ids")
        if self.bad_words is not None and any(w == "" for w in self.bad_words):
            raise bad_request("bad_words must be non-empty strings", "bad_words")
        self.logit_bias_ids()  # raises on a bad key or value
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise bad_request(
                    f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
                    "prompt_logprobs",
                )
            if self.stream:  # as vLLM: the stream's chunks have no place for them
                raise bad_request(
                    "prompt_logprobs are not available when stream is true", "prompt_logprobs"
                )
        if self.truncate_prompt_tokens is not None and not (
            self.truncate_prompt_tokens == -1 or 1 <= self.truncate_prompt_tokens <= INT64_MAX
        ):
            raise bad_request(
                "truncate_prompt_tokens must be -1 (the context length) or at least 1, got "
                f"{self.truncate_prompt_tokens}",
                "truncate_prompt_tokens",
            )

    def logit_bias_ids(self) -> dict[int, float] | None:
        """OpenAI's string keys as token ids; bias in [-100, 100] as OpenAI requires."""
        if not self.logit_bias:
            return None
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad_request(
                f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}",
                "logit_bias",
            )
        out: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            try:
                tid = int(key)
            except ValueError:
                raise bad_request(
                    f"logit_bias keys must be token ids, got {key[:40]!r}", "logit_bias"
                ) from None
            if not 0 <= tid <= INT32_MAX:
                raise bad_request(f"logit_bias key {tid} is not a token id", "logit_bias")
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise bad_request(
                    f"logit_bias values must be in [-100, 100], got {bias}", "logit_bias"
                )
            out[tid] = float(bias)
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The engine's parameters; SamplingParams.validate() raises InvalidRequestError."""
        return SamplingParams(
            n=1,  # the server fans n out into n engine requests
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.logit_bias_ids(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or None,
            prompt_logprobs=prompt_logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=structured,
        )


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM: BOS etc. when tokenizing a text prompt

    def check(self) -> None:
        self.check_common()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs"
            )
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be at least 1, got 0 (0 needs echo)", "max_tokens")

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: score the prompt, generate nothing (lm-eval's loglikelihood).
        As vLLM, one token runs and is dropped."""
        return self.echo and self.max_tokens == 0

    @property
    def engine_prompt_logprobs(self) -> int | None:
        # as vLLM: echo with logprobs asks for the prompt's logprobs too
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False  # vLLM: the reply starts with the last message when it has the reply's role
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM: on top of what the template adds
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None  # vLLM: handed to the template (RAG)
    reasoning_effort: str | None = None  # vLLM: handed to the template
    return_prompt_text: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise bad_request("messages must contain at least one message", "messages")
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(
                    f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                    "top_logprobs",
                )
            if self.top_logprobs > 0 and not self.logprobs:
                raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.continue_final_message:
            if "add_generation_prompt" in self.model_fields_set and self.add_generation_prompt:
                raise bad_request(
                    "continue_final_message and add_generation_prompt cannot both be true",
                    "continue_final_message",
                )
            self.add_generation_prompt = False  # the default gives way to the explicit request
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list):
                for part in m.content:
                    if part.type != "text" or part.text is None:
                        raise bad_request(
                            f"messages[{i}]: only text content parts are supported, got "
                            f"{part.type!r}",
                            f"messages[{i}].content",
                        )
        for key in self.chat_template_kwargs or {}:
            if key in RESERVED_TEMPLATE_KWARGS:
                raise bad_request(
                    f"chat_template_kwargs may not set {key!r}", f"chat_template_kwargs.{key}"
                )

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(value, the field it came from): max_completion_tokens wins when both are set."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as chat templates expect them: content a plain string."""
        out = []
        for m in self.messages:
            if isinstance(m.content, list):
                content = "".join(p.text or "" for p in m.content)
            else:
                content = m.content or ""
            msg: dict[str, Any] = {"role": m.role, "content": content}
            if m.name:
                msg["name"] = m.name
            if m.tool_calls:
                msg["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out

    def template_kwargs(self) -> dict[str, Any]:
        """What the template sees besides the messages; the request's own fields win."""
        kw: dict[str, Any] = dict(self.chat_template_kwargs or {})
        if self.documents is not None:
            kw["documents"] = self.documents
        if self.reasoning_effort is not None:
            kw["reasoning_effort"] = self.reasoning_effort
            kw.setdefault("enable_thinking", self.reasoning_effort != "none")  # as vLLM
        kw["add_generation_prompt"] = self.add_generation_prompt
        kw["continue_final_message"] = self.continue_final_message
        return kw

    def echo_text(self) -> str:
        """vLLM's chat echo: the last message's content, when its role is the reply's role
        (assistant after a generation prompt, else the last message's own role)."""
        if not self.echo:
            return ""
        role = "assistant" if self.add_generation_prompt else self.messages[-1].role
        last = self.template_messages()[-1]
        return last["content"] if last["role"] == role else ""


def _response_format_spec(rf: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's response_format (and vLLM's structural_tag one) as structured_outputs fields."""
    kind = rf.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise bad_request(
                "response_format.json_schema must be an object with a 'schema' object",
                "response_format",
            )
        # OpenAI: no schema means any JSON object; strict is what xgrammar always does
        return {"json": js.get("schema") or {"type": "object"}}
    return {"structural_tag": rf}


# ----------------------------------------------------------------------- /tokenize, /detokenize


class TokenizeCompletionRequest(_Base):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatCompletionRequest):
    """vLLM's chat form of /tokenize: the chat fields that shape the prompt."""

    return_token_strs: bool = False


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]
