"""Where the device time goes: kernels by total time.

    python tools/profile_step.py --model dummy:llama-3.1-8b --batch 1
    python tools/profile_step.py --model dummy:llama-3.1-8b --workload 256 --input-len 512 \
        --input-len-min 32 --max-tokens 256

Default: a few steady decode steps, run eagerly (--enforce-eager semantics: the very kernels the
graph replays, each visible to the profiler), kernels grouped by name with their launches per
step and share of the step's device time; --graphs profiles the graph replays as served
(overlap on, --max-model-len sets the split-KV bound the graphs are captured with). With --workload N: a whole offline run of N random
prompts with the engine's real settings (graphs, overlap), as `specserve bench throughput` runs it, split
into decode steps and the rest (prefill chunks) by device time, plus the kernels of the whole run.
With --json, keeps it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from typing import Any

MATMULS = ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::bmm")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="dummy:llama-3.1-8b", help="model (default: random 8B)")
    p.add_argument("--batch", type=int, default=1, help="decoding requests")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--steps", type=int, default=10, help="decode steps profiled")
    p.add_argument("--top", type=int, default=25, help="kernels listed")
    p.add_argument("--workload", type=int, default=0, help="profile a whole run of N prompts")
    p.add_argument(
        "--input-len-min", type=int, default=None, help="--workload: lengths in [this, --input-len]"
    )
    p.add_argument("--max-tokens", type=int, default=256, help="--workload: output tokens")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 (half)")
    p.add_argument(
        "--graphs",
        action="store_true",
        help="decode steps through the CUDA graphs (as served) instead of eagerly",
    )
    p.add_argument(
        "--max-model-len", type=int, default=None, help="tokens per request (graphs' KV bound)"
    )
    p.add_argument("--ops", action="store_true", help="--workload: also eager ops with shapes")
    p.add_argument(
        "--speculative-config",
        default=None,
        help="per-step mode: speculation as JSON (golden requests get random golden ids)",
    )
    p.add_argument(
        "--mixed",
        action="store_true",
        help="per-step mode: each profiled step also admits a new --input-len prompt (a prompt "
        "chunk beside the decoding batch), greedy, profiled on the host too (cProfile)",
    )
    p.add_argument(
        "--eager-catch-up",
        action="store_true",
        help="per-step mode: a model drafter's catch-ups over any rows run eagerly, not in their "
        "rows buckets' graphs (speculative/catch_up_graphs.py): the same steps without them",
    )
    p.add_argument("--json", dest="json_path", default=None, help="write the report here")
    p.add_argument(
        "--trace", default=None, help="--mixed: the host-and-device profile as a Chrome trace"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_args(p)
    return run(p.parse_args(argv))


def _kernel_totals(prof: Any) -> tuple[dict[str, float], dict[str, int]]:
    import torch

    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            t = getattr(ev, "device_time_total", None)
            totals[ev.name] += t if t is not None else ev.cuda_time_total
            counts[ev.name] += 1
    return totals, counts


def run_workload(args: argparse.Namespace) -> int:
    """A whole offline run under the profiler plus the step timeline (decode vs other steps)."""
    import torch  # here, not at the top: `specserve --help` builds this parser without torch
    from torch.profiler import ProfilerActivity, profile

    from specserve import LLM, SamplingParams
    from specserve.bench.datasets import random_requests

    n = args.workload
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=n,
        max_model_len=args.input_len + args.max_tokens + 16,
        enable_prefix_caching=False,
        progress=False,
    )
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    lo = args.input_len_min or args.input_len
    reqs = random_requests(n, (lo, args.input_len), args.max_tokens, vocab, seed=0)
    prompts = [r.prompt_token_ids for r in reqs]
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    warm = random_requests(n, (lo, args.input_len), 16, vocab, seed=1)
    llm.generate([r.prompt_token_ids for r in warm], SamplingParams(max_tokens=16, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    torch.cuda.synchronize()
    eng.timeline.start()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    eng.timeline.stop()
    decode, other = eng.timeline.summary("decode"), eng.timeline.summary("other")
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{n} prompts x {args.max_tokens} tokens: {wall:.2f} s, {tokens / wall:.0f} tok/s "
          f"(no profiler)")  # fmt: skip
    for name, s in (("decode", decode), ("other", other)):
        print(f"  {name:6s} steps {s.num_steps:4d}: device busy {s.busy_ms:8.1f} ms "
              f"({s.busy_ms / max(1, s.num_steps):.2f} ms/step), idle {s.idle_ms:.1f} ms")  # fmt: skip
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.ops else [])
    with profile(activities=acts, record_shapes=args.ops) as prof:
        llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize()
    if args.ops:
        # eager ops (graph replays hide theirs) by device time, with their input shapes
        ops = prof.key_averages(group_by_input_shape=True)
        ops = sorted(ops, key=lambda e: getattr(e, "device_time_total", 0), reverse=True)
        print("eager ops by device time (shapes):")
        for e in ops[:12]:
            print(f"{e.device_time_total / 1e3:9.1f} ms x{e.count:6d}  {e.key[:40]:40s} "
                  f"{str(e.input_shapes)[:90]}")  # fmt: skip
    totals, counts = _kernel_totals(prof)
    total = sum(totals.values())
    rows = sorted(totals, key=totals.get, reverse=True)
    print(
        f"kernels (profiled run): {total / 1e3:.1f} ms device time, {sum(counts.values())} launches"
    )
    for name in rows[: args.top]:
        print(f"{totals[name] / 1e3:9.1f} ms {100 * totals[name] / total:5.1f} % "
              f"x{counts[name]:7d}  {name[:100]}")  # fmt: skip
    if args.json_path:
        summary = {
            name: {"steps": s.num_steps, "busy_ms": s.busy_ms, "idle_ms": s.idle_ms}
            for name, s in (("decode", decode), ("other", other))
        }
        with open(args.json_path, "w") as f:
            json.dump(
                {
                    "command": " ".join(sys.argv),
                    "wall_s": wall,
                    "output_tokens": tokens,
                    "steps": summary,
                    "device_ms_profiled": total / 1e3,
                    "kernels": [
                        {"name": k, "ms": totals[k] / 1e3, "count": counts[k]} for k in rows
                    ],
                },
                f,
                indent=2,
            )
    return 0


def run(args: argparse.Namespace) -> int:
    if args.workload:
        return run_workload(args)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from specserve import LLM, SamplingParams
    from specserve.config import SpeculativeConfig

    spec = SpeculativeConfig.parse(args.speculative_config)
    k = spec.num_speculative_tokens if spec else 0
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=max(args.batch, 2) + (4 * args.steps if args.mixed else 0),  # one a step
        # the attention's split-KV count follows max_model_len under graphs: pass the served one
        max_model_len=args.max_model_len or args.input_len + 64 + (2 + k) * args.steps,
        enforce_eager=not args.graphs,
        overlap=args.graphs,
        speculative_config=spec,
        progress=False,
    )
    eng = llm.engine
    if args.eager_catch_up:
        eng.device_drafting.model_drafter.catch_up.sizes = []  # every catch-up past the buckets
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    out_len = 40 + 2 * args.steps  # warm-up, the timed steps, the profiled steps

    def add() -> None:
        prompt = [rng.randrange(3, vocab) for _ in range(args.input_len)]
        gold = None
        if spec is not None and spec.method == "golden":
            gold = [rng.randrange(3, vocab) for _ in range(out_len * (1 + k))]
        # --mixed: greedy, as the sweeps' EAGLE-3 runs (their steps sample in the graph tail)
        sp = SamplingParams(
            max_tokens=out_len * (1 + k),
            ignore_eos=True,
            golden_token_ids=gold,
            temperature=0.0 if args.mixed else 1.0,
        )
        eng.add_request(prompt, sp)

    def step() -> None:
        if args.mixed:
            add()
        eng.step()

    for _ in range(args.batch):
        add()
    for _ in range(30):  # prefill and warm decode steps
        eng.step()
    for _ in range(args.steps if args.mixed else 0):  # mixed steps' shapes met once
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()  # the same steps' wall time, unprofiled: host-bound or not
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    wall_us = 1e6 * (time.perf_counter() - t0) / args.steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    if args.mixed:  # where the host's time goes
        import cProfile
        import pstats

        host = cProfile.Profile()
        host.enable()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        host.disable()
        pstats.Stats(host).sort_stats("tottime").print_stats(args.top)
        pstats.Stats(host).sort_stats("cumulative").print_stats(args.top)
        # the same on the profiler's host side: torch ops and CUDA runtime calls by their own
        # host time (a launch that blocks, an allocation, a sync), then the linears by shape
        with profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True
        ) as ops:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        if args.trace:
            ops.export_chrome_trace(args.trace)
        avg = ops.key_averages()
        print(
            avg.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60)
        )
        mm = [e for e in ops.key_averages(group_by_input_shape=True) if e.key in MATMULS]
        mm.sort(key=lambda e: -e.cpu_time_total)
        for e in mm[: args.top]:
            print(
                f"{e.key:14s} x{e.count:4d} {e.cpu_time_total / e.count:8.1f} us host  {e.input_shapes}"
            )
    eng.fail_all()
    totals, counts = _kernel_totals(prof)
    step_us = sum(totals.values()) / args.steps
    rows = sorted(totals, key=totals.get, reverse=True)
    print(f"wall time per step: {wall_us / 1000:.3f} ms, device time per step: "
          f"{step_us / 1000:.3f} ms, kernels per step: "
          f"{sum(counts.values()) / args.steps:.0f}")  # fmt: skip
    for name in rows[: args.top]:
        print(
            f"{totals[name] / args.steps:9.1f} us {100 * totals[name] / args.steps / step_us:5.1f} % "
            f"x{counts[name] / args.steps:5.0f}  {name[:100]}"
        )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(
                {
                    "command": " ".join(sys.argv),
                    "device_us_per_step": step_us,
                    "wall_us_per_step": wall_us,
                    "kernels": [
                        {"name": n, "us_per_step": totals[n] / args.steps, "count": counts[n]}
                        for n in rows
                    ],
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
