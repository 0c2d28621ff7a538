"""Throughput vs concurrency for speculation off, fixed k, and the auto verify budget.

Closed loop: at concurrency C, C requests are in flight at all times until N are done, all three
modes on the same prompts and settings in the same run (issue: auto >= best of the others - 3%
and >= off - 2% at every point).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

from specserve.bench.report import hardware_info, software_info, timestamp

MODES = ("off", "fixed", "auto")


@dataclass
class SweepPoint:
    mode: str
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    mean_acceptance_length: float
    verify_rows_per_step: float

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


def _engine(args: argparse.Namespace, mode: str, max_seqs: int):
    from specserve import LLM

    spec = None
    if mode != "off":
        spec = {
            "method": args.method,
            "num_speculative_tokens": args.k,
            "verify_budget": "auto" if mode == "auto" else "off",
        }
        if args.method == "draft_model":
            spec["model"] = args.draft_model
    return LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max_seqs,
        speculative_config=spec,
        progress=False,
    )


def _closed_loop(
    llm, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> tuple[int, float, int]:
    from specserve import SamplingParams

    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    todo = list(prompts)
    in_flight = 0
    tokens = 0
    steps0 = eng.num_steps
    t0 = time.perf_counter()
    while todo or in_flight:
        while todo and in_flight < concurrency:
            eng.add_request(todo.pop(0), sp)
            in_flight += 1
        for out in eng.step():
            tokens += out.token_id >= 0
            in_flight -= out.finished
    eng.release_outputs()
    return tokens, time.perf_counter() - t0, eng.num_steps - steps0


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    from specserve.bench.datasets import load_humaneval_rewrite, load_sharegpt

    levels = [int(x) for x in args.concurrency.split(",")]
    points: list[SweepPoint] = []
    for mode in MODES:
        llm = _engine(args, mode, max(levels))
        loader = load_humaneval_rewrite if args.dataset == "humaneval" else load_sharegpt
        for c in levels:
            n = max(c * args.requests_per_slot, args.min_requests)
            reqs = loader(n, llm.tokenizer, seed=args.seed)
            prompts = [r.prompt_token_ids for r in reqs]
            _closed_loop(llm, prompts[: min(2, len(prompts))], min(c, 2), 4)  # warm-up
            before = llm.get_metrics()
            rows_before = _verify_rows(llm)
            tokens, secs, steps = _closed_loop(llm, prompts, c, args.max_tokens)
            after = llm.get_metrics()
            drafts = after["spec_drafts"] - before["spec_drafts"]
            acc = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            point = SweepPoint(
                mode,
                c,
                len(prompts),
                tokens,
                secs,
                1.0 + acc / drafts if drafts else 1.0,
                (_verify_rows(llm) - rows_before) / max(steps, 1),
            )
            points.append(point)
            print(
                f"{mode:>5}  C={c:<4} {point.tok_s:8.1f} tok/s  acceptance length "
                f"{point.mean_acceptance_length:.2f}  draft rows/step {point.verify_rows_per_step:.1f}",
                flush=True,
            )
        del llm
    report = {
        "benchmark": "spec-sweep",
        "timestamp": timestamp(),
        "settings": vars(args) | {"func": None},
        "hardware": hardware_info(),
        "software": software_info(),
        "points": [p.__dict__ | {"tok_s": p.tok_s} for p in points],
        "checks": _checks(points, levels),
    }
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2, default=str)
    if args.plot_path:
        _plot(points, levels, args.plot_path, args)
    for line in report["checks"]["lines"]:
        print(line)
    return report


def _verify_rows(llm) -> int:
    return llm.engine.ledger.spec.num_draft_tokens


def _checks(points: list[SweepPoint], levels: list[int]) -> dict[str, Any]:
    by = {(p.mode, p.concurrency): p.tok_s for p in points}
    lines, ok = [], True
    for c in levels:
        off, fixed, auto = by[("off", c)], by[("fixed", c)], by[("auto", c)]
        good = auto >= max(off, fixed) * 0.97 and auto >= off * 0.98
        ok &= good
        lines.append(
            f"C={c}: auto/off {auto / off:.3f}, auto/fixed {auto / fixed:.3f}, fixed/off "
            f"{fixed / off:.3f} -> {'ok' if good else 'MISSED'}"
        )
    return {
        "all_ok": ok,
        "lines": lines,
        "median_auto_over_off": statistics.median(by[("auto", c)] / by[("off", c)] for c in levels),
    }


def _plot(points: list[SweepPoint], levels: list[int], path: str, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, style in zip(MODES, ("o-", "s--", "^-")):
        ys = [
            next(p.tok_s for p in points if p.mode == mode and p.concurrency == c) for c in levels
        ]
        ax.plot(
            levels,
            ys,
            style,
            label={
                "off": "no speculation",
                "fixed": f"fixed k={args.k}",
                "auto": "verify budget auto",
            }[mode],
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens / s")
    hw = hardware_info()
    where = ", ".join(hw.get("gpus", [])) or f"{hw.get('cpu', 'CPU')} x{hw.get('cpu_cores', '?')}"
    ax.set_title(f"{args.method} speculation, {args.dataset}, {args.max_tokens} tokens, {where}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_sweep_parser(sub: Any) -> None:
    p = sub.add_parser(
        "spec-sweep", help="throughput vs concurrency: speculation off / fixed k / auto budget"
    )
    p.add_argument("--model", default=None)
    p.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    p.add_argument("--draft-model", default="self")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--dataset", choices=("humaneval", "sharegpt"), default="humaneval")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--requests-per-slot", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--plot", dest="plot_path", default=None)
