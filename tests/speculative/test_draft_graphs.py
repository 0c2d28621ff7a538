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
