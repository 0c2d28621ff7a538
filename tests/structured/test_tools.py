"""Tool calling offline: the parser (Hermes and Llama-3.1 JSON formats, whole and streamed in
any split), conversations with tools and tool history through a template without tools
(Hermes rewrite) and through Qwen-/Llama-style templates, and `required` / named choices whose
calls parse and validate against the functions' schemas."""

from __future__ import annotations

import json

import jsonschema
import pytest

from specserve import SamplingParams
from specserve.sampling_params import InvalidRequestError
from specserve.structured.tool_parser import StreamingToolParser, parse_tool_calls
from specserve.structured.tools import (
    HERMES,
    LLAMA3_JSON,
    parse_tool_choice,
    parse_tools,
    template_tools,
    tool_conversation,
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                   "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"],
    "additionalProperties": False,
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
HERMES_OUT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}'
    "\n</tool_call>"
)


def _split_feed(text: str, fmt: str, cuts: list[int]):
    p = StreamingToolParser(fmt)
    content, calls, last = "", [], 0
    for c in [*cuts, len(text)]:
        a, b = p.feed(text[last:c])
        content, calls, last = content + a, calls + b, c
    a, b = p.finish()
    return content + a, calls + b


def test_hermes_parse_whole_and_streamed_in_any_split():
    content, calls = parse_tool_calls(HERMES_OUT, HERMES)
    assert content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]  # fmt: skip
    for step in (1, 3, 7, 13):
        s_content, s_calls = _split_feed(
            HERMES_OUT, HERMES, list(range(step, len(HERMES_OUT), step))
        )
        assert s_content == content
        assert [(c.name, c.arguments) for c in s_calls] == [(c.name, c.arguments) for c in calls]


def test_malformed_or_unclosed_calls_stay_text():
    bad = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls(bad, HERMES) == (bad, [])
    cut = '<tool_call>\n{"name": "add", "arguments": {"a": 1'
    assert parse_tool_calls(cut, HERMES) == (cut, [])
    # a model that stops after whole JSON without the closing tag: still a call
    content, calls = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {}}', HERMES)
    assert content is None and calls[0].name == "add"
    assert parse_tool_calls("plain text < not a tag", HERMES) == ("plain text < not a tag", [])


def test_llama3_json_parse():
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": 3, "b": 4}}'
    content, calls = parse_tool_calls(text, LLAMA3_JSON)
    assert content is None and [json.loads(c.arguments)["a"] for c in calls] == [1, 3]
    assert parse_tool_calls("The answer is {1}.", LLAMA3_JSON) == ("The answer is {1}.", [])
    s_content, s_calls = _split_feed(text, LLAMA3_JSON, [2, 9, 30])
    assert s_content == "" and len(s_calls) == 2


def test_template_formats():
    assert template_tools(None) == template_tools("{{ messages }}")
    assert not template_tools(None).native and template_tools(None).format == HERMES
    assert template_tools("{% if tools %}<tool_call>{% endif %}").format == HERMES
    assert template_tools("<|python_tag|>{{ tools }}").format == LLAMA3_JSON


def test_tool_definitions_and_choice_are_checked():
    fns = parse_tools(TOOLS)
    assert parse_tool_choice(None, fns) == "auto" and parse_tool_choice(None, []) == "none"
    assert parse_tool_choice({"type": "function", "function": {"name": "add"}}, fns) == "add"
    for bad, param in [
        ([{"type": "retrieval"}], "tools[0]"),
        ([{"type": "function", "function": {"name": ""}}], "tools[0]"),
        ([TOOLS[0], TOOLS[0]], "tools[1]"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            parse_tools(bad)
        assert e.value.param == param
    for bad in ["sometimes", {"type": "function", "function": {"name": "nope"}}]:
        with pytest.raises(InvalidRequestError) as e:
            parse_tool_choice(bad, fns)
        assert e.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError):
        parse_tool_choice("required", [])


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
]  # fmt: skip


def test_history_through_a_template_without_tools(off):
    text = off.tokenizer.decode(off.apply_chat_template(HISTORY, tools=TOOLS))
    assert '"name": "get_weather"' in text and "<tools>" in text  # tools in the system prompt
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in text
    )
    assert "<tool_response>\n21 C\n</tool_response>" in text


def test_history_through_native_templates(default_tokenizer):
    qwen = (
        "{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>"
        "{% endfor %}{% endif %}{{ m.content or '' }}\n{% endfor %}"
        "{% if tools %}TOOLS {{ tools | length }}{% endif %}"
    )
    from specserve.chat import render_chat

    text, _ = render_chat(default_tokenizer, [dict(m) for m in HISTORY], {}, False, qwen,
                          parse_tools(TOOLS))  # fmt: skip
    # arguments reach the template as an object, the tool result keeps its role
    assert 'get_weather {"city": "Paris", "unit": "c"}' in text
    assert "tool:21 C" in text and "TOOLS 2" in text
    msgs, kw = tool_conversation(HISTORY, parse_tools(TOOLS), template_tools(qwen))
    assert kw["tools"][0]["function"]["name"] == "get_weather"


CONVS = [[{"role": "user", "content": q}] for q in ("Weather in Oslo?", "Add 2 and 3.")]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_calls_parse_and_validate(off, choice, temperature):
    sp = SamplingParams(max_tokens=120, temperature=temperature, seed=3)
    outs = off.chat(CONVS, sp, use_tqdm=False, tools=TOOLS, tool_choice=choice)
    done = 0
    for o in outs:
        content, calls = off.parse_tool_calls(o.outputs[0].text)
        if o.outputs[0].finish_reason == "length":
            continue  # the random model repeats calls: a cut one stays text
        done += 1
        assert content is None and calls
        for c in calls:
            fn = c["function"]
            if isinstance(choice, dict):
                assert fn["name"] == "add"
            jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])
    assert done or isinstance(choice, str)


def test_constrained_calls_greedy_identical_with_ngram(off, ngram):
    kw = dict(use_tqdm=False, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    sp = SamplingParams(max_tokens=80, temperature=0.0)
    ref = off.chat(CONVS, sp, **kw)
    got = ngram.chat(CONVS, sp, **kw)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    for o in ref:
        calls = off.parse_tool_calls(o.outputs[0].text)[1]
        assert len(calls) == 1  # parallel_tool_calls false: one call, then the grammar ends
