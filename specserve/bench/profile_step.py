"""Where a decode step's device time goes: kernels by total time over a few steady steps.

    specserve bench profile --model dummy:llama-3.1-8b --batch 1

Runs the decode steps eagerly (--enforce-eager semantics: the very kernels the graph replays,
each visible to the profiler) under torch.profiler and prints the kernels grouped by name,
their launch counts per step and the share of the step's device time; with --json, keeps it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import defaultdict

import torch


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", dest="json_path", default=None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_args(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    from torch.profiler import ProfilerActivity, profile

    from specserve import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        max_num_seqs=max(args.batch, 2),
        max_model_len=args.input_len + 64 + args.steps,
        enforce_eager=True,
        overlap=False,
        progress=False,
    )
    eng = llm.engine
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    for _ in range(args.batch):
        prompt = [rng.randrange(3, vocab) for _ in range(args.input_len)]
        eng.add_request(prompt, SamplingParams(max_tokens=40 + args.steps, ignore_eos=True))
    for _ in range(30):  # prefill and warm decode steps
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            eng.step()
        torch.cuda.synchronize()
    eng.fail_all()
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            t = getattr(ev, "device_time_total", None)
            totals[ev.name] += t if t is not None else ev.cuda_time_total
            counts[ev.name] += 1
    step_us = sum(totals.values()) / args.steps
    rows = sorted(totals, key=totals.get, reverse=True)
    print(f"device time per step: {step_us / 1000:.3f} ms, kernels per step: "
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
