"""`specserve serve` as a process: SIGTERM drains (in-flight requests end with an answer, the
process exits 0), and a taken port is reported before the model loads."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from specserve.model.loader.dummy import PRESETS

SERVE = [sys.executable, "-m", "specserve.cli.main", "serve", "dummy:tiny", "--device", "cpu",
         "--dtype", "float32", "--log-level", "warning"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("server did not start")


def test_sigterm_drains_then_exits(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    # the tiny model with a context long enough that the long requests outlast the drain on
    # any machine (at 2,048 tokens they once ended inside its second)
    (tmp_path / "config.json").write_text(
        json.dumps(PRESETS["tiny"] | {"max_position_embeddings": 65536})
    )
    serve = [*SERVE[:4], f"dummy:{tmp_path}", *SERVE[5:]]
    proc = subprocess.Popen(
        [*serve, "--port", str(port), "--shutdown-timeout", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_ready(url, proc)
        base = {"prompt": "bye", "ignore_eos": True, "temperature": 0}
        out: dict[str, httpx.Response] = {}

        def send(name: str, body: dict) -> None:
            out[name] = httpx.post(url + "/v1/completions", json={**base, **body}, timeout=60)

        jobs = {"short": {"max_tokens": 5}, "long": {"max_tokens": 60000},
                "stream": {"max_tokens": 60000, "stream": True}}  # fmt: skip
        threads = [threading.Thread(target=send, args=kv) for kv in jobs.items()]
        for t in threads:
            t.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        late = httpx.post(url + "/v1/completions", json={**base, "max_tokens": 1}, timeout=10)
        for t in threads:
            t.join(30)
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    assert rc == 0, stderr
    assert late.status_code == 503
    assert out["short"].status_code == 200
    assert out["long"].status_code == 503 and out["long"].json()["error"]["code"] == "shutting_down"
    events = [x[6:] for x in out["stream"].text.split("\n\n") if x.startswith("data: ")]
    assert events[-1] == "[DONE]" and "shutting_down" in json.loads(events[-2])["error"]["code"]
    assert "Traceback" not in stderr, stderr


def test_taken_port_fails_before_the_model_loads():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        proc = subprocess.run(
            [*SERVE, "--port", str(port)], capture_output=True, text=True, timeout=60
        )
    assert proc.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert "serving" not in proc.stderr and time.monotonic() - t0 < 30
