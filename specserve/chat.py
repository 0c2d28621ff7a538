"""Chat conversations into prompts, through the model's own chat template (offline and server).

vLLM's rules: the template renders text (add_generation_prompt / continue_final_message and any
chat_template_kwargs are the template's variables), and the text is then tokenized with
add_special_tokens (False by default: only the special tokens the template writes). Tool calling
has its own issue; until then a conversation that carries it is refused by name, never rendered
without it.
"""

from __future__ import annotations

from typing import Any

from specserve.sampling_params import InvalidRequestError

TOOLS_UNSUPPORTED = "tool calling is not supported yet"
# chat_template_kwargs keys that would collide with the renderer's own arguments
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"chat_template", "conversation", "tokenize", "return_dict", "tools", "tokenizer_kwargs"}
)


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """Offline messages as templates expect them (content a string), checked: each a dict with a
    role, text content (a string or text parts), no tool-calling history."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of dicts", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be a dict with a 'role'", "messages")
        if m["role"] in ("tool", "function"):
            raise InvalidRequestError(
                f"messages[{i}]: role {m['role']!r}: {TOOLS_UNSUPPORTED}", f"messages[{i}].role"
            )
        for key in ("tool_calls", "function_call"):
            if m.get(key):
                raise InvalidRequestError(
                    f"messages[{i}].{key}: {TOOLS_UNSUPPORTED}", f"messages[{i}].{key}"
                )
        content = m.get("content")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise InvalidRequestError(
                    f"messages[{i}]: only text content parts are supported",
                    f"messages[{i}].content",
                )
            content = "".join(str(p.get("text") or "") for p in content)
        elif content is not None and not isinstance(content, str):
            raise InvalidRequestError(
                f"messages[{i}].content must be a string or a list of text parts",
                f"messages[{i}].content",
            )
        out.append({**m, "content": content or ""})
    return out


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs must be a dict", "chat_template_kwargs")
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {key!r}", f"chat_template_kwargs.{key}"
            )
    return dict(kwargs)


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    template_kwargs: dict[str, Any],
    add_special_tokens: bool = False,
    chat_template: str | None = None,
) -> tuple[str, list[int]]:
    """(prompt text, token ids) of a conversation under the model's chat template (or the given
    one). template_kwargs carries add_generation_prompt / continue_final_message and whatever
    else the template reads."""
    if chat_template is None and (
        tokenizer is None or not getattr(tokenizer, "chat_template", None)
    ):
        raise InvalidRequestError("this model has no chat template; use completions", "messages")
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, chat_template=chat_template, **template_kwargs
        )
    except Exception as e:  # jinja raises for conversations the template refuses
        raise InvalidRequestError(
            f"the chat template rejected these messages: {e}", "messages"
        ) from None
    if not isinstance(text, str):  # a batch-shaped answer from an unusual template
        raise InvalidRequestError("the chat template did not render a single prompt", "messages")
    return text, list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
