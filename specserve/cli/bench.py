"""`specserve bench ...` subcommands: throughput, spec-sweep, golden-curve, host-profile,
cpu-profile, plot,
serve (online).

Heavy imports (torch, transformers, the engine) happen inside run_bench so that building the
top-level parser stays instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any


def _add_throughput_parser(sub: Any) -> None:
    p = sub.add_parser(
        "throughput",
        help="offline throughput (or batch-1 decode speed), optionally vs HF transformers",
        description="Run a request set through specserve (and, with --baseline hf or hf-cb, "
        "through HF transformers on the same prompts and settings) and report tokens/s.",
    )
    from specserve.cli.main import add_engine_args

    add_engine_args(p)  # --model, --dtype, --device, --max-num-seqs, --speculative-config, ...
    p.add_argument(
        "--dataset",
        choices=("sharegpt", "humaneval", "random"),
        default="sharegpt",
        help="prompts",
    )
    p.add_argument("--num-prompts", type=int, default=64, help="requests in the run")
    p.add_argument(
        "--max-tokens", type=int, default=128, help="output tokens per request (the same for all)"
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (random dataset)")
    p.add_argument(
        "--input-len-min",
        type=int,
        default=None,
        help="random dataset: lengths in [this, --input-len]",
    )
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens")
    p.add_argument(
        "--batch-1",
        action="store_true",
        help="one request at a time; report per-request decode tok/s and the median",
    )
    p.add_argument(
        "--baseline",
        choices=("hf", "hf-cb"),
        default=None,
        help="also run HF transformers: hf = model.generate in padded batches of --hf-batch-size "
        "(one at a time with --batch-1); hf-cb = continuous batching, model.generate_batch",
    )
    p.add_argument("--hf-batch-size", type=int, default=None, help="default: min(max-num-seqs, N)")
    p.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="recompute every prompt, as the HF baseline does",
    )
    p.add_argument(
        "--acceptance-rate",
        type=float,
        default=None,
        help="golden tokens: force the outputs and accept each draft with this probability "
        "(k from --speculative-config, default 4)",
    )
    p.add_argument("--json", dest="json_path", default=None, help="write the report here")
    p.add_argument("--plot", dest="plot_path", default=None, help="write a PNG chart here")


def _add_subcommands(sub: Any) -> None:
    _add_throughput_parser(sub)
    from specserve.bench.cpu_profile import add_cpu_profile_parser
    from specserve.bench.golden_curve import add_golden_curve_parser
    from specserve.bench.host_profile import add_host_profile_parser
    from specserve.bench.plot_results import add_plot_parser
    from specserve.bench.spec_sweep import add_sweep_parser
    from specserve.bench.structured import add_structured_parser

    add_sweep_parser(sub)
    add_structured_parser(sub)
    add_golden_curve_parser(sub)
    add_host_profile_parser(sub)
    add_cpu_profile_parser(sub)
    add_plot_parser(sub)
    try:
        from specserve.bench.serve import add_serve_bench

        add_serve_bench(sub).set_defaults(func=cmd_bench_serve)
    except ImportError:  # pragma: no cover - server extras missing
        pass


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """`bench serve`, with a server that cannot be reached (or refuses) as one line, not a
    traceback."""
    import httpx

    from specserve.bench.serve import cmd_serve_bench

    url = args.base_url.rstrip("/")
    try:
        if not args.ready_timeout:
            # before the dataset is built (ShareGPT takes a while): any HTTP answer will do
            httpx.get(f"{url}/health", timeout=10.0)
        return cmd_serve_bench(args)
    except httpx.HTTPStatusError as e:
        print(
            f"error: {e.request.url} answered {e.response.status_code}: "
            f"{e.response.text.strip()[:200]}",
            file=sys.stderr,
        )
    except httpx.TransportError as e:
        print(
            f"error: no server answers at {url} ({type(e).__name__}: {e or 'no detail'}); "
            "start one with `specserve serve`, or pass --base-url (--ready-timeout waits for "
            "one still loading)",
            file=sys.stderr,
        )
    return 1


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench` (with its own subcommands) on the top-level CLI's subparsers."""
    bench = subparsers.add_parser("bench", help="benchmarks")
    _add_subcommands(bench.add_subparsers(dest="bench_command", required=True))
    bench.set_defaults(func=run_bench)
    return bench


def settings_from_args(args: argparse.Namespace) -> Any:
    from specserve.bench.throughput import ThroughputSettings
    from specserve.cli.main import engine_kwargs
    from specserve.config import EngineConfig

    # engine flags ThroughputSettings has no field of its own for go to LLM(...) when set
    own = {f.name for f in dataclasses.fields(ThroughputSettings)}
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    engine_args = {
        k: v for k, v in engine_kwargs(args).items() if k not in own and v != defaults.get(k)
    }
    spec = args.speculative_config
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise SystemExit(f"error: --speculative-config is not valid JSON: {e}") from None
    return ThroughputSettings(
        model=args.model,
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        batch_1=args.batch_1,
        speculative_config=spec,
        baseline=args.baseline,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        acceptance_rate=args.acceptance_rate,
        enable_prefix_caching=args.enable_prefix_caching,
        hf_batch_size=args.hf_batch_size,
        input_len=args.input_len,
        input_len_min=args.input_len_min,
        json_path=args.json_path,
        plot_path=args.plot_path,
        engine_args=engine_args,
    )


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "throughput":
        from specserve.bench.throughput import run_throughput

        try:
            settings = settings_from_args(args)
        except ValueError as e:  # ThroughputSettings' own checks
            print(f"error: {e}", file=sys.stderr)
            return 2
        run_throughput(settings)
        if args.json_path:
            print(f"report written to {args.json_path}", file=sys.stderr)
        if args.plot_path:
            print(f"chart written to {args.plot_path}", file=sys.stderr)
        return 0
    if args.bench_command == "spec-sweep":
        from specserve.bench.spec_sweep import run_sweep

        report = run_sweep(args)
        return 0 if report["checks"]["all_ok"] else 1
    if args.bench_command == "structured":
        from specserve.bench.structured import run_structured_bench

        run_structured_bench(args)
        return 0
    if args.bench_command == "golden-curve":
        from specserve.bench import golden_curve

        rc = golden_curve.main(args)
        for what, path in (("report", args.json_path), ("chart", args.plot_path)):
            if path:
                print(f"{what} written to {path}", file=sys.stderr)
        return rc
    if args.bench_command == "host-profile":
        from specserve.bench.host_profile import run

        run(args)
        if args.json_path:
            print(f"report written to {args.json_path}", file=sys.stderr)
        return 0
    if args.bench_command == "cpu-profile":
        from specserve.bench.cpu_profile import run_cpu_profile

        run_cpu_profile(args)
        return 0
    if args.bench_command == "plot":
        from specserve.bench.plot_results import run_plot

        if not run_plot(args.reports, args.out, args.title):
            return 1
        print(f"chart written to {args.out}", file=sys.stderr)
        return 0
    print(f"error: unknown bench command {args.bench_command!r}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m specserve.cli.bench throughput ...`)."""
    parser = argparse.ArgumentParser(prog="specserve bench")
    _add_subcommands(parser.add_subparsers(dest="bench_command", required=True))
    args = parser.parse_args(argv)
    return getattr(args, "func", run_bench)(args)  # `serve` brings its own handler


if __name__ == "__main__":
    sys.exit(main())
