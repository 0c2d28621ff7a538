"""Sharding without processes: the plan's arithmetic, and every rank's forward at world size 2
run in two threads of this process over a real gloo group, against the unsharded model.

Random weights of std 0.2 (logits far apart), fp32: the all-reduce only changes the order of
the sums, so logits agree to ~1e-5 of their scale and greedy tokens are the same.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from specserve.distributed.group import TPGroup
from specserve.distributed.layers import build_shard, shard_state
from specserve.distributed.plan import ShardPlan, balanced
from specserve.model.config import ModelConfig
from specserve.model.loader.common import build_empty_model
from specserve.runner.model_runner import ModelRunner
from specserve.sampling_params import InvalidRequestError


def _cfg(heads: int, kv: int, **kw: Any) -> ModelConfig:
    base = dict(
        architecture="LlamaForCausalLM",
        vocab_size=1000,
        hidden_size=96,
        intermediate_size=101,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
    )
    return ModelConfig(**{**base, **kw})


CONFIGS = {
    # SmolLM2-135M's attention: 9 heads, 3 KV heads -> KV 2 + 1, query 6 + 3
    "smollm2_heads_uneven": _cfg(9, 3, tie_word_embeddings=True),
    "gqa_even": _cfg(4, 2),
    "mqa_replicated_kv": _cfg(4, 1),
    "vocab_uneven_qwen2_bias": _cfg(
        6, 3, architecture="Qwen2ForCausalLM", vocab_size=1001, attention_bias=True
    ),
    "qwen3_qk_norm_window": _cfg(
        4, 2, architecture="Qwen3ForCausalLM", qk_norm=True, sliding_window=5
    ),
}


# -- the plan ---------------------------------------------------------------------------------
@given(
    kv=st.integers(1, 16),
    group=st.integers(1, 8),
    tp=st.integers(1, 8),
    inter=st.integers(8, 300),
    vocab=st.integers(8, 5000),
)
def test_plan_gives_every_head_column_and_token_to_exactly_one_place(
    kv: int, group: int, tp: int, inter: int, vocab: int
) -> None:
    cfg = _cfg(kv * group, kv, intermediate_size=inter, vocab_size=vocab)
    try:
        plan = ShardPlan.build(cfg, tp)
    except InvalidRequestError as e:
        # refused only when KV heads cannot be replicated evenly over the ranks
        assert kv < tp and (tp % kv or group % (tp // kv)), e
        assert "tensor_parallel_size" in str(e)
        return
    q_seen, kv_seen = [], set()
    for r in plan.ranks:
        assert r.num_q_heads >= 1 and r.num_kv_heads >= 1
        # a rank's query heads are exactly groups of its KV heads (or an even part of one)
        assert r.num_q_heads % r.num_kv_heads == 0
        for h in range(*r.q_heads):
            assert r.kv_heads[0] <= h // group < r.kv_heads[1]
        q_seen += range(*r.q_heads)
        kv_seen |= set(range(*r.kv_heads))
    assert q_seen == list(range(kv * group)) and kv_seen == set(range(kv))
    assert [c for r in plan.ranks for c in range(*r.inter)] == list(range(inter))
    assert [t for r in plan.ranks for t in range(*r.vocab)] == list(range(vocab))
    assert plan.vocab_part * tp >= vocab and all(
        r.vocab[1] - r.vocab[0] <= plan.vocab_part for r in plan.ranks
    )
    assert plan.ranks[0].num_kv_heads == plan.max_kv_heads


def test_smollm2_split_at_tp2() -> None:
    plan = ShardPlan.build(CONFIGS["smollm2_heads_uneven"], 2)
    assert [(r.q_heads, r.kv_heads) for r in plan.ranks] == [((0, 6), (0, 2)), ((6, 9), (2, 3))]
    assert balanced(101, 2) == [51, 50]


def test_kv_heads_that_cannot_be_shared_are_refused_by_name() -> None:
    with pytest.raises(InvalidRequestError, match="2 KV heads with 3 query heads") as e:
        ShardPlan.build(_cfg(6, 2), 4)
    assert e.value.param == "tensor_parallel_size"


# -- two ranks in two threads -----------------------------------------------------------------
def _run_ranks(world: int, fn: Callable[[int, TPGroup], Any]) -> list[Any]:
    store = dist.HashStore()
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            group = TPGroup.create(store, rank, world, torch.device("cpu"), 60)
            results[rank] = fn(rank, group)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


def _random_model(cfg: ModelConfig) -> torch.nn.Module:
    model = build_empty_model(cfg, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


# two requests prefilled (lengths 7 and 12), then a verify-shaped step: 1 and 3 rows each
STEPS = [
    ([list(range(3, 10)), list(range(40, 52))], [0, 0], [1, 1]),
    ([[11], [60, 61, 62]], [7, 12], [1, 3]),
]
TABLES = [[5, 2], [0, 3]]  # block size 8: 2 blocks each, shuffled


def _logits(model: torch.nn.Module, kv_heads: int, cfg: ModelConfig) -> list[torch.Tensor]:
    runner = ModelRunner(
        model,
        cfg.num_hidden_layers,
        kv_heads,
        cfg.head_dim,
        8,
        8,
        torch.float32,
        torch.device("cpu"),
    )
    return [runner.forward(runner.prepare_rows(r, s, TABLES, n)) for r, s, n in STEPS]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_world_size_2_logits_equal_the_unsharded_model(name: str) -> None:
    cfg = CONFIGS[name]
    full = _random_model(cfg)
    want = _logits(full, cfg.num_key_value_heads, cfg)
    plan = ShardPlan.build(cfg, 2)
    state = full.state_dict()

    def rank(r: int, group: TPGroup) -> list[torch.Tensor]:
        model = build_shard(cfg, plan, r, group, torch.float32, torch.device("cpu"))
        model.load_state_dict(shard_state(state, cfg, plan, r), strict=True)
        return _logits(model, plan.ranks[r].num_kv_heads, cfg)

    got = _run_ranks(2, rank)
    for step, w in enumerate(want):
        scale = w.abs().max().item()
        for r in range(2):
            g = got[r][step]
            assert g.shape == w.shape == (sum(STEPS[step][2]), cfg.vocab_size)
            torch.testing.assert_close(g, w, atol=1e-5 * scale, rtol=0, msg=f"rank {r}")
        assert torch.equal(got[0][step].argmax(-1), w.argmax(-1))
