"""Property tests of the scheduler + ledger over random arrivals, lengths, stops, aborts and
preemptions (DESIGN.md invariants 1, 3, 5, 6; emitted == appended == usage)."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve import SamplingParams
from specserve.sample.layout import build_layout, check_layout
from tests.engine.conftest import make_llm

_ENGINE = {}


def _engine(overlap: bool):
    # one small engine for all examples: 10 usable blocks of 16 tokens force preemption
    if overlap not in _ENGINE:
        _ENGINE[overlap] = make_llm(
            max_num_seqs=6,
            max_num_batched_tokens=24,
            kv_cache_memory_gb=11 * 8192 / 2**30,
            max_model_len=120,
            overlap=overlap,
        )
    return _ENGINE[overlap].engine


request = st.fixed_dictionaries(
    {
        "prompt_len": st.integers(1, 70),
        "max_tokens": st.integers(1, 30),
        "stop_pick": st.one_of(st.none(), st.integers(0, 49151)),
        "ignore_eos": st.booleans(),
        "temperature": st.sampled_from([0.0, 1.0]),
        "arrive_at": st.integers(0, 12),
        "abort_at": st.one_of(st.none(), st.integers(0, 30)),
    }
)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(request, min_size=1, max_size=10), st.integers(0, 2**31))
def test_ledger_invariants_hold_over_random_workloads(overlap, reqs, seed):
    """Under overlap the ledger runs one step late: a request stopped, aborted or preempted while
    its next step is in flight must emit nothing more, and the flush at drain loses nothing."""
    eng = _engine(overlap)
    rng = random.Random(seed)
    emitted: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    seqs = {}
    pending = sorted(enumerate(reqs), key=lambda x: x[1]["arrive_at"])
    tick = 0
    while pending or eng.has_unfinished():
        while pending and pending[0][1]["arrive_at"] <= tick:
            _, r = pending.pop(0)
            prompt = [rng.randrange(3, 49000) for _ in range(r["prompt_len"])]
            stop = [r["stop_pick"]] if r["stop_pick"] is not None else None
            sp = SamplingParams(
                temperature=r["temperature"],
                max_tokens=r["max_tokens"],
                stop_token_ids=stop,
                ignore_eos=r["ignore_eos"],
            )
            seq = eng.add_request(prompt, sp)
            seqs[seq.request_id] = (seq, r)
            emitted[seq.request_id] = []
        for rid, (_seq, r) in seqs.items():
            if r["abort_at"] is not None and r["abort_at"] == tick and rid not in finished:
                eng.abort(rid)
        step_before = eng.scheduler.step_id
        outs = eng.step()
        step = eng.scheduler.step_id
        assert step == step_before + 1
        per_req: dict[str, int] = {}
        for o in outs:
            assert o.step == step
            assert o.request_id not in finished, "output after finish"
            if o.token_id >= 0:
                emitted[o.request_id].append(o.token_id)
                per_req[o.request_id] = per_req.get(o.request_id, 0) + 1
                assert o.num_output_tokens == len(emitted[o.request_id])
            if o.finished:
                finished[o.request_id] = o.finish_reason
        # invariant 3 without drafts: at most accepted + 1 = 1 token per request per step
        assert all(n == 1 for n in per_req.values())
        # invariant 5: KV blocks free + used == total
        eng.block_manager.check_invariants()
        # invariant 6: nothing older than the previous step is still held by the pool
        assert all(s >= step - 1 for s in eng.pool._by_step)
        tick += 1
        assert tick < 2000
    # every request finished exactly once; emitted == appended == usage
    assert set(finished) == set(seqs)
    for rid, (seq, r) in seqs.items():
        assert emitted[rid] == seq.output_token_ids
        assert len(emitted[rid]) == seq.num_output_tokens
        reason = finished[rid]
        if reason == "length":
            assert len(emitted[rid]) == r["max_tokens"] or seq.num_tokens >= eng.max_model_len
        elif reason == "stop":
            assert emitted[rid][-1] in (
                set(r["stop_pick"] is not None and [r["stop_pick"]] or []) | eng.eos_ids
            )
        elif reason == "prompt_length_exceeded":
            assert not emitted[rid]
        else:
            assert reason == "abort"
        if r["stop_pick"] is not None and reason != "abort":
            assert r["stop_pick"] not in emitted[rid][:-1]  # nothing after a stop token
    # idle: all blocks free; after the caller releases, the pool is full
    assert eng.block_manager.num_used_blocks == 0
    eng.release_outputs()
    assert eng.pool.num_free == eng.pool.capacity


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=40))
def test_row_layout_invariant(seqlens):
    import torch

    check_layout(build_layout(torch.tensor(seqlens), sum(seqlens), max(seqlens) - 1))
