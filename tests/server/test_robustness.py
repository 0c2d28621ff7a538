"""What one request can do to the server: bounded work, browser-safety checks, a client that
leaves mid-upload, and the graceful drain (SIGTERM)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from specserve.server.launch import ServerOptions, ServerThread
from specserve.server.protocol import MAX_ENGINE_REQUESTS
from tests.server.conftest import Served


def _app(tiny: Served, **opts) -> Iterator[Served]:
    server = ServerThread(tiny.server.client, ServerOptions(port=0, **opts)).start()
    try:
        yield Served(server, tiny.llm, tiny.model)
    finally:
        server.stop()


@pytest.fixture
def keyed(tiny: Served) -> Iterator[Served]:
    yield from _app(tiny, api_key="k", allowed_origins=["http://localhost:3000"])


def _post(srv: Served, body: dict | bytes, path: str = "/v1/completions", **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    return httpx.post(srv.url + path, content=content, headers=headers, timeout=60, **kw)


def test_work_per_request_is_bounded(tiny: Served):
    t0 = time.monotonic()
    r = _post(tiny, {"model": tiny.model, "prompt": ["hi"] * 100, "n": 128, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert str(MAX_ENGINE_REQUESTS) in r.json()["error"]["message"]
    big = "word " * 200_000  # 1 MB: refused before tokenizing
    r = _post(tiny, {"model": tiny.model, "prompt": big, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = _post(tiny, {"model": tiny.model, "messages": [{"role": "user", "content": big}]},
              "/v1/chat/completions")  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert time.monotonic() - t0 < 5
    for depth in (100, 100_000):
        deep = b'{"prompt": "x", "a": ' + b"[" * depth + b"]" * depth + b"}"
        r = _post(tiny, deep)
        assert r.status_code == 400 and "nested" in r.json()["error"]["message"], r.text


@pytest.fixture
def roomy(tiny: Served) -> Iterator[Served]:
    yield from _app(tiny, max_prompt_chars=10**7)


def test_a_big_prompt_does_not_stall_a_small_one(roomy: Served):
    """A long prompt tokenizes in its own lane: a concurrent short request is not behind it."""
    big = "lorem ipsum dolor " * 60_000  # 1 MB: a second or more of tokenizing
    done: dict[str, float] = {}

    def send_big() -> None:
        r = _post(roomy, {"model": roomy.model, "prompt": big, "max_tokens": 1})
        done["big"] = time.monotonic()
        done["status"] = r.status_code

    t = threading.Thread(target=send_big)
    t.start()
    time.sleep(0.3)  # the big one is being tokenized
    t0 = time.monotonic()
    r = _post(roomy, {"model": roomy.model, "prompt": "Hello", "max_tokens": 1})
    small_done = time.monotonic()
    t.join()
    assert r.status_code == 200 and small_done - t0 < 1.0, small_done - t0
    assert done["status"] == 400  # far beyond the context, after tokenizing
    assert small_done < done["big"]


def test_browser_safety(keyed: Served, tiny: Served):
    ok = {"model": tiny.model, "prompt": "x", "max_tokens": 1}
    auth = {"Authorization": "Bearer k"}
    r = _post(keyed, ok, headers={**auth, "Origin": "http://evil.example"})
    assert r.status_code == 403 and "evil.example" in r.json()["error"]["message"]
    r = _post(keyed, ok, headers={**auth, "Origin": "http://localhost:3000"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    pre = httpx.options(
        keyed.url + "/v1/completions",
        headers={
            "Origin": "http://localhost:3000",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },  # fmt: skip
    )
    assert pre.status_code == 204 and "authorization" in pre.headers["access-control-allow-headers"]
    r = _post(keyed, ok, headers={**auth, "Content-Type": "text/plain"})
    assert r.status_code == 415
    r = _post(keyed, ok, headers={**auth, "Host": "rebind.attacker.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    # the API key guards /metrics too, unless the server opens it
    assert httpx.get(keyed.url + "/metrics").status_code == 401
    assert httpx.get(keyed.url + "/metrics", headers=auth).status_code == 200
    assert httpx.get(keyed.url + "/health").status_code == 200
    for srv in _app(tiny, api_key="k", metrics_without_key=True):
        assert httpx.get(srv.url + "/metrics").status_code == 200


def test_client_leaving_mid_upload_is_not_an_error(tiny: Served, caplog):
    caplog.set_level(logging.INFO)
    port = tiny.server.port
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n" + b'{"prompt": '
        )
        time.sleep(0.2)
    time.sleep(0.5)
    assert _post(tiny, {"model": tiny.model, "prompt": "x", "max_tokens": 1}).status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def _sse_events(r: httpx.Response) -> list[str]:
    return [x[6:] for x in r.text.split("\n\n") if x.startswith("data: ")]


def test_drain_finishes_short_requests_and_ends_long_ones(tiny: Served):
    """What SIGTERM does (launch.DrainingServer): new requests get 503; requests that finish
    within --shutdown-timeout get their answer; the others an OpenAI error / SSE error + DONE."""
    server = ServerThread(tiny.server.client, ServerOptions(port=0, shutdown_timeout=1.5)).start()
    srv = Served(server, tiny.llm, tiny.model)
    base = {"model": tiny.model, "prompt": "drain", "ignore_eos": True, "temperature": 0}
    results: dict[str, httpx.Response] = {}

    def send(name: str, body: dict) -> None:
        results[name] = _post(srv, {**base, **body})

    jobs = {
        "short": {"max_tokens": 20},
        "long": {"max_tokens": 1900},
        "long_stream": {"max_tokens": 1900, "stream": True},
    }
    threads = [threading.Thread(target=send, args=kv) for kv in jobs.items()]
    for t in threads:
        t.start()
    time.sleep(0.5)  # all three in flight
    drainer = threading.Thread(target=server.drain)
    drainer.start()
    time.sleep(0.2)
    late = _post(srv, {**base, "max_tokens": 1})
    for t in threads:
        t.join(30)
    drainer.join(30)
    try:
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        assert results["short"].status_code == 200
        assert results["short"].json()["usage"]["completion_tokens"] == 20
        long = results["long"]
        assert long.status_code == 503 and long.json()["error"]["type"] == "service_unavailable"
        events = _sse_events(results["long_stream"])
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutting_down"
        assert not drainer.is_alive() and not server._thread.is_alive()
    finally:
        server.stop()
    state = tiny.idle_state()
    assert state["idle"] and state["used_blocks"] == 0, state
