"""A manual check of litellm against a running specserve server: forced tool calls (`required`
and a named function), streamed and not, a tool's answer sent back in the history, and a strict
JSON-schema response. litellm (~230 MB with botocore) is not in the dev extras, so CI does not
run this; run it by hand in a venv of its own:

    python3 -m venv /tmp/lt && /tmp/lt/bin/pip install litellm
    specserve serve --port 8011 &
    LITELLM_LOCAL_MODEL_COST_MAP=True /tmp/lt/bin/python tools/check_litellm.py \
        http://127.0.0.1:8011/v1 SmolLM2-135M-Instruct.Q4_1.gguf

It raises on the first answer that is not the expected shape, and prints each result.
"""

import json
import sys

import litellm

BASE = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8011/v1"
MODEL = "openai/" + (sys.argv[2] if len(sys.argv) > 2 else "SmolLM2-135M-Instruct")
tools = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
kw = dict(model=MODEL, api_base=BASE, api_key="unused", temperature=0, max_tokens=60)


def checked_call(message, how: str, choice) -> object:  # noqa: ANN001
    """The one get_weather call of `message`, its arguments checked; printed."""
    (call,) = message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and isinstance(args["city"], str), message
    print(how, choice if isinstance(choice, str) else "named", "->", call.function.name, args)
    return call


for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
    r = litellm.completion(messages=msgs, tools=tools, tool_choice=choice, **kw)
    checked_call(r.choices[0].message, "non-streamed", choice)
    chunks = list(
        litellm.completion(messages=msgs, tools=tools, tool_choice=choice, stream=True, **kw)
    )
    built = litellm.stream_chunk_builder(chunks, messages=msgs)
    call = checked_call(built.choices[0].message, f"streamed ({len(chunks)} chunks)", choice)
# history with the tool's answer goes back through the template
msgs2 = msgs + [
    built.choices[0].message.model_dump(exclude_none=True),
    {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
]
r = litellm.completion(messages=msgs2, tools=tools, **kw)
print("after the tool's answer:", repr(r.choices[0].message.content)[:120])
schema = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
r = litellm.completion(
    messages=[{"role": "user", "content": "Invent a person."}],
    response_format={
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": schema, "strict": True},
    },
    **kw,
)
obj = json.loads(r.choices[0].message.content)
assert set(obj) == {"name", "age"} and isinstance(obj["age"], int), obj
print("json_schema ->", obj)
print("litellm OK")
