"""Device idle time between consecutive steps in steady decode, overlap on vs off (same run).

    python tools/device_idle.py --model dummy:llama-3.1-8b --batch 64 --json idle.json

B requests of --input-len random tokens start together and decode --max-tokens tokens each
(ignore_eos), with golden speculation on the device when --golden-rate is given (k drafts, the
verify budget on); CUDA events bracket every step (runner/timeline.py) and the summary covers the
pure decode steps: idle = sum of gaps between one step's last queued work and the next step's
first, as a share of the device time they span.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from specserve.bench.report import hardware_info, software_info, timestamp


def measure(args: argparse.Namespace, overlap: bool) -> dict[str, Any]:
    from specserve import LLM, SamplingParams

    spec = None
    if args.golden_rate is not None:
        spec = {"method": "golden", "num_speculative_tokens": args.k}
        spec["acceptance_rate"] = args.golden_rate
    llm = LLM(
        speculative_config=spec,
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.batch,
        max_model_len=args.input_len + args.max_tokens + 16,
        enable_prefix_caching=False,  # the warm-up must not serve the timed prompts
        overlap=overlap,
        enforce_eager=args.enforce_eager,
        progress=False,
    )
    eng = llm.engine
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(args.batch)]
    gold = [rng.randrange(3, vocab) for _ in range(args.max_tokens)] if spec else None
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, golden_token_ids=gold)
    # warm-up on the same shapes: Triton JIT and cuBLAS choices happen here, not in the timing
    llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    eng.timeline.start()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    eng.timeline.stop()
    s = eng.timeline.summary("decode")
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "overlap": overlap,
        "num_sync_steps": eng.num_sync_steps,
        "tokens_per_request_step": tokens / max(1, s.num_steps * args.batch),
        "decode_steps": s.num_steps,
        "idle_fraction": s.idle_fraction,
        "device_busy_ms_per_step": s.busy_ms / max(1, s.num_steps),
        "device_wall_ms_per_step": s.wall_ms / max(1, s.num_steps),
        "output_tokens": tokens,
        "host_wall_s": wall,
        "output_tok_s": tokens / wall,
    }


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="dummy:llama-3.1-8b", help="model (default: random 8B)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 (half)")
    p.add_argument("--batch", type=int, default=64, help="requests at once")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens per request")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--modes", default="overlap,sync", help="comma list of overlap, sync")
    p.add_argument("--golden-rate", type=float, default=None, help="golden drafts at this rate")
    p.add_argument("--k", type=int, default=4, help="with --golden-rate: drafts per request")
    p.add_argument("--json", dest="json_path", default=None, help="write the report here")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_args(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    runs = [measure(args, mode == "overlap") for mode in args.modes.split(",")]
    for r in runs:
        print(
            f"{'overlap' if r['overlap'] else 'sync':8s} idle {100 * r['idle_fraction']:5.2f} %  "
            f"device {r['device_busy_ms_per_step']:.3f} ms busy / "
            f"{r['device_wall_ms_per_step']:.3f} ms per step  {r['output_tok_s']:.0f} tok/s"
        )
    if args.json_path:
        report = {
            "benchmark": "device_idle",
            "command": " ".join(sys.argv),
            "settings": {k: v for k, v in vars(args).items() if not callable(v)},
            "hardware": hardware_info(),
            "software": software_info(),
            "timestamp": timestamp(),
            "runs": runs,
        }
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
