"""Which rows and columns of each weight a tensor-parallel rank holds (Megatron-style).

Attention is split by KV head: each rank owns a contiguous run of KV heads and exactly the query
heads of their groups, so its attention is ordinary GQA over its own heads and its KV cache holds
only those heads. Sizes that do not divide are split unevenly, the first ranks taking one more
(SmolLM2-135M at TP=2: 3 KV heads -> 2 + 1, so 6 + 3 of its 9 query heads). With fewer KV heads
than ranks each KV head is replicated on tp / kv ranks that split its query group evenly; other
combinations are refused with the sizes named. The MLP's intermediate columns are split the same
uneven way. The vocabulary is cut into equal parts of ceil(V / tp) rows, the last padded with
zero rows that are trimmed from the gathered logits.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.model.config import ModelConfig
from specserve.sampling_params import InvalidRequestError


def balanced(total: int, parts: int) -> list[int]:
    """total split into `parts` contiguous counts, the first ones one larger when uneven."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


@dataclass(frozen=True)
class RankShard:
    """One rank's part of every sharded weight, as [start, stop) ranges of the full tensors."""

    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    inter: tuple[int, int]  # MLP intermediate columns
    vocab: tuple[
        int, int
    ]  # vocabulary rows it holds (the last rank's may stop short of vocab_part)

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def inter_size(self) -> int:
        return self.inter[1] - self.inter[0]


@dataclass(frozen=True)
class ShardPlan:
    world_size: int
    vocab_size: int
    vocab_part: int  # rows of every rank's embedding / lm_head shard (ceil(V / tp))
    ranks: tuple[RankShard, ...]

    @property
    def max_kv_heads(self) -> int:
        """KV heads of the largest cache shard (rank 0's): sizes the KV budget of every rank."""
        return max(r.num_kv_heads for r in self.ranks)

    @staticmethod
    def build(cfg: ModelConfig, tp: int) -> ShardPlan:
        h, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        group = h // hkv
        if hkv >= tp:
            kv_counts = balanced(hkv, tp)
            kv_ranges = _ranges(kv_counts)
            q_ranges = [(a * group, b * group) for a, b in kv_ranges]
        elif tp % hkv == 0 and group % (tp // hkv) == 0:
            rep = tp // hkv  # ranks per KV head, each with group / rep of its query heads
            per = group // rep
            kv_ranges = [(r // rep, r // rep + 1) for r in range(tp)]
            q_ranges = [(r * per, (r + 1) * per) for r in range(tp)]
        else:
            raise InvalidRequestError(
                f"tensor_parallel_size={tp} does not fit this model's attention: "
                f"{hkv} KV heads with {group} query heads each; use a tensor_parallel_size "
                f"<= {hkv}, or a multiple of {hkv} that divides {h}",
                "tensor_parallel_size",
            )
        if cfg.intermediate_size < tp:
            raise InvalidRequestError(
                f"tensor_parallel_size={tp} exceeds the MLP width {cfg.intermediate_size}",
                "tensor_parallel_size",
            )
        inter = _ranges(balanced(cfg.intermediate_size, tp))
        part = -(-cfg.vocab_size // tp)
        vocab = [
            (min(r * part, cfg.vocab_size), min((r + 1) * part, cfg.vocab_size)) for r in range(tp)
        ]
        ranks = tuple(
            RankShard(q, kv, i, v) for q, kv, i, v in zip(q_ranges, kv_ranges, inter, vocab)
        )
        return ShardPlan(tp, cfg.vocab_size, part, ranks)


def _ranges(counts: list[int]) -> list[tuple[int, int]]:
    out, at = [], 0
    for c in counts:
        out.append((at, at + c))
        at += c
    return out
