"""Tool calling: OpenAI tool definitions and tool_choice, the tool-call format of the model's chat
template, conversations with tool history rendered through it, and the grammar that `required`
and named choices constrain the output to.

Formats:
  hermes       `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per
               call (Qwen2.5 / Qwen3 templates, NousResearch Hermes). Templates that know
               nothing of tools (SmolLM2's) get this format too: the tools and the format are
               described in the system message, assistant calls are written as these blocks,
               and tool results are user messages in `<tool_response>` blocks.
  llama3_json  `{"name": ..., "parameters": {...}}` (Llama 3.1 / 3.2 templates, which render
               tools and `ipython` results themselves); several calls separated by "; ".

`auto` leaves the output free and parses it afterwards (vLLM's behaviour); `required` and a
named function constrain it with an xgrammar structural tag: one or more calls (only the named
function for a named choice; one call when parallel_tool_calls is false) whose arguments follow
each function's JSON schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from specserve.structured.params import StructuredOutputsParams

HERMES, LLAMA3_JSON = "hermes", "llama3_json"
MAX_WHITESPACE = 16  # characters of whitespace between two tokens of a call's arguments


def _bad(message: str, param: str) -> Exception:
    from specserve.sampling_params import InvalidRequestError

    return InvalidRequestError(message, param)


@dataclass(frozen=True)
class ToolFunction:
    name: str
    description: str | None
    parameters: dict  # a JSON schema of the arguments object
    strict: bool | None = None

    def openai(self) -> dict[str, Any]:
        """The OpenAI tool definition (what templates are handed)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


def parse_tools(tools: Any) -> list[ToolFunction]:
    """OpenAI's `tools`: [{"type": "function", "function": {name, description?, parameters?,
    strict?}}]; a clear error naming the entry otherwise."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _bad("tools must be a list of tool definitions", "tools")
    out: list[ToolFunction] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise _bad(f"{where}: only tools of type 'function' are supported", where)
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function must be an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise _bad(f"{where}.function.name must be a string of 1-64 characters", where)
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters must be a JSON schema object", where)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise _bad(f"{where}.function.description must be a string", where)
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _bad(f"{where}.function.strict must be a boolean", where)
        if any(f.name == name for f in out):
            raise _bad(f"{where}: two tools are named {name!r}", where)
        out.append(ToolFunction(name, desc, params, strict))
    return out


def parse_tool_choice(choice: Any, tools: list[ToolFunction]) -> str:
    """'none' | 'auto' | 'required' | the name of the function forced. Default: 'auto' with
    tools, 'none' without (OpenAI)."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _bad(
                f"tool_choice must be 'none', 'auto', 'required' or a named function, got "
                f"{choice[:40]!r}",
                "tool_choice",
            )
        if choice != "none" and not tools:
            raise _bad(f"tool_choice {choice!r} needs tools", "tool_choice")
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if not any(t.name == name for t in tools):
            raise _bad(
                f"tool_choice names a function that is not in tools: {name!r}", "tool_choice"
            )
        return name
    raise _bad(
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


# -- the chat template's format ----------------------------------------------------------------
@dataclass(frozen=True)
class TemplateTools:
    """How a chat template deals with tools."""

    format: str  # HERMES or LLAMA3_JSON: what the model writes, what the parser reads
    native: bool  # the template renders tools, tool calls and tool results itself


def template_tools(template: str | None) -> TemplateTools:
    t = template or ""
    if "<tool_call>" in t:
        return TemplateTools(HERMES, True)
    if "<|python_tag|>" in t or "ipython" in t:
        return TemplateTools(LLAMA3_JSON, True)
    if "tools" in t and "tool_calls" in t:  # a template of its own with tools: let it render
        return TemplateTools(HERMES, True)
    return TemplateTools(HERMES, False)


def _arguments(call: Any, where: str) -> tuple[str, Any]:
    """(name, arguments as an object) of an assistant message's tool call."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad(
            f"{where} must be {{'type': 'function', 'function': {{name, arguments}}}}", where
        )
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise _bad(f"{where}.function.arguments is not valid JSON", where) from None
    return fn["name"], args


def _hermes_block(name: str, args: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def hermes_system_prompt(tools: list[ToolFunction]) -> str:
    lines = "\n".join(json.dumps(t.openai()) for t in tools)
    return (
        "You can call functions to help with the user's request. The functions you may call are "
        "described in JSON inside <tools></tools> tags:\n<tools>\n"
        f"{lines}\n</tools>\n"
        "To call a function, reply with a JSON object holding its name and arguments inside "
        "<tool_call></tool_call> tags, one block per call:\n"
        '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>'
    )


def tool_conversation(
    messages: list[dict[str, Any]], tools: list[ToolFunction], tt: TemplateTools
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, template kwargs) to render a conversation that carries tools or tool history.
    A native template gets the tools and the history as they are (tool call arguments as
    objects, as templates expect); other templates get the Hermes-style rewrite."""
    if tt.native:
        out = []
        for i, m in enumerate(messages):
            calls = m.get("tool_calls")
            if calls:
                fixed = []
                for j, c in enumerate(calls):
                    name, args = _arguments(c, f"messages[{i}].tool_calls[{j}]")
                    fixed.append({**c, "function": {"name": name, "arguments": args}})
                m = {**m, "tool_calls": fixed}
            out.append(m)
        return out, ({"tools": [t.openai() for t in tools]} if tools else {})
    out = []
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [
                _hermes_block(*_arguments(c, f"messages[{i}].tool_calls[{j}]"))
                for j, c in enumerate(m["tool_calls"])
            ]
            content = "\n".join(([content] if content else []) + blocks)
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    if tools:
        prompt = hermes_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


# -- the constraint of `required` and named choices --------------------------------------------
def _tag(fmt: str, t: ToolFunction) -> dict[str, Any]:
    name = json.dumps(t.name)
    # whitespace inside the arguments is bounded: small models otherwise pad a call forever
    schema = {"type": "json_schema", "json_schema": t.parameters,
              "max_whitespace_cnt": MAX_WHITESPACE}  # fmt: skip
    if fmt == LLAMA3_JSON:
        return {"type": "tag", "begin": f'{{"name": {name}, "parameters": ', "content": schema,
                "end": "}"}  # fmt: skip
    return {"type": "tag", "begin": f'<tool_call>\n{{"name": {name}, "arguments": ',
            "content": schema, "end": "}\n</tool_call>"}  # fmt: skip


def tool_call_constraint(
    tools: list[ToolFunction], choice: str, parallel: bool, fmt: str
) -> StructuredOutputsParams | None:
    """The structured output that `required` or a named choice imposes (None for auto/none)."""
    if choice in ("auto", "none"):
        return None
    forced = tools if choice == "required" else [t for t in tools if t.name == choice]
    sep = "; " if fmt == LLAMA3_JSON else "\n"
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": [_tag(fmt, t) for t in forced],
            "separator": sep,
            "at_least_one": True,
            "stop_after_first": not parallel or choice != "required",
        },
    }
    return StructuredOutputsParams(structural_tag=tag)
