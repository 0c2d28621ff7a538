"""What a model drafter's drafting choice costs (CUDA): milliseconds a step and tokens per second
with speculation off, drafting every step (fixed k), and VerifyBudget.plan's choice replaced by
a rule: never draft ("plain": each step should cost what an off step costs), always draft,
alternate every 8 / 32 plans (what switching costs), and the budget's own choice ("auto"). A
random target accepts nothing, so the times are the whole story.

    python tools/drafting_modes.py --model dummy:smollm2-135m \
        --head specserve/heads/smollm2-135m-instruct --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RULES = {
    "plain": lambda i: False,
    "draft": lambda i: True,
    "alt8": lambda i: (i // 8) % 2 == 0,
    "alt32": lambda i: (i // 32) % 2 == 0,
}


def _force(llm, rule) -> None:
    """The budget's drafting choice replaced by rule(plan number); every draft kept."""
    from specserve.speculative.verify_budget import StepPlan

    k, calls = llm.engine.slot_pool.k, [0]

    def plan(conf, base_rows, room, has_drafts, may_draft):
        calls[0] += 1
        keep = [min(int(r), k) if h else 0 for r, h in zip(room, has_drafts)]
        return StepPlan(keep, may_draft and rule(calls[0]))

    llm.engine.budget.plan = plan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dummy:smollm2-135m")
    p.add_argument("--head", default="specserve/heads/smollm2-135m-instruct")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument(
        "--kernels",
        default="",
        help="modes (e.g. off,plain) whose device kernels a batch-1 run lists, per step",
    )
    args = p.parse_args()
    from specserve import LLM, SamplingParams
    from specserve.bench.common import engine_kwargs

    spec = {"method": "eagle3", "model": args.head, "num_speculative_tokens": args.k}
    modes = {"off": None, "fixed": spec | {"verify_budget": "off"}, "auto": spec}
    modes |= {m: spec for m in RULES}
    llms = {}
    for m, s in modes.items():
        llms[m] = LLM(model=args.model, dtype="bfloat16", max_num_seqs=32, speculative_config=s,
                      progress=False, seed=0, **engine_kwargs(1024, 4, False))  # fmt: skip
        if m in RULES:
            _force(llms[m], RULES[m])
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    report: dict = {"model": args.model, "k": args.k, "device": torch.cuda.get_device_name()}
    for b in map(int, args.batches.split(",")):
        prompts = [[1 + (i * 37 + j) % 30000 for j in range(128)] for i in range(b)]
        runs: dict[str, list[tuple[float, float]]] = {m: [] for m in llms}
        for llm in llms.values():
            llm.generate(prompts, sp, use_tqdm=False)  # warm-up
        for _ in range(args.repeats):
            for m, llm in llms.items():
                s0 = llm.engine.num_steps
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                llm.generate(prompts, sp, use_tqdm=False)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                runs[m].append((1e3 * dt / (llm.engine.num_steps - s0), b * args.max_tokens / dt))
        med = {m: [statistics.median(x[i] for x in v) for i in (0, 1)] for m, v in runs.items()}
        report[f"batch{b}"] = {"runs": runs, "median_ms_per_step_and_tok_s": med}
        for m, (ms, tps) in med.items():
            print(f"batch {b} {m:6s} {ms:.3f} ms a step  {tps:.0f} tok/s", flush=True)
    for m in filter(None, args.kernels.split(",")):
        report[f"kernels_{m}"] = _kernels(llms[m], sp)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=1))


def _kernels(llm, sp, top: int = 20) -> dict[str, list[float]]:
    """One batch-1 run under the profiler: each kernel's device microseconds and launches a
    step (a plain step's extra device work against an off step's shows here)."""
    from torch.profiler import ProfilerActivity, profile

    from tools.profile_step import _kernel_totals

    prompt = [[1 + j % 30000 for j in range(128)]]
    s0 = llm.engine.num_steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, sp, use_tqdm=False)
        torch.cuda.synchronize()
    steps = llm.engine.num_steps - s0
    totals, counts = _kernel_totals(prof)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    print(f"kernels a step ({steps} steps): {sum(totals.values()) / steps:.1f} us in all")
    for name, us in ranked[:top]:
        print(f"  {us / steps:8.1f} us {counts[name] / steps:5.2f}x  {name[:100]}")
    return {n: [us / steps, counts[n] / steps] for n, us in ranked}


if __name__ == "__main__":
    main()
