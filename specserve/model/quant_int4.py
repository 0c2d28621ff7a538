"""`quantization="int4"` on the CPU: linear layers (and the lm_head) with 4-bit weights in groups of
32 along K, run by torch's int4pack kernels (specserve/ops/int4.py) on bf16 activations.

Where the weights come from:
  a GGUF's Q4_1 tensors  re-encoded exactly: same 4-bit q, scale = d, zero = m + 8d (the one
                         rounding added: scale and zero to bf16, which the kernel requires)
  anything else          min/max per group of 32 from the loaded full-precision weights (other
                         GGUF types such as the default model's Q8_0 embedding, HF folders)
A fused projection (qkv, gate_up) takes each of its shards from wherever that shard comes from.

The lm_head (with tied embeddings: its own copy of the embedding, as int8 does; the lookup keeps
reading the full-precision rows) is int4 only where the GGUF stores it as Q4_1; otherwise it is
int8 per output channel (model/quant.py's Int8Linear), $SPECSERVE_INT4_HEAD=auto. Why: it is the
most sensitive layer, and llama.cpp's 4-bit files keep it at 8 bits (the default model: Q8_0).
Measured on the default model, 6 held-out prompts teacher-forced, only the head quantized:
top-1 agreement with fp32 0.913 (int4 min/max, mean logit error 0.40) vs 0.986 (int8, 0.06),
while the whole Q4_1 body re-encoded with an fp32 head gives 0.990 (0.08). It costs the int8
head's extra bytes: 28 MB a step instead of 15 MB (the body's 30 layers: 53 MB).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve import env
from specserve.model.gguf_blocks import check_against, gguf_blocks, shard_rows
from specserve.ops.int4 import (
    N_ALIGN,
    ZERO_POINT,
    dequantize,
    from_q4_1,
    int4_linear,
    pack,
    quantize_groups,
)

Groups = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q [N, Kp] 0..15, scale, zero [Kp/32, N]


class Int4Linear(nn.Module):
    """A linear layer whose weight is int4 in groups of 32 (see the module doc)."""

    def __init__(self, groups: Groups, bias: torch.Tensor | None, in_features: int) -> None:
        super().__init__()
        q, scale, zero = groups
        self.out_features, self.in_features = q.shape[0], in_features
        self.pad_k = q.shape[1] - in_features  # zero columns up to a whole group
        pad_n = -self.out_features % N_ALIGN  # padded rows dequantize to exactly 0
        if pad_n:
            q = F.pad(q, (0, 0, 0, pad_n), value=ZERO_POINT)
            scale, zero = F.pad(scale, (0, pad_n)), F.pad(zero, (0, pad_n))
        packed, scales_and_zeros = pack(q, scale, zero)
        self.register_buffer("packed", packed)  # [Np, Kp/2] uint8, the kernel's layout
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [Kp/32, Np, 2] bf16
        # many-row operand (ops/int4.py): what the kernel dequantizes, rounded to bf16
        sz = scales_and_zeros.float()
        wide = dequantize(q, sz[..., 0], sz[..., 1]).to(torch.bfloat16)
        self.register_buffer("wide", wide)  # [Np, Kp] bf16
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int4Linear:
        return cls(quantize_groups(weight), bias, weight.shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.pad_k:
            x2 = F.pad(x2, (0, self.pad_k))
        y = int4_linear(x2, self.packed, self.scales_and_zeros, self.wide)
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, method=int4"


def q4_1_groups(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Groups:
    """Groups of one GGUF Q4_1 tensor (q [N, K] 0..15, d and m [N, K/32])."""
    scale, zero = from_q4_1(d, m)
    return q, scale, zero


def gguf_groups(model: nn.Module, path: Path) -> dict[str, list[Groups | None]]:
    """The GGUF's Q4_1 tensors by our module name ("layers.0.self_attn.qkv_proj", "lm_head"),
    one entry per shard of a fused projection (None: that shard is not Q4_1)."""
    return {
        name: [None if b is None else q4_1_groups(*b) for b in shards]
        for name, shards in gguf_blocks(model, path, ("q4_1",)).items()
    }


def int4_layer(
    model: nn.Module, name: str, weight: torch.Tensor, bias: torch.Tensor | None, source: list
) -> Int4Linear:
    """An Int4Linear for module `name` of `model`: each shard from its Q4_1 groups in `source`
    where it has them, else quantized from `weight` [N, K] (the loaded weights)."""
    if not source or all(g is None for g in source):
        return Int4Linear.from_float(weight, bias)
    parts: list[Groups] = []
    for rows, groups in zip(shard_rows(model, name, weight, len(source)), source, strict=True):
        w = weight[rows]
        if groups is None:
            groups = quantize_groups(w)
        else:
            # every 8th group of rows suffices, and spares a second of start-up
            q, scale, zero = groups
            check_against(name, w[::8], dequantize(q[::8], scale[:, ::8], zero[:, ::8]))
        parts.append(groups)
    q, scale, zero = (torch.cat(t, dim=d) for t, d in zip(zip(*parts), (0, 1, 1)))
    return Int4Linear((q, scale, zero), bias, weight.shape[1])


def quantize_model_int4(model: nn.Module, gguf: Path | None = None) -> nn.Module:
    """Swap every nn.Linear of `model` but its lm_head for an Int4Linear, in place, and give the
    model a quantized lm_head (a tied one too; int4 or int8, see the module doc). Q4_1 tensors
    of the GGUF `gguf` (the file the model was loaded from) are re-encoded, not re-quantized."""
    source = gguf_groups(model, gguf) if gguf is not None else {}
    lm_head = getattr(model, "lm_head", None)
    head = lm_head.weight if isinstance(lm_head, nn.Linear) else None
    if hasattr(model, "lm_head") and lm_head is None:  # tied: the head reads the embedding
        head = model.embed_tokens.weight
    for mod_name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear) and child is not lm_head:
                name = f"{mod_name}.{child_name}" if mod_name else child_name
                layer = int4_layer(model, name, child.weight, child.bias, source.get(name, []))
                setattr(mod, child_name, layer)
    if head is not None:
        model.lm_head = _head(model, head, source.get("lm_head", []))
    return model


def _head(model: nn.Module, weight: torch.Tensor, source: list) -> nn.Module:
    choice = env.settings.int4_head
    if choice == "int4" or (choice == "auto" and source and source[0] is not None):
        return int4_layer(model, "lm_head", weight, None, source)
    from specserve.model.quant import Int8Linear

    return Int8Linear(weight, None, "int8")
