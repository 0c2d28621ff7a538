"""Running the app: in the foreground (`specserve serve`) or in a background thread (tests,
benchmarks that bring their own server)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from specserve.engine.llm_engine import LLMEngine
from specserve.server.api import DEFAULT_MAX_BODY_BYTES, build_app
from specserve.server.async_engine import AsyncEngine


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    api_key: str | None = None
    served_model_names: list[str] | None = None
    stream_granularity: str = "step"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_level: str = "info"


def _uvicorn_server(client: AsyncEngine, opts: ServerOptions) -> uvicorn.Server:
    app = build_app(
        client,
        served_model_names=opts.served_model_names,
        api_key=opts.api_key,
        stream_granularity=opts.stream_granularity,
        max_body_bytes=opts.max_body_bytes,
    )
    config = uvicorn.Config(
        app,
        host=opts.host,
        port=opts.port,
        log_level=opts.log_level,
        timeout_graceful_shutdown=5,
        access_log=opts.log_level == "debug",
    )
    return uvicorn.Server(config)


def run_server(engine: LLMEngine, opts: ServerOptions) -> None:
    """Serve until Ctrl-C / SIGTERM, then stop the engine thread."""
    names = opts.served_model_names
    client = AsyncEngine(engine, names[0] if names else None)
    try:
        _uvicorn_server(client, opts).run()
    finally:
        client.shutdown()


class ServerThread:
    """uvicorn + engine thread in the background, on a loopback port picked by the OS. The
    socket is bound before uvicorn starts, so there is no window for another process to take
    the port."""

    def __init__(self, engine: LLMEngine | AsyncEngine, opts: ServerOptions | None = None) -> None:
        self.opts = opts or ServerOptions(port=0, log_level="warning")
        names = self.opts.served_model_names
        # several apps may share one engine thread (e.g. with and without an API key)
        self._owns_client = not isinstance(engine, AsyncEngine)
        if isinstance(engine, AsyncEngine):
            self.client = engine
        else:
            self.client = AsyncEngine(engine, names[0] if names else None)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((self.opts.host, self.opts.port))
        self.port = self._sock.getsockname()[1]
        self.server = _uvicorn_server(self.client, self.opts)
        self._thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [self._sock]},
            name="specserve-http",
            daemon=True,
        )

    @property
    def base_url(self) -> str:
        return f"http://{self.opts.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        if self._owns_client:
            self.client.shutdown()
        self._sock.close()
