"""Fields of the OpenAI API and of vLLM that specserve cannot honour: refused by name.

The rule: a field that OpenAI or vLLM gives a meaning is either honoured with that meaning or
refused with a 400 whose `param` names it; a field nobody defines is ignored, as vLLM does. The
check runs on the raw JSON object, before any typing, so a refused feature is reported as
unsupported whatever shape its value has. A field is refused only when its value asks for
something: its "off" value (`use_beam_search: false`, `tools: []`, `length_penalty: 1`) is
accepted, because clients send defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specserve.chat import FUNCTIONS_UNSUPPORTED
from specserve.server.errors import bad_request

Check = Callable[[Any], bool]  # the raw value -> does it ask for an unsupported feature?


def _set(v: Any) -> bool:
    return v is not None


def _truthy(v: Any) -> bool:
    return v is not None and v is not False and v != [] and v != {} and v != ""


def _same(v: Any, off: Any) -> bool:
    # True == 1 in Python: a bool is never a number's "off" value, nor the reverse
    if isinstance(v, bool) or isinstance(off, bool):
        return type(v) is type(off) and v == off
    return v == off


def _not(*offs: Any) -> Check:
    """Asks for something unless it is None or one of the off values."""

    def check(v: Any) -> bool:
        return v is not None and not any(_same(v, o) for o in offs)

    return check


@dataclass(frozen=True)
class Refused:
    field: str
    what: str  # the feature, for the message
    asks: Check = _truthy


def _not_xgrammar(v: Any) -> bool:
    return v is not None and v not in ("xgrammar", "auto", "")


# both endpoints (structured outputs: structured_outputs, guided_json / guided_regex /
# guided_choice / guided_grammar and response_format are honoured, protocol.py)
COMMON: tuple[Refused, ...] = (
    Refused(
        "guided_decoding_backend",
        "the only structured-output backend is xgrammar ('xgrammar' or 'auto')",
        _not_xgrammar,
    ),  # fmt: skip
    Refused(
        "guided_whitespace_pattern", "a whitespace pattern is not supported (xgrammar)", _set
    ),  # fmt: skip
    Refused(
        "structural_tag",
        "the top-level structural_tag is not supported; use structured_outputs.structural_tag",
        _set,
    ),  # fmt: skip
    Refused("use_beam_search", "beam search is not supported"),
    Refused("length_penalty", "length_penalty (beam search) is not supported", _not(1, 1.0)),
    Refused("early_stopping", "early_stopping (beam search) is not supported"),
    Refused("watermarking", "watermarking is not supported"),
    Refused("prompt_embeds", "prompt_embeds are not supported"),
    Refused("logprob_token_ids", "logprob_token_ids is not supported"),
    Refused("priority", "priority scheduling is not supported", _not(0)),
    # specserve shares KV blocks between requests by prefix; a salt would have to split them
    Refused("cache_salt", "cache_salt is not supported"),
    Refused("kv_transfer_params", "disaggregated serving (kv_transfer_params) is not supported"),
    Refused("ec_transfer_params", "disaggregated serving (ec_transfer_params) is not supported"),
    Refused("vllm_xargs", "vllm_xargs (custom extensions) are not supported"),
    Refused("repetition_detection", "repetition_detection is not supported", _set),
    Refused("thinking_token_budget", "thinking_token_budget is not supported", _not(-1)),
    Refused(
        "stream_interval", "stream_interval is not supported (see stream_granularity)", _not(1)
    ),  # fmt: skip
    Refused("routed_experts_prompt_start", "routed experts are not reported", _not(0)),
    Refused(
        "spaces_between_special_tokens",
        "spaces_between_special_tokens=false is not supported",
        _not(True),
    ),  # fmt: skip
    Refused(
        "truncation_side",
        "only truncation_side 'left' (keep the last tokens) is supported",
        _not("left"),
    ),  # fmt: skip
    Refused("lora_request", "LoRA adapters are not supported", _set),
)

COMPLETION: tuple[Refused, ...] = (
    Refused("suffix", "suffix (fill-in-the-middle) is not supported"),
)

# chat: tools / tool_choice / parallel_tool_calls are honoured (serving.py)
CHAT: tuple[Refused, ...] = (
    Refused("functions", FUNCTIONS_UNSUPPORTED),
    Refused("function_call", FUNCTIONS_UNSUPPORTED, _not("none")),
    # the model's own template only: a template sent by a client runs on the server
    Refused(
        "chat_template",
        "a chat template in the request is not accepted; the model's own template is used",
        _set,
    ),  # fmt: skip
    Refused("media_io_kwargs", "multimodal input is not supported"),
    Refused("mm_processor_kwargs", "multimodal input is not supported"),
    Refused("audio", "audio output is not supported", _set),
    Refused("modalities", "only the text modality is supported", _not(["text"])),
    Refused("prediction", "predicted outputs are not supported", _set),
    Refused("web_search_options", "web search is not supported", _set),
    Refused("verbosity", "verbosity is not supported", _not("medium")),
)


def check_refused(data: dict[str, Any], table: tuple[Refused, ...]) -> None:
    for r in table:
        if r.field in data and r.asks(data[r.field]):
            raise bad_request(f"{r.field}: {r.what}", r.field, "unsupported_parameter")


RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


def check_response_format(data: dict[str, Any]) -> None:
    rf = data.get("response_format")
    if rf is None:
        return
    kind = rf.get("type", "text") if isinstance(rf, dict) else rf
    if kind not in RESPONSE_FORMATS:
        raise bad_request(
            f"response_format {str(kind)[:40]!r} is not supported; one of "
            f"{', '.join(RESPONSE_FORMATS)}",
            "response_format",
            "unsupported_parameter",
        )


def check_messages(data: dict[str, Any]) -> None:
    """The deprecated function-calling history (role 'function', function_call); tool calls and
    role 'tool' are honoured."""
    messages = data.get("messages")
    if not isinstance(messages, list):
        return
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        if m.get("role") == "function":
            raise bad_request(
                f"messages[{i}]: role 'function': {FUNCTIONS_UNSUPPORTED}",
                f"messages[{i}].role",
                "unsupported_parameter",
            )
        if _truthy(m.get("function_call")):
            raise bad_request(
                f"messages[{i}].function_call: {FUNCTIONS_UNSUPPORTED}",
                f"messages[{i}].function_call",
                "unsupported_parameter",
            )


def check_completion_body(data: dict[str, Any]) -> None:
    check_refused(data, COMMON)
    check_refused(data, COMPLETION)
    check_response_format(data)


def check_chat_body(data: dict[str, Any]) -> None:
    check_refused(data, COMMON)
    check_refused(data, CHAT)
    check_response_format(data)
    check_messages(data)
