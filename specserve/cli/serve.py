"""`specserve serve [MODEL]`: the OpenAI-compatible HTTP server.

The server stack (fastapi, uvicorn) is imported only when the command runs; registering the
parser just checks that it is installed, so `specserve --help` stays fast and a missing extra
hides the command instead of breaking the CLI.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Any

from specserve import env

if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
    raise ImportError("specserve serve needs the server extra: pip install 'specserve[server]'")


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    from specserve.cli.main import add_engine_args

    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible server (/v1/completions, /v1/chat/completions, /metrics)",
        description="Serve a model over an OpenAI-compatible HTTP API.",
    )
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument(
        "--api-key",
        default=env.settings.api_key,
        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and /metrics "
        "(default: $SPECSERVE_API_KEY)",
    )
    p.add_argument(
        "--metrics-without-key",
        action="store_true",
        help="with --api-key: leave /metrics open (for a Prometheus scraper without the key)",
    )
    p.add_argument(
        "--allowed-origins",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help="web origins allowed to call the server from a browser (CORS), e.g. "
        "http://localhost:3000; '*' allows any. Default: none (cross-origin requests get 403)",
    )
    p.add_argument(
        "--allowed-hosts",
        nargs="+",
        default=[],
        metavar="HOST",
        help="bound to loopback, Host headers that are not loopback names get 403 (DNS "
        "rebinding); list names to accept, e.g. behind a local reverse proxy",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM / Ctrl-C: how long in-flight requests may take to finish; those still "
        "running then end with an error (a second signal stops at once). Default 30",
    )
    p.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="longest prompt in characters, refused before tokenizing (default: 32 x "
        "max_model_len)",
    )
    p.add_argument(
        "--served-model-name", nargs="+", default=None, help="names clients may use in 'model'"
    )
    p.add_argument(
        "--stream-granularity",
        choices=("step", "token"),
        default="step",
        help="SSE chunks: one per engine step (all tokens it landed) or one per token",
    )
    p.add_argument(
        "--max-request-bytes", type=int, default=8 * 2**20, help="largest request body (8 MiB)"
    )
    p.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="KV cache size in GiB (default: from --gpu-memory-utilization; 2 GiB on CPU)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="server log level",
    )
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    from specserve.cli.main import engine_config
    from specserve.llm_engine import build_engine
    from specserve.server.launch import ServerOptions, bind_socket, run_server

    if args.model_tag and args.model and args.model_tag != args.model:
        print("error: give the model once (positional MODEL or --model)", file=sys.stderr)
        return 2
    # every engine flag, validated before the model loads
    config = engine_config(
        args, model=args.model_tag or args.model, kv_cache_memory_gb=args.kv_cache_memory_gb
    )
    try:  # before the model loads: a taken port should not cost the load
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(
            f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr
        )
        return 1
    try:
        engine = build_engine(config)
    except BaseException:
        sock.close()
        raise
    opts = ServerOptions(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_names=args.served_model_name,
        stream_granularity=args.stream_granularity,
        max_body_bytes=args.max_request_bytes,
        max_prompt_chars=args.max_prompt_chars,
        metrics_without_key=args.metrics_without_key,
        allowed_origins=args.allowed_origins,
        allowed_hosts=args.allowed_hosts,
        shutdown_timeout=args.shutdown_timeout,
        log_level=args.log_level,
    )
    if opts.host not in ("127.0.0.1", "localhost", "::1") and not opts.api_key:
        print(f"warning: serving on {opts.host} without --api-key", file=sys.stderr)
    print(
        f"specserve: serving {engine.model_name} on http://{opts.host}:{opts.port} "
        f"(max_model_len {engine.max_model_len})",
        file=sys.stderr,
    )
    try:
        run_server(engine, opts, sock)
    finally:
        engine.shutdown()  # tensor-parallel workers stop with the server
    return 0
