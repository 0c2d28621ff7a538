"""Milliseconds a step, speculation off against fixed-k drafting on the device (CUDA), batch 1
and 16: what a drafter's own work adds to a step. A random target accepts nothing, so every
mode makes one token a step and the step time is the whole story; the tokens a step of a real
head makes come from `specserve bench spec-sweep`.

    python tools/step_cost.py --model dummy:llama-3.1-8b --head random --json out.json
    python tools/step_cost.py --model dummy:smollm2-135m --head specserve/heads/smollm2-135m-instruct

Modes (--modes): off; golden (acceptance 0: k verify rows a step, the verification's cost,
sampled and drafted in the graph's tail); eagle3 (the head's catch-up and k - 1 chained steps on
top, its inputs written in the tail, its chain's graph behind it). Each mode has a twin per
--off SWITCH, built with that `env.settings` switch off: by default graph_tail, the twin
"MODE-eager-sampler" (the sampling after the forward graph runs eagerly, runner/graph_tail.py);
any other switch gives "MODE SWITCH=0" (e.g. --off gemv_rows: verify rows on cuBLAS). Engines
are built once and the repeats interleave them; `ratios` pairs each mode with each twin within
each repeat (median and 90 % bootstrap interval).

    python tools/step_cost.py --model dummy:llama-3.1-8b --modes off,golden --off gemv_rows
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
    p.add_argument("--modes", default="off,golden,eagle3")
    p.add_argument("--off", action="append", default=None, help="twin switch (default graph_tail)")
    p.add_argument("--kv-cache-gb", type=float, default=4.0, help="per engine")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args()
    from specserve import LLM, SamplingParams, env
    from specserve.bench.common import engine_kwargs
    from specserve.bench.report import median_interval

    k, budget_off = args.k, {"verify_budget": "off"}
    modes = args.modes.split(",")
    base = {
        "off": None,
        "golden": {"method": "golden", "num_speculative_tokens": k, "acceptance_rate": 0.0},
        "eagle3": {"method": "eagle3", "num_speculative_tokens": k},
    }
    if "eagle3" in modes:
        head = args.head
        if head == "random":
            head = _random_head(args.model, Path(tempfile.mkdtemp()) / "head")
        base["eagle3"]["model"] = head
    switches = args.off or ["graph_tail"]

    def twin(m: str, switch: str) -> str:
        return f"{m}-eager-sampler" if switch == "graph_tail" else f"{m} {switch}=0"

    specs = {}  # name -> (speculative config, switches off)
    for m in modes:
        spec = None if base[m] is None else {**base[m], **budget_off}
        specs[m] = (spec, {})
        specs.update({twin(m, f): (spec, {f: False}) for f in switches})
    llms = {}
    for name, (spec, off) in specs.items():
        with env.override(**off):
            llms[name] = LLM(
                model=args.model,
                dtype="bfloat16",
                max_num_seqs=32,
                speculative_config=spec,
                progress=False,
                seed=0,
                **engine_kwargs(1024, args.kv_cache_gb, False),
            )
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    report: dict = {
        "model": args.model,
        "k": k,
        "off": switches,
        "device": torch.cuda.get_device_name(),
        "ms": {},
    }
    for b in map(int, args.batches.split(",")):
        prompts = [[1 + (i * 37 + j) % 30000 for j in range(128)] for i in range(b)]
        runs: dict[str, list[float]] = {m: [] for m in llms}
        for llm in llms.values():
            llm.generate(prompts, sp, use_tqdm=False)  # warm-up
        for _ in range(args.repeats):
            for m, llm in llms.items():
                eng = llm.engine
                off = specs[m][1]
                s0 = eng.num_steps
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with env.override(**off):  # eager steps read the switch when they run
                    llm.generate(prompts, sp, use_tqdm=False)
                torch.cuda.synchronize()
                runs[m].append(1e3 * (time.perf_counter() - t0) / (eng.num_steps - s0))
        med = {m: statistics.median(v) for m, v in runs.items()}
        ratios = {
            f"{m}/{twin(m, f)}": median_interval([a / e for a, e in zip(runs[m], runs[twin(m, f)])])
            for m in modes
            for f in switches
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
