"""catch_up_graphs.py: a catch-up replayed in its rows bucket (padding rows, padding requests,
state left by a larger catch-up before it) gives the eager forward's outputs and KV writes; one
past the largest bucket runs eagerly."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.ops.attention import paged_attention, write_kv
from specserve.ops.forward_context import ForwardContext, KVCache
from specserve.speculative.catch_up_graphs import CatchUpGraphs, catch_up_sizes
from tests.speculative.fake_graphs import FakeGraphs

BS, BLOCKS, WIDTH, HKV, H, D, VOCAB = 4, 80, 12, 2, 4, 16, 50
MAX_ROWS, MAX_REQS = 64, 6


def test_every_row_count_up_to_the_largest_has_a_bucket():
    for top in (1, 8, 9, 40, 64, 300, 2048):
        sizes = catch_up_sizes(top)
        assert sizes == sorted(set(sizes)) and sizes[-1] == top
        # padding stays under half a small bucket, under 64 / 128 rows past them
        for c in range(1, top + 1):
            b = next(s for s in sizes if s >= c)
            assert b - c < max(c, 8) and b - c < 128


def _forward(cache: KVCache):
    """A forward with the catch-up's structure: KV writes, paged attention over any rows per
    request, two outputs at the named rows (the second one absent, as without a confidence
    head)."""
    emb = torch.randn(VOCAB, H, D, generator=torch.Generator().manual_seed(0))

    def fwd(tokens, positions, ctx, rows):
        q = emb[tokens] * (1 + positions[:, None, None] / 100)  # [C, H, D]
        write_kv(q[:, :HKV], -q[:, HKV:], cache, ctx.slot_mapping)
        o = paged_attention(q, cache, ctx, D**-0.5)
        return o.flatten(1)[rows], None

    return fwd


def _catch_up(g: torch.Generator, qlens: list[int], starts: list[int]):
    """Tokens, positions and the context of requests with `qlens` rows from `starts`, each on
    its own blocks, and each request's last row."""
    r = len(qlens)
    perm = torch.randperm(BLOCKS, generator=g)[: r * WIDTH].view(r, WIDTH).to(torch.int32)
    req = torch.repeat_interleave(torch.arange(r), torch.tensor(qlens))
    cu = torch.zeros(r + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(qlens), 0)
    pos = torch.tensor(starts)[req] + torch.arange(len(req)) - cu[:-1].long()[req]
    slots = perm[req, pos // BS].long() * BS + pos % BS
    ctx = ForwardContext(
        torch.tensor(qlens, dtype=torch.int32), cu,
        (torch.tensor(starts) + torch.tensor(qlens)).to(torch.int32), perm, slots,
        max(qlens), WIDTH * BS,
    )  # fmt: skip
    tokens = torch.randint(VOCAB, (len(req),), generator=g)
    return tokens, pos, ctx, cu[1:].long() - 1


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(1, 20), st.integers(0, 20)), min_size=1, max_size=MAX_REQS),
        min_size=1,
        max_size=4,
    ),
    st.integers(0, 2**16),
)
def test_a_replayed_catch_up_is_the_eager_forward(steps, seed):
    """A sequence of catch-ups (each a list of (rows, start) per request) run through the
    graphs and eagerly, each on its own copy of the same KV cache: the same outputs and the
    same cache after every one; the ones within the largest bucket replayed."""
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, BS, HKV, D)
    init = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    eager = KVCache(init[0].clone(), init[1].clone())
    padded = KVCache(init[0].clone(), init[1].clone())
    graphs = CatchUpGraphs(
        _forward(padded), MAX_REQS, WIDTH, WIDTH * BS, torch.device("cpu"), MAX_ROWS, padded=True
    )
    fake = FakeGraphs()
    graphs.capture(fake)
    assert fake.captured == len(catch_up_sizes(MAX_ROWS))
    run_eager = _forward(eager)
    for step in steps:
        qlens, starts = [q for q, _ in step], [s for _, s in step]
        tokens, pos, ctx, last = _catch_up(g, qlens, starts)
        before = graphs.num_replays
        got, none = graphs.run(tokens, pos, ctx, last)
        want, _ = run_eager(tokens, pos, ctx, last)
        assert none is None
        torch.testing.assert_close(got, want)
        assert torch.equal(eager.k, padded.k) and torch.equal(eager.v, padded.v)
        assert graphs.num_replays == before + (sum(qlens) <= MAX_ROWS)
