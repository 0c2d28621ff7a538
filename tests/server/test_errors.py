"""Bad input gets an OpenAI-shaped 4xx naming the problem; the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from specserve.server.launch import ServerOptions, ServerThread
from tests.server.conftest import Served

CTX = 2048  # dummy:tiny's max_position_embeddings
VOCAB = 49152


def _ok_completion(model: str) -> dict:
    return {"model": model, "prompt": "hello", "max_tokens": 2}


def _ok_chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


# (name, endpoint, body changes (None value deletes the key) or raw bytes, status, param, words)
CASES = [
    ("malformed json", "c", b'{"prompt": "x",', 400, None, ["not valid JSON"]),
    ("body not an object", "c", b"[1, 2]", 400, None, ["JSON object"]),
    ("missing prompt", "c", {"prompt": None}, 400, "prompt", ["prompt", "required"]),
    ("unknown model", "c", {"model": "gpt-17"}, 400, "model", ["gpt-17", "does not exist"]),
    ("negative temperature", "c", {"temperature": -1}, 400, "temperature", ["temperature"]),
    ("top_p zero", "c", {"top_p": 0}, 400, "top_p", ["top_p"]),
    ("max_tokens zero", "c", {"max_tokens": 0}, 400, "max_tokens", ["max_tokens"]),
    ("max_tokens not int", "c", {"max_tokens": "many"}, 400, "max_tokens", ["integer"]),
    ("n zero", "c", {"n": 0}, 400, "n", ["n must be"]),
    ("logprobs too many", "c", {"logprobs": 50}, 400, "logprobs", ["logprobs"]),
    ("prompt longer than context", "c", {"prompt": [5] * (CTX + 10)}, 400, "prompt", [str(CTX), str(CTX + 10)]),
    ("prompt + max_tokens over context", "c", {"prompt": [5] * 100, "max_tokens": CTX}, 400, "max_tokens", [str(CTX), str(CTX + 100)]),
    ("token id out of vocab", "c", {"prompt": [1, VOCAB + 5]}, 400, "prompt", [str(VOCAB)]),
    ("empty prompt", "c", {"prompt": ""}, 400, "prompt", ["empty"]),
    ("prompt with a lone surrogate", "c", b'{"prompt": "a\\ud800b"}', 400, "prompt", ["unicode"]),
    ("empty prompt list", "c", {"prompt": []}, 400, "prompt", ["empty"]),
    ("stop not a string", "c", {"stop": 5}, 400, "stop", ["stop"]),
    ("presence_penalty out of range", "c", {"presence_penalty": 3}, 400, "presence_penalty", ["presence_penalty"]),
    ("repetition_penalty zero", "c", {"repetition_penalty": 0}, 400, "repetition_penalty", ["repetition_penalty"]),
    ("min_tokens over max_tokens", "c", {"min_tokens": 5}, 400, "min_tokens", ["min_tokens"]),
    ("stream_options without stream", "c", {"stream_options": {"include_usage": True}}, 400, "stream_options", ["stream"]),
    ("seed over 64 bits", "c", {"seed": 2**70}, 400, "seed", ["seed"]),
    ("bad stream_granularity", "c", {"stream_granularity": "word"}, 400, "stream_granularity", ["token"]),
    ("logit_bias key not a token id", "c", {"logit_bias": {"x5": 1.0}}, 400, "logit_bias", ["logit_bias"]),
    ("chat: no messages", "chat", {"messages": []}, 400, "messages", ["messages"]),
    ("chat: bad role", "chat", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", ["role"]),
    ("chat: top_logprobs without logprobs", "chat", {"top_logprobs": 2}, 400, "top_logprobs", ["logprobs"]),
    ("chat: image part", "chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "messages[0].content", ["image_url"]),
    ("chat: max_completion_tokens over context", "chat", {"max_completion_tokens": CTX * 2}, 400, "max_completion_tokens", [str(CTX)]),
    ("chat: deprecated functions", "chat", {"functions": [{"name": "f"}]}, 400, "functions", ["functions"]),
    ("chat: tool of another type", "chat", {"tools": [{"type": "retrieval"}]}, 400, "tools[0]", ["function"]),
]  # fmt: skip


@pytest.fixture(scope="module")
def strict(tiny: Served) -> Iterator[Served]:
    """A second app on the tiny engine thread: API key required, 4 KiB body limit."""
    server = ServerThread(
        tiny.server.client, ServerOptions(port=0, api_key="sekret", max_body_bytes=4096)
    ).start()
    yield Served(server, tiny.llm, tiny.model)
    server.stop()


def _post(url: str, endpoint: str, body: dict | bytes, **kw) -> httpx.Response:
    path = "/v1/completions" if endpoint == "c" else "/v1/chat/completions"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    return httpx.post(url + path, content=content, headers=headers, timeout=60, **kw)


def _check_error(resp: httpx.Response, status: int, param: str | None, words: list[str]) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    for w in words:
        assert w.lower() in err["message"].lower(), (w, err["message"])
    if status == 400:
        assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(tiny: Served, case):
    _, endpoint, change, status, param, words = case
    if isinstance(change, bytes):
        body: dict | bytes = change
    else:
        body = _ok_completion(tiny.model) if endpoint == "c" else _ok_chat(tiny.model)
        for k, v in change.items():
            if v is None:
                body.pop(k)
            else:
                body[k] = v
    _check_error(_post(tiny.url, endpoint, body), status, param, words)


def test_bad_input_through_the_openai_client(tiny: Served):
    with pytest.raises(openai.BadRequestError) as e:
        tiny.openai().completions.create(model=tiny.model, prompt="x", max_tokens=2, top_p=7)
    assert e.value.status_code == 400 and e.value.body["param"] == "top_p"


def test_auth_size_routes(strict: Served):
    ok = _ok_completion(strict.model)
    _check_error(_post(strict.url, "c", ok), 401, None, ["missing API key"])
    bad = {"Authorization": "Bearer nope"}
    _check_error(_post(strict.url, "c", ok, headers=bad), 401, None, ["invalid API key"])
    good = {"Authorization": "Bearer sekret"}
    assert _post(strict.url, "c", ok, headers=good).status_code == 200
    assert strict.openai(api_key="sekret").models.list().data[0].id == strict.model
    with pytest.raises(openai.AuthenticationError):
        strict.openai(api_key="wrong").models.list()
    assert httpx.get(strict.url + "/health").status_code == 200  # ops endpoints stay open
    huge = {**ok, "prompt": "x" * 10_000}
    _check_error(_post(strict.url, "c", huge, headers=good), 413, None, ["4096"])
    _check_error(httpx.get(strict.url + "/v1/nothing-here"), 404, None, ["not found"])
    _check_error(httpx.get(strict.url + "/v1/completions", headers=good), 405, None, ["method"])


def test_server_still_serves_after_bad_input(tiny: Served):
    out = tiny.openai().completions.create(
        model=tiny.model, prompt="after", max_tokens=3, temperature=0
    )
    assert out.usage.completion_tokens == 3 or out.choices[0].finish_reason == "stop"
    state = tiny.idle_state()
    assert state["used_blocks"] == 0 and state["pool_free"] == state["pool_capacity"]
