"""The first half of /v1/completions and /v1/chat/completions (serving.py): everything a request
can get wrong, checked before its prompt reaches the engine; its prompts tokenized (chat template,
tools) in the tokenizer lanes; its structured-output constraint compiled; one SamplingParams per
engine request (prompts x n). The work one request may queue is bounded here."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass

from specserve.chat import chat_template_tools
from specserve.fanout import derive_seed
from specserve.sampling_params import InvalidRequestError, SamplingParams
from specserve.server.async_engine import AsyncEngine
from specserve.server.errors import ServerError, bad_request
from specserve.server.protocol import (
    MAX_ENGINE_REQUESTS,
    ChatCompletionRequest,
    CompletionRequest,
)
from specserve.server.tokenizing import TokenizerLanes
from specserve.structured.params import StructuredOutputsParams
from specserve.structured.tools import (
    ToolFunction,
    parse_tool_choice,
    parse_tools,
    tool_call_constraint,
)


@dataclass
class Prompt:
    """One prompt of a request, as the engine gets it."""

    ids: list[int]
    text: str | None  # what echo prepends; None: decode the ids when needed
    echo_text: str = ""


def invalid(e: InvalidRequestError, rename: dict[str, str] | None = None) -> ServerError:
    param = (rename or {}).get(e.param or "", e.param)
    return bad_request(str(e), param)


class RequestPreparation:
    def __init__(self, client: AsyncEngine, served_names: list[str], max_prompt_chars: int) -> None:
        self.client = client
        self.served_names = served_names
        self.lanes = TokenizerLanes(client.tokenizer, max_prompt_chars)

    # -- validation ---------------------------------------------------------------------------
    def check_model(self, name: str | None) -> str:
        if name is not None and name not in self.served_names:
            raise bad_request(
                f"model {name!r} does not exist; this server serves {self.served_names}",
                "model",
                "model_not_found",
            )
        return name or self.served_names[0]

    def max_tokens_for(self, n_prompt: int, requested: int | None, field: str, what: str) -> int:
        """The max_tokens to run with; 400 when the prompt, or prompt + max_tokens, cannot fit."""
        limit = self.client.max_model_len
        param = "messages" if what == "messages" else "prompt"
        if n_prompt >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {n_prompt} input tokens in the {what}, leaving no room for output. Please "
                f"reduce the length of the input (or set truncate_prompt_tokens).",
                param,
                "context_length_exceeded",
            )
        if n_prompt + 1 > self.client.max_kv_tokens:
            raise bad_request(
                f"The prompt has {n_prompt} tokens but the KV cache holds only "
                f"{self.client.max_kv_tokens} tokens. Please reduce the length of the input.",
                param,
                "context_length_exceeded",
            )
        if requested is None:
            return limit - n_prompt
        if requested < 1:
            raise bad_request(f"{field} must be at least 1, got {requested}", field)
        if n_prompt + requested > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + requested} tokens ({n_prompt} in the {what}, {requested} in the "
                f"completion). Please reduce the length of the {what} or {field}.",
                field,
                "context_length_exceeded",
            )
        return requested

    def check_fanout(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > MAX_ENGINE_REQUESTS:
            raise bad_request(
                f"{num_prompts} prompts x n={n} would queue {num_prompts * n} sequences; at most "
                f"{MAX_ENGINE_REQUESTS} per request",
                "n" if num_prompts == 1 else "prompt",
            )

    def truncate(self, ids: list[int], k: int | None) -> list[int]:
        """truncate_prompt_tokens: keep the last k tokens (-1: the context length), as vLLM.
        Done here so echo, usage and the context checks see the prompt the engine runs."""
        if k is None:
            return ids
        k = self.client.max_model_len if k == -1 else k
        return ids[-k:] if len(ids) > k else ids

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.client.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise bad_request(f"{param} token ids must be in [0, {vocab})", param)

    async def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        if text == "":
            raise bad_request(f"{param} must not be empty", param)
        if self.client.tokenizer is None:
            raise bad_request("this model has no tokenizer: send token ids", param)
        try:
            text.encode("utf-8")  # JSON may carry lone surrogates ("\ud800") no tokenizer takes
        except UnicodeEncodeError as e:
            raise bad_request(f"{param} is not valid Unicode: {e.reason}", param) from None
        try:
            return await self.lanes.encode(text, add_special_tokens, param)
        except InvalidRequestError as e:
            raise invalid(e) from None

    async def completion_prompts(self, req: CompletionRequest) -> list[Prompt]:
        p = req.prompt
        if isinstance(p, str):
            items: list[str | list[int]] = [p]
        elif not p:
            raise bad_request("prompt must not be empty", "prompt")
        elif isinstance(p[0], int):
            items = [list(p)]  # type: ignore[arg-type]
        else:
            items = list(p)  # type: ignore[arg-type]
        self.check_fanout(len(items), req.n)
        try:
            self.lanes.check_size(sum(len(x) for x in items if isinstance(x, str)), "prompt")
        except InvalidRequestError as e:
            raise invalid(e) from None
        out: list[Prompt] = []
        for item in items:
            if isinstance(item, str):
                ids = await self.encode(item, req.add_special_tokens, "prompt")
                text: str | None = item
            elif not item:
                raise bad_request("prompt token id lists must not be empty", "prompt")
            else:
                ids, text = list(item), None
                self.check_token_ids(ids, "prompt")
            kept = self.truncate(ids, req.truncate_prompt_tokens)
            if len(kept) < len(ids):
                text = None
            out.append(Prompt(kept, text))
        if req.echo:
            for pr in out:
                pr.echo_text = pr.text if pr.text is not None else await self.lanes.decode(pr.ids)
        return out

    async def structured(
        self, spec: StructuredOutputsParams | None, field: str
    ) -> StructuredOutputsParams | None:
        """Compile the request's output constraint in the grammar backend's thread, before the
        request is queued (the engine then finds it cached); a 400 naming the field when it
        does not compile."""
        if spec is None:
            return None
        try:
            await asyncio.wrap_future(self.client.engine.grammars.submit(spec))
        except InvalidRequestError as e:
            raise bad_request(str(e).replace("structured_outputs", field, 1), field) from None
        return spec

    def chat_tools(
        self, req: ChatCompletionRequest
    ) -> tuple[list[ToolFunction], str, StructuredOutputsParams | None]:
        """(tools, tool choice, the constraint a required / named choice imposes)."""
        try:
            fns = parse_tools(req.tools)
            choice = parse_tool_choice(req.tool_choice, fns)
        except InvalidRequestError as e:
            raise invalid(e) from None
        fmt = chat_template_tools(self.client.tokenizer).format
        parallel = req.parallel_tool_calls is not False
        return fns, choice, tool_call_constraint(fns, choice, parallel, fmt)

    async def chat_prompt(
        self, req: ChatCompletionRequest, tools: list[ToolFunction] | None = None
    ) -> tuple[str, list[int]]:
        if self.client.tokenizer is None:
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        messages = req.template_messages()
        for i, m in enumerate(messages):
            try:
                m["content"].encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad_request(
                    f"messages[{i}].content is not valid Unicode: {e.reason}",
                    f"messages[{i}].content",
                ) from None
        try:
            return await self.lanes.render_chat(
                messages, req.template_kwargs(), req.add_special_tokens, tools
            )
        except InvalidRequestError as e:
            raise invalid(e) from None

    def build_params(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        prompts: list[Prompt],
        requested: int | None,
        field: str,
        what: str,
        logprobs: int | None,
        prompt_logprobs: int | None,
        rename: dict[str, str],
        structured: StructuredOutputsParams | None = None,
    ) -> list[SamplingParams]:
        params: list[SamplingParams] = []
        for p in prompts:
            max_tokens = self.max_tokens_for(len(p.ids), requested, field, what)
            try:
                base = req.sampling_params(max_tokens, logprobs, prompt_logprobs, structured)
                base.validate_for_model(self.client.vocab_size, self.client.max_model_len)
            except InvalidRequestError as e:
                raise invalid(e, rename) from None
            for i in range(req.n):
                params.append(base if i == 0 else _with_seed(base, req.seed, i))
        return params


def _with_seed(base: SamplingParams, seed: int | None, i: int) -> SamplingParams:
    """The i-th sample of a prompt (fanout.derive_seed: the offline API draws the same)."""
    sp = copy.copy(base)
    if seed is not None:
        sp.seed = derive_seed(seed, i)
    return sp
