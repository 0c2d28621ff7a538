"""The official openai client drives structured outputs and tool calls against a real server:
response_format json_schema / json_object and tools (required, named, history), streamed and
not, on the default model (SmolLM2 writes sensible JSON); vLLM's structured_outputs / guided_*
fields on the tiny model; errors name the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import Served, smol, tiny  # noqa: F401  (fixtures)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Describe a person named Ann aged 30 as JSON."}]
COLOUR = [{"role": "user", "content": "Give a JSON object with a key 'colour'."}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _stream_text(stream) -> tuple[str, str | None]:
    text, finish = "", None
    for ch in stream:
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize(
    "rf",
    [
        {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}},
        {"type": "json_object"},
    ],
    ids=["json_schema", "json_object"],
)
def test_response_format_streamed_and_not(smol: Served, rf: dict):  # noqa: F811
    c = smol.openai()
    messages = ASK if rf["type"] == "json_schema" else COLOUR
    kw = dict(model=smol.model, messages=messages, max_tokens=60, temperature=0, response_format=rf)
    r = c.chat.completions.create(**kw)
    content = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(content)
    assert isinstance(value, dict)
    if rf["type"] == "json_schema":
        jsonschema.validate(value, PERSON)
    text, finish = _stream_text(c.chat.completions.create(**kw, stream=True))
    assert (text, finish) == (content, "stop")


def _calls_from_stream(stream) -> tuple[list[dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for ch in stream:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        for tc in d.tool_calls or []:
            cur = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            cur["name"] += tc.function.name or ""
            cur["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(
    ("choice", "finish"),
    [
        ("required", "tool_calls"),
        ({"type": "function", "function": {"name": "get_weather"}}, "stop"),
    ],
    ids=["required", "named"],
)
def test_tool_calls_streamed_and_not(smol: Served, choice, finish):  # noqa: F811
    c = smol.openai()
    kw = dict(model=smol.model, messages=WEATHER, max_tokens=60, temperature=0,
              tools=[WEATHER_TOOL], tool_choice=choice, parallel_tool_calls=False)  # fmt: skip
    r = c.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == finish and msg.content is None
    (call,) = msg.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER_TOOL["function"]["parameters"])
    streamed, s_finish = _calls_from_stream(c.chat.completions.create(**kw, stream=True))
    assert s_finish == finish
    assert [(x["name"], json.loads(x["arguments"])) for x in streamed] == [("get_weather", args)]
    # the call and its result go back as history, rendered through the template
    history = [*WEATHER, msg.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"}]  # fmt: skip
    r2 = c.chat.completions.create(model=smol.model, messages=history, max_tokens=8,
                                   temperature=0, tools=[WEATHER_TOOL])  # fmt: skip
    assert r2.choices[0].message.role == "assistant"


def post(srv: Served, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=120)


@pytest.mark.parametrize(
    ("field", "value", "check"),
    [
        ("guided_choice", ["alpha", "beta"], lambda t: t in ("alpha", "beta")),
        ("guided_regex", "[0-9]{2}-[a-z]{2}", lambda t: len(t) == 5 and t[2] == "-"),
        ("structured_outputs", {"choice": ["x", "y"]}, lambda t: t in ("x", "y")),
        ("guided_json", {"enum": ["on", "off"]}, lambda t: json.loads(t) in ("on", "off")),
        ("guided_grammar", 'root ::= "a" | "bb"', lambda t: t in ("a", "bb")),
    ],
)
def test_vllm_fields_on_completions(tiny: Served, field, value, check):  # noqa: F811
    body = {"model": tiny.model, "prompt": "x", "max_tokens": 20, "temperature": 0, field: value}
    r = post(tiny, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert check(choice["text"]) and choice["finish_reason"] == "stop", choice


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_json": {"type": "nope"}}, "guided_json"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
            "response_format",
        ),  # fmt: skip
        ({"response_format": {"type": "grammar"}}, "response_format"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice",
        ),
    ],
)
def test_errors_name_the_field(tiny: Served, extra, param):  # noqa: F811
    body = {"model": tiny.model, "messages": WEATHER, "max_tokens": 4, **extra}
    r = post(tiny, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_openai_client_extra_body_with_tiny(tiny: Served):  # noqa: F811
    c = tiny.openai()
    r = c.chat.completions.create(
        model=tiny.model, messages=WEATHER, max_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"json": PERSON | {"properties": {
            "name": {"type": "string", "maxLength": 5}, "age": {"type": "integer",
            "minimum": 0, "maximum": 99}}}, "disable_any_whitespace": True}})  # fmt: skip
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(
            model=tiny.model, messages=WEATHER, max_tokens=4, extra_body={"guided_json": "{x"}
        )
