"""Milliseconds a step, speculation off against fixed-k drafting on the device (CUDA), batch 1
and 16: what a drafter's own work adds to a step. A random target accepts nothing, so every
mode makes one token a step and the step time is the whole story; the tokens a step of a real
head makes come from `specserve bench spec-sweep`.

    python tools/step_cost.py --model dummy:llama-3.1-8b --head random --json out.json
    python tools/step_cost.py --model dummy:smollm2-135m --head specserve/heads/smollm2-135m-instruct

Modes: off; off-eager-sampler (off with SPECSERVE_GRAPH_TAIL=0: the sampling after the forward
graph runs eagerly, runner/graph_tail.py); golden (acceptance 0: k verify rows a step, the
verification's cost, sampled and drafted in the graph's tail); golden-eager-sampler (the same
with SPECSERVE_GRAPH_TAIL=0); eagle3 (the head's catch-up and k - 1 chained steps on top, its
inputs written in the tail, its chain's graph behind it); eagle3-eager-sampler. Engines are
built once and the repeats interleave the modes; `ratios` pairs each mode with its
eager-sampler twin within each repeat (median and 90 % bootstrap interval).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _random_head(model: str, out: Path) -> str:
    """A random EAGLE-3 head of the target's shape (the 8B shape: 32k draft vocabulary)."""
    from specserve.model.config import ModelConfig
    from specserve.model.loader.dummy import PRESETS
    from tests.model.test_eagle3_format import head_config, head_tensors, write_head

    t = ModelConfig.from_hf(PRESETS[model.removeprefix("dummy:")])
    h, v = t.hidden_size, t.vocab_size
    dv = min(32000, v)
    cfg = head_config(h, t.intermediate_size, t.num_attention_heads, t.num_key_value_heads,
                      t.head_dim, v, dv, rope_theta=t.rope_theta)  # fmt: skip
    ten = head_tensors(h, h, t.intermediate_size, t.num_attention_heads, t.num_key_value_heads,
                       t.head_dim, v, list(range(dv)), 0, scale=0.01, confidence=True)  # fmt: skip
    bf = {k: x.to(torch.bfloat16) if x.is_floating_point() else x for k, x in ten.items()}
    return str(write_head(out, cfg, bf))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dummy:llama-3.1-8b")
    p.add_argument("--head", default="random", help="EAGLE-3 head folder, or random")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args()
    from specserve import LLM, SamplingParams, env
    from specserve.bench.common import engine_kwargs
    from specserve.bench.report import median_interval

    head = args.head
    if head == "random":
        head = _random_head(args.model, Path(tempfile.mkdtemp()) / "head")
    k, off = args.k, {"verify_budget": "off"}
    specs = {
        "off": None,
        "off-eager-sampler": None,
        "golden": {"method": "golden", "num_speculative_tokens": k, "acceptance_rate": 0.0, **off},
        "golden-eager-sampler": None,
        "eagle3": {"method": "eagle3", "model": head, "num_speculative_tokens": k, **off},
        "eagle3-eager-sampler": None,
    }
    llms = {}
    specs["golden-eager-sampler"] = specs["golden"]
    specs["eagle3-eager-sampler"] = specs["eagle3"]
    for m, s in specs.items():
        with env.override(graph_tail=not m.endswith("eager-sampler")):
            llms[m] = LLM(
                model=args.model,
                dtype="bfloat16",
                max_num_seqs=32,
                speculative_config=s,
                progress=False,
                seed=0,
                **engine_kwargs(1024, 4, False),
            )
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    report: dict = {"model": args.model, "k": k, "device": torch.cuda.get_device_name(), "ms": {}}
    for b in map(int, args.batches.split(",")):
        prompts = [[1 + (i * 37 + j) % 30000 for j in range(128)] for i in range(b)]
        runs: dict[str, list[float]] = {m: [] for m in llms}
        for llm in llms.values():
            llm.generate(prompts, sp, use_tqdm=False)  # warm-up
        for _ in range(args.repeats):
            for m, llm in llms.items():
                eng = llm.engine
                s0 = eng.num_steps
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                llm.generate(prompts, sp, use_tqdm=False)
                torch.cuda.synchronize()
                runs[m].append(1e3 * (time.perf_counter() - t0) / (eng.num_steps - s0))
        med = {m: statistics.median(v) for m, v in runs.items()}
        ratios = {
            f"{m}/{m}-eager-sampler": median_interval(
                [a / e for a, e in zip(runs[m], runs[f"{m}-eager-sampler"])]
            )
            for m in ("off", "golden", "eagle3")
        }
        report["ms"][f"batch{b}"] = {"runs": runs, "median": med, "ratios": ratios}
        print(f"batch {b}: " + ", ".join(f"{m} {v:.2f} ms" for m, v in med.items()), flush=True)
        print(
            "  " + ", ".join(f"{m} {r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}]" for m, r in ratios.items())
        )
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
