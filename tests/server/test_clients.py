"""Agent frameworks against a real server: LangChain's ChatOpenAI `bind_tools` (a forced call,
named and `any`) and `with_structured_output` (json_schema, strict) on the default model, the
results parsed back into typed objects. litellm is checked by hand with tools/check_litellm.py,
not here: its install is ~230 MB (litellm 200 MB, botocore 32 MB), too much for the dev extras."""

from __future__ import annotations

import jsonschema
import langchain_openai as lc_openai
import pydantic
import pytest

from tests.server.conftest import Served, smol  # noqa: F401  (fixtures)


class Person(pydantic.BaseModel):
    name: str
    age: int


class GetWeather(pydantic.BaseModel):
    """Current weather in a city."""

    city: str


def _chat(srv: Served, **kw) -> lc_openai.ChatOpenAI:
    return lc_openai.ChatOpenAI(
        model=srv.model, base_url=srv.url + "/v1", api_key="unused", temperature=0,
        max_tokens=60, max_retries=0, timeout=120, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("tool_choice", ["GetWeather", "any"])
def test_langchain_bind_tools_forced_call(smol: Served, tool_choice: str):  # noqa: F811
    llm = _chat(smol).bind_tools([GetWeather], tool_choice=tool_choice)
    msg = llm.invoke("What is the weather in Paris?")
    assert not msg.invalid_tool_calls
    (call,) = msg.tool_calls
    assert call["name"] == "GetWeather" and call["id"]
    jsonschema.validate(call["args"], GetWeather.model_json_schema())
    assert isinstance(GetWeather(**call["args"]).city, str)


def test_langchain_with_structured_output_json_schema(smol: Served):  # noqa: F811
    llm = _chat(smol).with_structured_output(Person, method="json_schema", strict=True)
    out = llm.invoke("Describe a person named Ann aged 30 as JSON.")
    assert isinstance(out, Person)
    assert isinstance(out.name, str) and isinstance(out.age, int)
    # include_raw: the raw message is the server's, parsed without error
    raw = _chat(smol).with_structured_output(Person, method="json_schema", include_raw=True)
    res = raw.invoke("Describe a person named Ann aged 30 as JSON.")
    assert res["parsing_error"] is None and res["parsed"] == out
