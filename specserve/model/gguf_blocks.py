"""A GGUF's integer blocks (value = d q + m per 32 inputs) mapped onto a loaded model's linear
layers: HF names to module names, fused projections (qkv, gate_up) from their shards, a tied
lm_head from the embedding. model/cpu_linear.py keeps them as integer blocks for fp32 CPU
engines; model/quant_int4.py re-encodes the Q4_1 ones as int4.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q [N, K], d, m [N, K/32] fp32


def by_module(model: nn.Module, tensors: dict[str, Blocks]) -> dict[str, list[Blocks | None]]:
    """`tensors` (by HF name) by our module name ("layers.0.self_attn.qkv_proj", "lm_head"),
    one entry per shard of a fused projection (None: that shard has no blocks)."""
    tied = getattr(model, "lm_head", "absent") is None
    out: dict[str, list[Blocks | None]] = {}
    for hf_name, blocks in tensors.items():
        name = hf_name.removeprefix("model.").removesuffix(".weight")
        if name == "embed_tokens":
            if not tied:
                continue  # the lookup stays full precision; only a tied head reads it
            name = "lm_head"
        shard, shards = 0, 1
        for proj, (fused, idx) in getattr(model, "STACKED", {}).items():
            if name.endswith(f".{proj}"):
                name, shard = name.removesuffix(proj) + fused, idx
                shards = 3 if fused == "qkv_proj" else 2
                break
        out.setdefault(name, [None] * shards)[shard] = blocks
    return out


def gguf_blocks(model: nn.Module, path: Path, kinds: tuple[str, ...]) -> dict[str, list]:
    from specserve.model.loader.gguf_file import block_tensors

    return by_module(model, block_tensors(path, kinds))


def shard_rows(model: nn.Module, name: str, weight: torch.Tensor, shards: int) -> list[slice]:
    """The rows of each shard of module `name`'s fused weight [N, K], in the model's layout."""
    if shards == 1:
        return [slice(0, weight.shape[0])]
    rows, start = [], 0
    for i in range(shards):
        n = model._shard_view(weight, f"{name}.weight", i).shape[0]
        rows.append(slice(start, start + n))
        start += n
    return rows


def dequantized(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return d.repeat_interleave(32, dim=1) * q.float() + m.repeat_interleave(32, dim=1)  # [N, K]


def check_against(name: str, weight: torch.Tensor, value: torch.Tensor) -> None:
    """The GGUF's blocks and the loaded weights must agree (they differ by the load dtype's
    rounding only): a wrong name mapping or row permutation fails here, loudly."""
    err = (value - weight.float()).abs().max()
    if not err <= 0.01 * weight.abs().max():
        raise RuntimeError(f"{name}: the GGUF's blocks do not match the loaded weights")


def joined(model: nn.Module, name: str, weight: torch.Tensor, source: list) -> Blocks | None:
    """Module `name`'s blocks with its shards joined along N, checked against `weight` [N, K]
    (every 8th row); None unless every shard has blocks."""
    if not source or any(b is None for b in source):
        return None
    parts = []
    for rows, (q, d, m) in zip(shard_rows(model, name, weight, len(source)), source, strict=True):
        check_against(name, weight[rows][::8], dequantized(q[::8], d[::8], m[::8]))
        parts.append((q, d, m))
    q, d, m = (torch.cat(t, dim=0) for t in zip(*parts))
    return q, d, m
