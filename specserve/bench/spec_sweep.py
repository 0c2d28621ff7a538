"""Throughput vs concurrency for speculation off, fixed k, and the auto verify budget.

Closed loop: at concurrency C, C requests are in flight at all times until N are done, all three
modes on the same prompts and settings in the same run (issue: auto >= 0.97x fixed k and
>= 0.99x off at every point). --repeats R times each point R times and reports the median run
(short points on a shared machine are noisy).

With `--method golden` (random-weight models) every request carries golden tokens, drawn once per
prompt and shared by the three modes: they force the outputs whether or not the engine
speculates, so all modes emit the same tokens (checked) and the golden drafter's drafts are right
with probability --acceptance-rate.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any

from specserve.bench.common import (
    command_line,
    digest,
    engine_kwargs,
    free_memory,
    golden_continuations,
    model_vocab_size,
    token_id_bound,
)
from specserve.bench.report import hardware_info, software_info, timestamp
from specserve.bench.spec_sweep_checks import HOST, MODES, checks, plot


@dataclass
class SweepPoint:
    mode: str
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    mean_acceptance_length: float
    verify_rows_per_step: float
    steps: int = 0
    output_digest: str = ""  # fingerprint of every request's output tokens
    repeats_tok_s: list[float] | None = None  # every repeat's tok/s (the point is the median run)
    sync_steps_per_run: float = 0.0  # steps launched synchronously (host work not hidden)
    # steps carrying prompt rows: speculation spreads the requests' ends, hence
    # the admissions behind them, over more steps
    prompt_steps_per_run: float = 0.0
    # --device-time (CUDA): per step kind (runner/timeline.py), [steps a run, device ms a step,
    # host ms a step from its launch to the next one's]
    device_by_kind: dict[str, list[float]] | None = None

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


@dataclass
class LoopResult:
    tokens: int
    seconds: float
    steps: int
    outputs: list[list[int]]  # per request, in submission order


def _engine(args: argparse.Namespace, mode: str, max_seqs: int):
    from specserve import LLM

    spec = None
    if mode != "off":
        spec = {
            "method": args.method,
            "num_speculative_tokens": args.k,
            "verify_budget": "auto" if mode in ("auto", HOST) else "off",
        }
        if args.method == "draft_model":
            spec["model"] = args.draft_model
        if args.method == "eagle3" and args.draft_model != "self":
            spec["model"] = args.draft_model  # else the default model's shipped head
        if args.method == "golden":
            spec["acceptance_rate"] = args.acceptance_rate
        if getattr(args, "draft_quantization", None):
            spec["quantization"] = args.draft_quantization
    return LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max_seqs,
        speculative_config=spec,
        quantization=getattr(args, "quantization", None),
        progress=False,
        seed=args.seed,
        **engine_kwargs(
            getattr(args, "max_model_len", None),
            getattr(args, "kv_cache_gb", None),
            getattr(args, "enforce_eager", False),
        ),
    )


def _closed_loop(llm, requests: list[tuple[list[int], Any]], concurrency: int) -> LoopResult:
    """Keep `concurrency` requests in flight until all are done; requests = (prompt, params)."""
    eng = llm.engine
    todo = list(enumerate(requests))
    todo.reverse()  # pop() from the end: submission order without O(n) pops from the front
    index: dict[str, int] = {}
    outputs: list[list[int]] = [[] for _ in requests]
    in_flight = 0
    tokens = 0
    steps0 = eng.num_steps
    t0 = time.perf_counter()
    while todo or in_flight:
        while todo and in_flight < concurrency:
            i, (prompt, params) = todo.pop()
            index[eng.add_request(prompt, params).request_id] = i
            in_flight += 1
        for out in eng.step():
            if out.token_id >= 0:
                tokens += 1
                outputs[index[out.request_id]].append(out.token_id)
            in_flight -= out.finished
    seconds = time.perf_counter() - t0
    eng.release_outputs()
    return LoopResult(tokens, seconds, eng.num_steps - steps0, outputs)


def _build_requests(
    args: argparse.Namespace, llm, n: int, level: int
) -> list[tuple[list[int], Any]]:
    """The request set of one concurrency level (built once, shared by all modes)."""
    from specserve import SamplingParams
    from specserve.bench.datasets import (
        load_humaneval_rewrite,
        load_sharegpt,
        load_sharegpt_chat,
        random_requests,
    )

    if args.dataset == "sharegpt-chat":
        # chat answers run to their own end (EOS or max_tokens), as served
        return [
            (r.prompt_token_ids, SamplingParams(temperature=0, max_tokens=args.max_tokens))
            for r in load_sharegpt_chat(n, llm.tokenizer, seed=args.seed + level)
        ]
    if args.dataset == "random":
        reqs = random_requests(
            n, (args.input_len, args.input_len), args.max_tokens, model_vocab_size(llm), args.seed
        )
    else:
        loader = load_humaneval_rewrite if args.dataset == "humaneval" else load_sharegpt
        reqs = loader(n, llm.tokenizer, seed=args.seed)
    prompts = [r.prompt_token_ids for r in reqs]
    golden: list[list[int] | None] = [None] * n
    if args.method == "golden":
        golden = list(
            golden_continuations(
                n, args.max_tokens, token_id_bound(llm), seed=f"{args.seed}:{level}"
            )
        )
    return [
        (
            p,
            SamplingParams(
                temperature=0, max_tokens=args.max_tokens, ignore_eos=True, golden_token_ids=g
            ),
        )
        for p, g in zip(prompts, golden)
    ]


def _warm_up(llm, requests: list[tuple[list[int], Any]], concurrency: int) -> None:
    """A short run at the point's own concurrency, so the batch shapes it brings (graph buckets,
    Triton kernels compiled per shape, eager steps past the largest graph) are built before the
    timing. The first token of each prompt is changed so the timed prompts get no prefix-cache
    hits from it."""
    from specserve import SamplingParams

    short = []
    for prompt, params in requests[: max(1, min(concurrency, len(requests)))]:
        gold = params.golden_token_ids[:8] if params.golden_token_ids else None
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, golden_token_ids=gold)
        short.append(([3 + (prompt[0] + 1) % 1000, *prompt[1:]], sp))
    _closed_loop(llm, short, concurrency)


def _counters(llm) -> tuple[int, ...]:
    m = llm.get_metrics()
    return (
        m["spec_drafts"],
        m["spec_accepted_tokens"],
        _verify_rows(llm),
        m["num_sync_steps"],
        m["num_prompt_steps"],
    )


def _point(
    mode: str,
    c: int,
    requests: list,
    runs: list[LoopResult],
    before: tuple[int, ...],
    after: tuple[int, ...],
    device: dict[str, tuple[int, float, float]] | None = None,
) -> SweepPoint:
    """One (mode, concurrency) point from its timed runs: the median run, with acceptance and
    verify rows over all of them."""
    res = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
    drafts, acc, rows, sync, prompt = (a - b for a, b in zip(after, before))
    point = SweepPoint(
        mode,
        c,
        len(requests),
        res.tokens,
        res.seconds,
        1.0 + acc / drafts if drafts else 1.0,
        rows / max(sum(r.steps for r in runs), 1),
        res.steps,
        digest(res.outputs),
        [r.tokens / r.seconds for r in runs],
        sync / len(runs),
        prompt / len(runs),
    )
    if device is not None:
        point.device_by_kind = {
            kind: [n / len(runs), ms / n, wall / n]
            for kind, (n, ms, wall) in sorted(device.items())
        }
    print(
        f"{mode:>5}  C={c:<4} {point.tok_s:8.1f} tok/s  acceptance length "
        f"{point.mean_acceptance_length:.2f}  draft rows/step "
        f"{point.verify_rows_per_step:.1f}  steps {point.steps}  sync steps/run "
        f"{point.sync_steps_per_run:.1f}  prompt steps/run {point.prompt_steps_per_run:.1f}",
        flush=True,
    )
    if point.device_by_kind:
        kinds = ", ".join(
            f"{k} {n:.1f} x {ms:.2f} / {wall:.2f} ms"
            for k, (n, ms, wall) in point.device_by_kind.items()
        )
        print(
            f"       a run by step kind, steps x device / launch-to-launch ms: {kinds}", flush=True
        )
    return point


def _timing(engines: list, on: bool) -> list[dict[str, tuple[int, float, float]] | None]:
    """--device-time: start each engine's step timeline (on) or stop it and read it."""
    out: list[dict[str, tuple[int, float, float]] | None] = []
    for llm in engines:
        timeline = llm.engine.timeline
        if on:
            timeline.start()
        else:
            out.append(timeline.by_kind() if timeline.enabled else None)
            timeline.stop()
    return out


def _loop(llm, mode: str, requests: list, c: int) -> LoopResult:
    """One closed-loop run; the host-split mode's with the device split off."""
    from specserve import env

    with env.override(device_split=env.settings.device_split and mode != HOST):
        run = _closed_loop(llm, requests, c)
    llm.engine.timeline.idle()
    return run


def rotated(modes: tuple[str, ...], r: int) -> tuple[str, ...]:
    """Repeat r's order of the modes: each mode runs first, second and last equally often, so
    no mode always runs right after the same one (on the CPU VM auto, always last, ran 2-6 %
    below fixed k in four of five repeats with the very same decisions)."""
    k = r % len(modes)
    return modes[k:] + modes[:k]


def _requests_for(args: argparse.Namespace, llm, c: int, cache: dict) -> list:
    if c not in cache:
        cache[c] = _build_requests(args, llm, max(c * args.requests_per_slot, args.min_requests), c)
    return cache[c]


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    levels = [int(x) for x in args.concurrency.split(",")]
    modes = tuple(m for m in getattr(args, "modes", ",".join(MODES)).split(","))
    if "off" not in modes or "auto" not in modes or not set(modes) <= {*MODES, HOST}:
        raise SystemExit(f"--modes: off, auto and any of fixed, {HOST}; got {modes}")
    points: list[SweepPoint] = []
    request_sets: dict[int, list[tuple[list[int], Any]]] = {}
    budget: dict[int, dict[str, Any]] = {}  # the auto engine's step-cost model after each level
    if args.interleave:
        # all three engines alive at once; each repeat runs the three back to back (in a
        # rotating order), so a drift of the machine (clocks, neighbours) hits every mode alike
        engines = {mode: _engine(args, mode, max(levels)) for mode in modes}
        for c in levels:
            requests = _requests_for(args, engines["off"], c, request_sets)
            for llm in engines.values():
                _warm_up(llm, requests, c)
            before = {m: _counters(llm) for m, llm in engines.items()}
            runs: dict[str, list[LoopResult]] = {m: [] for m in modes}
            timed = list(engines.values()) if getattr(args, "device_time", False) else []
            _timing(timed, True)
            for r in range(args.repeats):
                for m in rotated(modes, r):
                    runs[m].append(_loop(engines[m], m, requests, c))
            device = dict(zip(engines, _timing(timed, False)))
            for m, llm in engines.items():
                point = _point(m, c, requests, runs[m], before[m], _counters(llm), device.get(m))
                points.append(point)
            budget[c] = _budget_state(engines["auto"])
        del engines
        free_memory()
    else:
        for mode in modes:
            llm = _engine(args, mode, max(levels))
            for c in levels:
                requests = _requests_for(args, llm, c, request_sets)
                _warm_up(llm, requests, c)
                before = _counters(llm)
                timed = [llm] if getattr(args, "device_time", False) else []
                _timing(timed, True)
                loops = [_loop(llm, mode, requests, c) for _ in range(args.repeats)]
                device = _timing(timed, False)[0] if timed else None
                points.append(_point(mode, c, requests, loops, before, _counters(llm), device))
                if mode == "auto":
                    budget[c] = _budget_state(llm)
            del llm
            free_memory()  # before the next mode's engine sizes its KV cache from free memory
    report = {
        "benchmark": "spec-sweep",
        "timestamp": timestamp(),
        "command": command_line(),
        "settings": vars(args) | {"func": None},
        "hardware": hardware_info(),
        "software": software_info(),
        "points": [p.__dict__ | {"tok_s": p.tok_s} for p in points],
        "auto_budget": budget,
        "checks": checks(points, levels, args.method == "golden", modes),
    }
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2, default=str)
    if args.plot_path:
        plot(points, levels, args.plot_path, args, modes)
    for line in report["checks"]["lines"]:
        print(line)
    return report


def _budget_state(llm) -> dict[str, Any]:
    """What the auto engine's verify budget believes: its step-cost model and choices so far."""
    m = llm.get_metrics()
    keys = (
        "step_cost_curve",
        "verify_budget_offered_draft_rows",
        "verify_budget_chosen_draft_rows",
        "verify_budget_expected_accepted_tokens",
        "verify_budget_seqlens_q",
        "verify_budget_drafting_steps",
        "verify_budget_plain_steps",
        "verify_budget_drafting_seconds",
    )
    return {k: m.get(k) for k in keys}


def _verify_rows(llm) -> int:
    return llm.engine.ledger.spec.num_draft_tokens


def add_sweep_parser(sub: Any) -> None:
    p = sub.add_parser(
        "spec-sweep", help="throughput vs concurrency: speculation off / fixed k / auto budget"
    )
    p.add_argument(
        "--model",
        default=None,
        help="model folder, hub id, .gguf or dummy:<preset> (default: the default model)",
    )
    p.add_argument(
        "--method",
        choices=("ngram", "draft_model", "eagle3", "golden"),
        default="ngram",
        help="drafter to sweep",
    )
    p.add_argument(
        "--draft-model",
        default="self",
        help="method draft_model: its model (self: the target); method eagle3: the head folder "
        "(self: the default model's shipped head)",
    )
    p.add_argument(
        "--acceptance-rate",
        type=float,
        default=0.8,
        help="method golden: chance each draft is right (outputs are forced to golden tokens)",
    )
    p.add_argument("--k", type=int, default=4, help="drafts per request per step (fixed k)")
    p.add_argument(
        "--dataset",
        choices=("humaneval", "sharegpt", "sharegpt-chat", "random"),
        default="humaneval",
        help="prompts (sharegpt-chat: held-out ShareGPT first turns under the chat template, "
        "answered until they stop)",
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (random dataset)")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma list of max-num-seqs levels")
    p.add_argument(
        "--requests-per-slot", type=int, default=2, help="requests per level: this x concurrency"
    )
    p.add_argument("--min-requests", type=int, default=8, help="requests per level at least")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument(
        "--repeats", type=int, default=1, help="timed runs per point; the median one is reported"
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="keep the three engines alive and alternate them within each repeat (needs "
        "memory for three; pass --kv-cache-gb on GPU)",
    )
    p.add_argument(
        "--device-time",
        action="store_true",
        help="CUDA: device time of the timed runs by step kind (prompt, drafting, verify, plain), "
        "from CUDA events around each step",
    )
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma list: off and auto, and fixed (k drafts every step) and/or {HOST} (the auto "
        "budget with each request's rows fixed on the host, SPECSERVE_DEVICE_SPLIT=0)",
    )
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 (half)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--max-model-len", type=int, default=None, help="default: the model's context length"
    )
    p.add_argument(
        "--kv-cache-gb", type=float, default=None, help="KV cache size (default: the engine's)"
    )
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs")
    p.add_argument(
        "--quantization",
        default=None,
        help="CPU: int8, w8a8 or int4 weights for every mode (a drafter's own with them)",
    )
    p.add_argument(
        "--draft-quantization",
        default=None,
        help="CPU: int8 or w8a8 weights for the drafter alone (speculative_config.quantization)",
    )
    p.add_argument("--seed", type=int, default=0, help="engine and dataset seed")
    p.add_argument("--json", dest="json_path", default=None, help="write the report here")
    p.add_argument("--plot", dest="plot_path", default=None, help="write a PNG chart here")
