"""Accuracy of CPU variants (quantization, dtype) against fp32 on held-out ShareGPT chat prompts.

    python tools/quant_accuracy.py --variants int8,w8a8,int4 --prompts 10 --tokens 32

fp32 answers each prompt greedily (`--tokens` tokens, EOS ignored). Each variant then reads
prompt + fp32's answer in one forward (teacher-forced: one divergence does not end the
comparison) and is scored on the answer's rows: top-1 = its argmax equals fp32's at the same
context; logit error = |its logits - fp32's| over the whole vocabulary (max, mean). It also
answers greedily on its own: identical answers, and the mean common prefix with fp32's.
Variants are named as in tools/cpu_ab.py (`int4`, `bf16`, `int8-bf16`, ...).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from typing import Any

import torch


def teacher_forced_logits(model: Any, ids: list[int]) -> torch.Tensor:  # [len(ids), V] fp32
    """One prefill forward of `ids` as a single request, with a KV cache of its own."""
    from specserve.ops.forward_context import ForwardContext, KVCache

    cfg, block = model.config, 16
    n = len(ids)
    blocks = (n + block - 1) // block
    p = next(model.parameters(), None)
    dtype = p.dtype if p is not None and p.is_floating_point() else torch.float32
    shape = (blocks, block, cfg.num_key_value_heads, cfg.head_dim)
    caches = [
        KVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        for _ in range(cfg.num_hidden_layers)
    ]
    ctx = ForwardContext(
        query_lens=torch.tensor([n], dtype=torch.int32),
        cu_query_lens=torch.tensor([0, n], dtype=torch.int32),
        context_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(n, dtype=torch.int64),
        max_query_len=n,
        max_context_len=n,
        query_lens_cpu=[n],
        context_lens_cpu=[n],
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(n), caches, ctx)
        return model.compute_logits(hidden).float()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="int8,w8a8,int4")
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from specserve import LLM, SamplingParams
    from specserve.bench.datasets import load_sharegpt_chat
    from tools.cpu_ab import parse_variant

    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)

    def engine(kw: dict[str, Any]) -> LLM:
        return LLM(args.model, device="cpu", progress=False, kv_cache_memory_gb=0.5, **kw)

    def answers(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    def answer_logits(llm: LLM, prompts: list[list[int]], conts: list[list[int]]) -> torch.Tensor:
        rows = []
        for pr, c in zip(prompts, conts):
            logits = teacher_forced_logits(llm.engine.target_model, pr + c)
            rows.append(logits[len(pr) - 1 : len(pr) + len(c) - 1])  # the rows predicting c
        return torch.cat(rows)  # [prompts * tokens, V]

    ref = engine({"dtype": "float32"})
    reqs = load_sharegpt_chat(args.prompts, ref.tokenizer, seed=args.seed)
    prompts = [r.prompt_token_ids for r in reqs]
    conts = answers(ref, prompts)
    want = answer_logits(ref, prompts, conts)
    del ref
    gc.collect()
    report: dict[str, Any] = {"settings": vars(args), "fp32_logit_std": float(want.std())}
    print(f"fp32 logits std {float(want.std()):.2f}")
    for name in args.variants.split(","):
        llm = engine(parse_variant(name)["engine"])
        got = answer_logits(llm, prompts, conts)
        own = answers(llm, prompts)
        del llm
        gc.collect()
        err = (got - want).abs()
        prefix = [
            next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
            for x, y in zip(own, conts)
        ]
        row = {
            "top1_agreement": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
            "logit_error_max": float(err.max()),
            "logit_error_mean": float(err.mean()),
            "identical_answers": sum(a == b for a, b in zip(own, conts)),
            "mean_common_prefix": sum(prefix) / len(prefix),
        }
        report[name] = row
        print(
            f"{name:>10}: top-1 {row['top1_agreement']:.3f}, logit error max "
            f"{row['logit_error_max']:.2f} mean {row['logit_error_mean']:.3f}, identical "
            f"{row['identical_answers']} of {len(prompts)} (common prefix "
            f"{row['mean_common_prefix']:.1f})",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
