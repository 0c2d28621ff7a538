"""The sampler's packed upload (runner/sampler_inputs.py) holds exactly what the per-tensor
construction held: SamplingTensors.build and build_layout over the same rows."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.engine.sequence import Sequence
from specserve.ops.sampling import SamplingTensors
from specserve.runner.sampler_inputs import (
    GOLDEN,
    LOGPROBS,
    MIN_TOKENS,
    PENALTIES,
    PROCESSING,
    build_inputs,
)
from specserve.sample.layout import build_layout
from specserve.sampling_params import SamplingParams

_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 1e-6, 0.5, 1.0, 1.7]),
    top_k=st.sampled_from([0, 1, 5, 50]),
    top_p=st.sampled_from([1.0, 0.9, 0.3]),
    min_p=st.sampled_from([0.0, 0.05]),
    min_tokens=st.sampled_from([0, 3]),
    presence_penalty=st.sampled_from([0.0, 0.5]),
    logprobs=st.sampled_from([None, 2]),
    logit_bias=st.sampled_from([None, {5: 1.0}]),
    golden_token_ids=st.sampled_from([None, [4, 5, 6]]),
)
_request = st.tuples(
    _params,
    st.integers(-(2**70), 2**70),  # seed: any Python int, low 64 bits kept
    st.integers(0, 40),  # output tokens so far
    st.integers(0, 2),  # pending (overlap)
    st.lists(st.integers(-1, 1000), max_size=4),  # drafts
    st.integers(0, 64),  # slot
)


@settings(max_examples=150, deadline=None)
@given(reqs=st.lists(_request, min_size=1, max_size=8))
def test_packed_inputs_equal_the_per_tensor_build(reqs) -> None:
    seqs, drafts, counters, row_params, seeds, draft_rows = [], [], [], [], [], []
    for i, (params, seed, n_out, pending, d, slot) in enumerate(reqs):
        seq = Sequence(str(i), None, [1, 2, 3], params, seed)
        seq.token_ids += [7] * n_out
        seq.num_pending = pending
        seq.slot = slot
        seqs.append(seq)
        drafts.append(d)
        for j in range(len(d) + 1):
            row_params.append(params)
            seeds.append(seed)
            counters.append(n_out + pending + j)
        draft_rows += [*d, 0]
    cpu = torch.device("cpu")
    for _ in range(2):  # the second step reads the rows packed by the first
        layout, t, draft_ids, slots, seqlens_q, needs = build_inputs(seqs, drafts, cpu)
        ref_t = SamplingTensors.build(row_params, seeds, counters, cpu)
        ref_layout = build_layout(torch.tensor(seqlens_q), sum(seqlens_q), max(seqlens_q) - 1)
        assert seqlens_q == [1 + len(d) for d in drafts]
        for name in ("temperature", "top_k", "top_p", "min_p", "seed", "counter"):
            a, b = getattr(t, name), getattr(ref_t, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
        for name in ("all_greedy", "any_greedy", "any_top_k", "any_top_p", "any_min_p"):
            assert getattr(t, name) == getattr(ref_t, name), name
        assert t.max_top_k == ref_t.max_top_k
        for name in ("seqlens_q", "ftp", "row_to_req", "local_step", "is_verify"):
            a, b = getattr(layout, name), getattr(ref_layout, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
        assert (layout.total_q, layout.max_drafts) == (ref_layout.total_q, ref_layout.max_drafts)
        assert torch.equal(draft_ids, torch.tensor(draft_rows, dtype=torch.int64))
        assert torch.equal(slots, torch.tensor([s.slot for s in seqs], dtype=torch.int64))
        # the slow paths a step's requests need, so the sampler scans only for those
        ps = [s.params for s in seqs]
        expected = {
            PENALTIES: any(p.has_penalties for p in ps),
            PROCESSING: any(p.has_logits_processing for p in ps),
            MIN_TOKENS: any(p.min_tokens > 0 for p in ps),
            GOLDEN: any(p.golden_token_ids is not None for p in ps),
            LOGPROBS: any(p.logprobs is not None for p in ps),
        }
        assert {flag: bool(needs & flag) for flag in expected} == expected
        # every array a kernel reads starts a multiple of 16 bytes into the buffer, whatever R
        # and T: Triton compiles a variant per pointer alignment (PackedInputs)
        arrays = [*layout[:5], t.temperature, t.top_k, t.top_p, t.min_p, t.seed, t.counter]
        base = layout.seqlens_q.data_ptr()
        assert all((x.data_ptr() - base) % 16 == 0 for x in [*arrays, draft_ids, slots])
