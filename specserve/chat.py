"""Chat conversations into prompts, through the model's own chat template (offline and server).

vLLM's rules: the template renders text (add_generation_prompt / continue_final_message and any
chat_template_kwargs are the template's variables), and the text is then tokenized with
add_special_tokens (False by default: only the special tokens the template writes). Tools and
tool-calling history (assistant tool_calls, role "tool" results) go through the template's own
tool format where it has one, else a Hermes-style rewrite (structured/tools.py).
"""

from __future__ import annotations

from typing import Any

from specserve.sampling_params import InvalidRequestError
from specserve.structured.tools import (
    TemplateTools,
    ToolFunction,
    template_tools,
    tool_conversation,
)

FUNCTIONS_UNSUPPORTED = "the deprecated function-calling fields are not supported; use tools"
# chat_template_kwargs keys that would collide with the renderer's own arguments
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"chat_template", "conversation", "tokenize", "return_dict", "tools", "tokenizer_kwargs"}
)


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """Offline messages as templates expect them (content a string), checked: each a dict with a
    role, text content (a string or text parts); tool history as OpenAI shapes it."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of dicts", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be a dict with a 'role'", "messages")
        if m["role"] == "function":
            raise InvalidRequestError(
                f"messages[{i}]: role 'function': {FUNCTIONS_UNSUPPORTED}", f"messages[{i}].role"
            )
        if m.get("function_call"):
            raise InvalidRequestError(
                f"messages[{i}].function_call: {FUNCTIONS_UNSUPPORTED}",
                f"messages[{i}].function_call",
            )
        calls = m.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or m["role"] != "assistant"):
            raise InvalidRequestError(
                f"messages[{i}].tool_calls must be a list, on an assistant message",
                f"messages[{i}].tool_calls",
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


def chat_template_tools(tokenizer: Any, chat_template: str | None = None) -> TemplateTools:
    """The tool-call format of the template a conversation renders with."""
    t = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    return template_tools(t if isinstance(t, str) else None)


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    template_kwargs: dict[str, Any],
    add_special_tokens: bool = False,
    chat_template: str | None = None,
    tools: list[ToolFunction] | None = None,
) -> tuple[str, list[int]]:
    """(prompt text, token ids) of a conversation under the model's chat template (or the given
    one). template_kwargs carries add_generation_prompt / continue_final_message and whatever
    else the template reads; tools and tool history are rendered in the template's format."""
    if chat_template is None and (
        tokenizer is None or not getattr(tokenizer, "chat_template", None)
    ):
        raise InvalidRequestError("this model has no chat template; use completions", "messages")
    if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        tt = chat_template_tools(tokenizer, chat_template)
        messages, extra = tool_conversation(messages, tools or [], tt)
        template_kwargs = {**template_kwargs, **extra}
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


def conversation_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """A conversation ending in a user turn, under the chat template with the generation
    prompt, tokenized as the engine does; the turns' texts one a line without a template."""
    if not getattr(tokenizer, "chat_template", None):
        text = "\n".join(m["content"] for m in messages)
        return list(tokenizer.encode(text, add_special_tokens=True))
    return render_chat(tokenizer, messages, {"add_generation_prompt": True})[1]


def user_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """One user turn under the model's chat template, tokenized as the engine does (vLLM's
    rules: the template writes the special tokens, none are added again); plain text for a
    tokenizer without a template."""
    return conversation_prompt_ids(tokenizer, [{"role": "user", "content": text}])
