"""Running the app: in the foreground (`specserve serve`) or in a background thread (tests,
benchmarks that bring their own server), with a graceful drain on SIGTERM / Ctrl-C.

The drain: new requests get 503 while the requests in flight finish, for up to
shutdown_timeout seconds; those still running then end with an OpenAI-shaped 503 (non-streamed)
or a final SSE error event and [DONE] (streamed), the server stops and the caller stops the
engine thread. A second signal stops at once.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from types import FrameType

import uvicorn

from specserve.llm_engine import LLMEngine
from specserve.server.api import DEFAULT_MAX_BODY_BYTES, AppOptions, build_app
from specserve.server.async_engine import AsyncEngine
from specserve.server.errors import ServerError
from specserve.server.guard import is_loopback

log = logging.getLogger("specserve.server")
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
_ANSWER_GRACE = 5.0  # after failing the stragglers: time for their error responses to go out


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    api_key: str | None = None
    metrics_without_key: bool = False
    served_model_names: list[str] | None = None
    stream_granularity: str = "step"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_chars: int | None = None
    allowed_origins: list[str] = field(default_factory=list)
    allowed_hosts: list[str] = field(default_factory=list)
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    log_level: str = "info"

    def app_options(self) -> AppOptions:
        return AppOptions(
            served_model_names=self.served_model_names,
            api_key=self.api_key,
            metrics_without_key=self.metrics_without_key,
            stream_granularity=self.stream_granularity,
            max_body_bytes=self.max_body_bytes,
            max_prompt_chars=self.max_prompt_chars,
            allowed_origins=self.allowed_origins,
            check_host=is_loopback(self.host),
            allowed_hosts=self.allowed_hosts,
        )


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (host, port) now: `serve` checks the port before it loads a model, and uvicorn
    gets the bound socket, so nothing can take the port in between. OSError when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn with a drain in front of its shutdown (module docstring)."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.app = config.app
        self.shutdown_timeout = shutdown_timeout
        self._deadline: float | None = None
        self._failed_at: float | None = None

    @property
    def draining(self) -> bool:
        return self._deadline is not None

    def begin_drain(self) -> None:
        """Start the drain (any thread); the server exits when it is over."""
        if self._deadline is not None:
            return
        state = self.app.state
        state.drain.draining = state.serving.draining = True
        self._deadline = time.monotonic() + self.shutdown_timeout
        log.info(
            "draining: %d request(s) in flight, up to %.0f s", state.drain.in_flight,
            self.shutdown_timeout,
        )  # fmt: skip

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # not recorded for re-raising: after the drain, `serve` returns and stops the engine
        if self.draining or self.shutdown_timeout <= 0:
            if sig == signal.SIGINT and self.should_exit:
                self.force_exit = True
            self.should_exit = True
            return
        self.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        if self._deadline is not None and not self.should_exit:
            now = time.monotonic()
            state = self.app.state
            if state.drain.in_flight == 0:
                self.should_exit = True
            elif self._failed_at is None and now >= self._deadline:
                err = ServerError(
                    "the server shut down before this request finished", 503, code="shutting_down"
                )
                n = state.serving.fail_in_flight(err)
                log.warning("drain timed out: ended %d request(s) with an error", n)
                self._failed_at = now
            elif self._failed_at is not None and now >= self._failed_at + _ANSWER_GRACE:
                self.should_exit = True
        return await super().on_tick(counter)


def _uvicorn_server(client: AsyncEngine, opts: ServerOptions) -> DrainingServer:
    app = build_app(client, opts.app_options())
    config = uvicorn.Config(
        app,
        host=opts.host,
        port=opts.port,
        log_level=opts.log_level,
        timeout_graceful_shutdown=5,  # after our drain: only idle keep-alive connections remain
        access_log=opts.log_level == "debug",
    )
    return DrainingServer(config, opts.shutdown_timeout)


def run_server(engine: LLMEngine, opts: ServerOptions, sock: socket.socket | None = None) -> None:
    """Serve until SIGTERM / Ctrl-C and the drain, then stop the engine thread."""
    names = opts.served_model_names
    client = AsyncEngine(engine, names[0] if names else None)
    sock = sock or bind_socket(opts.host, opts.port)
    try:
        _uvicorn_server(client, opts).run(sockets=[sock])
    finally:
        client.shutdown()
        sock.close()


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
        self._sock = bind_socket(self.opts.host, self.opts.port)
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

    def drain(self, timeout: float = 60.0) -> None:
        """What SIGTERM does: drain, then stop serving (the engine thread keeps running)."""
        self.server.begin_drain()
        self._thread.join(timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        if self._owns_client:
            self.client.shutdown()
        self._sock.close()
