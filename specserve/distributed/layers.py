"""Megatron-style sharding of a Llama-family model for one tensor-parallel rank.

Column-parallel: the fused qkv projection (this rank's query heads and the KV heads of their
groups, plan.py) and the fused gate/up projection (its intermediate columns); their outputs stay
local. Row-parallel: o_proj and down_proj take those local columns and produce a partial sum of
the full hidden state, all-reduced at once, so every layer boundary (norms, residual stream) is
replicated and identical on every rank. Vocabulary-parallel: the embedding looks up only the
ids of its vocabulary part (zeros elsewhere, then all-reduce); the lm_head (or the tied
embedding) scores its part and the parts are all-gathered, so rank 0 samples from full logits.

The sharded modules keep the full model's parameter names, so `shard_state` (full tensors ->
this rank's slices) and `parallelize_` (the sharded module tree) meet by name.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed.group import TPGroup
from specserve.distributed.plan import ShardPlan
from specserve.model.config import ModelConfig
from specserve.model.layers import Linear
from specserve.model.registry import get_model_class


class RowParallelLinear(Linear):
    """Linear over this rank's input columns, all-reduced: the full output on every rank."""

    def __init__(self, in_features: int, out_features: int, group: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / tp] -> [T, out]
        return self.group.all_reduce(super().forward(x).contiguous())


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + part) of the embedding; other ids contribute zeros to the sum."""

    def __init__(self, part: int, hidden: int, start: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(part, hidden))
        self.start = start
        self.group = group
        # rank 0, when a drafter on rank 0 alone embeds tokens (EAGLE-3): the whole table, on
        # the host until asked for (not a parameter: the shard's state stays the shard)
        self.full_weight: torch.Tensor | None = None
        self._replicated: nn.Embedding | None = None

    def replicated(self) -> nn.Embedding:
        """A plain embedding of the whole vocabulary on this rank's device (no collective)."""
        if self._replicated is None:
            if self.full_weight is None:
                raise RuntimeError("this rank keeps no full embedding")
            w = self.full_weight.to(self.weight.device, self.weight.dtype)
            self._replicated = nn.Embedding(w.shape[0], w.shape[1], _weight=w).requires_grad_(False)
            self.full_weight = None
        return self._replicated

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])  # [T] bool
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(x.masked_fill_(outside[:, None], 0.0))


def parallelize_(model: nn.Module, plan: ShardPlan, rank: int, group: TPGroup) -> nn.Module:
    """Swap the sharded modules in, empty, on the current default device and dtype (meta while
    building); the caller fills them with `shard_state(...)`. Returns the model."""
    cfg: ModelConfig = model.config
    s = plan.ranks[rank]
    d, hidden = cfg.head_dim, cfg.hidden_size
    for layer in model.layers:
        a = layer.self_attn
        a.num_heads, a.num_kv_heads = s.num_q_heads, s.num_kv_heads
        a.q_size, a.kv_size = s.num_q_heads * d, s.num_kv_heads * d
        a.qkv_proj = Linear(hidden, a.q_size + 2 * a.kv_size, bias=cfg.attention_bias)
        a.o_proj = RowParallelLinear(a.q_size, hidden, group)
        m = layer.mlp
        m.intermediate_size = s.inter_size
        m.gate_up_proj = Linear(hidden, 2 * s.inter_size, bias=False)
        m.down_proj = RowParallelLinear(s.inter_size, hidden, group)
    model.embed_tokens = VocabParallelEmbedding(plan.vocab_part, hidden, s.vocab[0], group)
    if model.lm_head is not None:
        model.lm_head = nn.Linear(hidden, plan.vocab_part, bias=False)
    model.gather_logits = functools.partial(group.gather_vocab, vocab_size=cfg.vocab_size)
    return model


def shard_state(
    full: dict[str, torch.Tensor], cfg: ModelConfig, plan: ShardPlan, rank: int
) -> dict[str, torch.Tensor]:
    """This rank's slice of every tensor of the full model's state dict (contiguous copies;
    replicated tensors are shared, not copied)."""
    s, d = plan.ranks[rank], cfg.head_dim
    q0, q1 = (h * d for h in s.q_heads)
    k0, k1 = (cfg.q_size + h * d for h in s.kv_heads)
    v0, v1 = (cfg.q_size + cfg.kv_size + h * d for h in s.kv_heads)
    i0, i1 = s.inter
    big = cfg.intermediate_size
    out = {}
    for name, t in full.items():
        if name in ("embed_tokens.weight", "lm_head.weight"):
            part = t.new_zeros((plan.vocab_part, t.shape[1]))
            lo, hi = s.vocab
            part[: hi - lo] = t[lo:hi]
            out[name] = part
        elif ".qkv_proj." in name:
            out[name] = torch.cat([t[q0:q1], t[k0:k1], t[v0:v1]])
        elif name.endswith(".o_proj.weight"):
            out[name] = t[:, q0:q1].contiguous()
        elif name.endswith(".gate_up_proj.weight"):
            out[name] = torch.cat([t[i0:i1], t[big + i0 : big + i1]])
        elif name.endswith(".down_proj.weight"):
            out[name] = t[:, i0:i1].contiguous()
        else:  # norms: replicated
            out[name] = t
    return out


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_shard(
    cfg: ModelConfig,
    plan: ShardPlan,
    rank: int,
    group: TPGroup,
    dtype: torch.dtype,
    device: torch.device,
) -> nn.Module:
    """This rank's sharded model with allocated, unfilled weights on `device`."""
    with _default_dtype(dtype), torch.device("meta"):
        model = parallelize_(get_model_class(cfg.architecture)(cfg), plan, rank, group)
    return model.to_empty(device=device).requires_grad_(False).eval()
