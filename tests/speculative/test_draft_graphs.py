"""The model drafters' graphs (draft_graphs.py): buckets, and coarse sampling shapes that give the
very probabilities of each request's own filters (test_eagle3.py and test_device_drafting.py run
the padded bodies end to end)."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve import SamplingParams
from specserve.ops.sampling import SamplingTensors, target_probs
from specserve.speculative.draft_graphs import _SHAPES, chain_buckets, sampling_shape


def test_buckets_cover_every_request_count():
    assert chain_buckets(8) == [1, 2, 4, 8]
    assert chain_buckets(12) == [1, 2, 4, 8, 12]
    assert chain_buckets(1) == [1]


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.7, 1.3]),
            st.sampled_from([0, 1, 5]),
            st.sampled_from([1.0, 0.3, 0.9]),
            st.sampled_from([0.0, 0.2]),
        ),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**16),
)
def test_a_coarser_sampling_shape_gives_the_same_probabilities(rows, seed):
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in rows]
    t = SamplingTensors.build(params, [0] * len(rows), [0] * len(rows), "cpu")
    logits = torch.randn(len(rows), 50, generator=torch.Generator().manual_seed(seed))
    want = target_probs(logits, t)
    shape = sampling_shape(t)
    for coarser in list(_SHAPES)[list(_SHAPES).index(shape) :]:
        got = target_probs(logits, dataclasses.replace(t, **_SHAPES[coarser]))
        assert torch.equal(got, want), coarser


def test_the_tail_writes_a_steady_steps_inputs_with_trash_past_each_requests_blocks():
    """DraftGraphs.tail_inputs (runner/graph_tail.py hands it the step, padded to the forward's
    bucket): the token each verify row emitted (its accepted draft, else its request's sampled
    token), the per-request state, block tables whose columns past a request's own blocks (the
    forward's stale ones) are the trash block, and padding up to the chain's bucket."""
    from specserve.engine.slots import DraftSlotPool
    from specserve.runner.graph_tail import TailStep, TailViews
    from specserve.sample.verify import VerifyResult
    from specserve.speculative.draft_graphs import DraftGraphs

    trash, i64 = 99, dict(dtype=torch.int64)
    g = DraftGraphs(DraftSlotPool(8, 3, 50, False, torch.device("cpu")), 6, 4, trash, True)
    g.seq_len.fill_(7)  # an earlier step's: the padding must overwrite it
    g.slots.fill_(3)
    t = lambda *x: torch.tensor(x, **i64)  # noqa: E731
    # Bb = 3 requests (the third padding), Tb = 8 rows: requests of 3 and 4 rows, 1 padding row
    views = TailViews(
        seed=torch.zeros(8, **i64), counter=torch.zeros(8, **i64), draft=torch.zeros(8, **i64),
        seqlens_q=t(3, 4, 0), ftp=t(0, 3, 7), slots=t(5, 2, 0), req_shift=t(0, 0, 0),
        anchor_pos=t(10, 20, 0), num_blocks=t(2, 3, 0), room=t(0, 0, 0), temperature=torch.zeros(8),
    )  # fmt: skip
    res = VerifyResult(
        verified_token_ids=torch.tensor([11, -1, -1, 21, 22, 23, -1, -1], dtype=torch.int32),
        sampled_token_ids=t(15, 25, 0), num_accepted=t(1, 3, 0), final_rows=t(1, 6, 7),
    )  # fmt: skip
    stale = torch.full((3, 6), 7, dtype=torch.int32)
    stale[0, :2], stale[1, :3] = t(4, 5), t(1, 2, 3)
    row_req = t(0, 0, 0, 1, 1, 1, 1, 0)
    g.tail_inputs(TailStep(views, row_req, res, t(12, 24, 2), stale), t(2, 4, 0))
    assert g.emitted[:7].tolist() == [11, 15, 15, 21, 22, 23, 25]
    assert g.block_tables[:4].tolist() == [
        [4, 5, trash, trash, trash, trash],
        [1, 2, 3, trash, trash, trash],
        [trash] * 6,
        [trash] * 6,  # the chain's bucket for 3 requests is 4: one more padding request
    ]
    assert g.seq_len[:4].tolist() == [12, 24, 2, 2] and g.slots[:4].tolist() == [5, 2, 0, 0]
    assert g.accepted[:4].tolist() == [1, 3, 0, 0] and g.num_rows[:4].tolist() == [3, 4, 0, 0]
    assert g.first_row[:3].tolist() == [0, 3, 7] and g.num_output[:3].tolist() == [2, 4, 0]
