"""Property tests under speculation: random draft lengths and acceptance patterns, stops (EOS,
stop ids, max_tokens, stop strings inside the accepted prefix), aborts and preemptions.
DESIGN.md invariants 1-4 hold every step; emitted == appended == usage."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve import SamplingParams, env
from specserve.speculative.draft_model import DraftModelDrafter
from tests.engine.conftest import make_llm

_ENGINE = {}


class CorruptingDrafter:
    """The target drafting for itself (near-total greedy acceptance), with each proposal cut to a
    random length and corrupted at a random position: accepted prefixes of every length."""

    has_q = True

    def __init__(self, inner: DraftModelDrafter) -> None:
        self.inner = inner
        self.rng = random.Random(0)

    def propose(self, seqs, limits):
        limits = [self.rng.randint(0, k) for k in limits]
        out = []
        for d, c in self.inner.propose(seqs, limits):
            if d and self.rng.random() < 0.5:
                j = self.rng.randrange(len(d))
                d = d[:j] + [self.rng.randrange(3, 49000)] + d[j + 1 :]
            out.append((d, c))
        return out

    def observe(self, seq, nd, na):
        self.inner.observe(seq, nd, na)

    def release(self, seq):
        self.inner.release(seq)

    def plan_confidences(self, seq, k):
        return self.inner.plan_confidences(seq, k)


def _engine(overlap: bool):
    if overlap not in _ENGINE:
        with env.override(device_drafts=False):  # the host drafter, corrupted below
            llm = _make(overlap)
        llm.engine.drafter = CorruptingDrafter(llm.engine.drafter)
        _ENGINE[overlap] = llm
    return _ENGINE[overlap].engine


def _make(overlap: bool):
    return make_llm(
        speculative_config={
            "method": "draft_model",
            "num_speculative_tokens": 4,
            "model": "self",
        },
        max_num_seqs=6,
        max_num_batched_tokens=24,
        kv_cache_memory_gb=13 * 8192 / 2**30,
        max_model_len=120,
        debug_invariants=True,
        overlap=overlap,
    )


request = st.fixed_dictionaries(
    {
        "prompt_len": st.integers(1, 60),
        "max_tokens": st.integers(1, 30),
        "stop_tok": st.one_of(st.none(), st.integers(0, 400)),
        "stop_str": st.one_of(st.none(), st.sampled_from(["e", "an", " the", ".", "in"])),
        "temperature": st.sampled_from([0.0, 0.0, 1.0]),
        "arrive_at": st.integers(0, 8),
        "abort_at": st.one_of(st.none(), st.integers(0, 25)),
    }
)


def step_outs_for(outs, request_id):
    return [o for o in outs if o.request_id == request_id]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(request, min_size=1, max_size=8), st.integers(0, 2**31))
def test_spec_invariants_over_random_workloads(overlap, reqs, seed):
    """overlap=True: the verify budget is made to drop every draft at random (its plan is no
    drafts), so the engine keeps switching between synchronous speculative steps and
    overlapped plain steps (ledger one step late, flush before each drafting round)."""
    eng = _engine(overlap)
    rng = random.Random(seed)
    seqs = {}
    emitted: dict[str, list[int]] = {}
    texts: dict[str, list[str]] = {}
    finished: dict[str, str] = {}
    processed = []  # (batch, host result, its outputs) of every ledger pass in a step() call
    real_process = eng.ledger.process_outputs
    real_allot = eng.budget.allot

    def spy(batch, res, *rest):
        outs = real_process(batch, res, *rest)
        processed.append((batch, res, list(outs)))
        return outs

    def dropping_allot(surv, base_rows, room=None):
        keep = real_allot(surv, base_rows, room)
        return [0] * len(keep) if rng.random() < 0.5 else keep

    eng.ledger.process_outputs = spy
    if overlap:
        eng.budget.allot = dropping_allot
    try:
        pending = sorted(reqs, key=lambda r: r["arrive_at"])
        tick = 0
        while pending or eng.has_unfinished():
            while pending and pending[0]["arrive_at"] <= tick:
                r = pending.pop(0)
                # a low-entropy prompt so the ids 0..400 show up as stop tokens now and then
                prompt = [rng.randrange(3, 400) for _ in range(r["prompt_len"])]
                sp = SamplingParams(
                    temperature=r["temperature"],
                    max_tokens=r["max_tokens"],
                    stop_token_ids=[r["stop_tok"]] if r["stop_tok"] is not None else None,
                    stop=r["stop_str"],
                )
                seq = eng.add_request(prompt, sp)
                seqs[seq.request_id] = (seq, r)
                emitted[seq.request_id], texts[seq.request_id] = [], []
            for rid, (_seq, r) in seqs.items():
                if r["abort_at"] == tick and rid not in finished:
                    eng.abort(rid)
            processed.clear()
            outs = eng.step()  # debug_invariants: blocks (5) and slots (4) checked inside
            for o in outs:
                assert o.request_id not in finished
                if o.token_id >= 0:
                    emitted[o.request_id].append(o.token_id)
                texts[o.request_id].append(o.text)
                if o.finished:
                    finished[o.request_id] = o.finish_reason
            for batch, res, step_outs in processed:
                if res is None:
                    continue
                per_req: dict[str, int] = {}
                for o in step_outs:
                    if o.token_id >= 0:
                        per_req[o.request_id] = per_req.get(o.request_id, 0) + 1
                sampling = [
                    (s, nd, ep)
                    for s, nd, sm, ep in zip(
                        batch.seqs, batch.num_drafts, batch.samples, batch.epochs
                    )
                    if sm
                ]
                row = 0
                for r_i, (s, nd, ep) in enumerate(sampling):
                    if s.request_id not in seqs:
                        # a step still in flight when the previous example drained: its
                        # requests are finished there and push nothing here
                        assert s.is_finished and not step_outs_for(step_outs, s.request_id)
                        row += nd + 1
                        continue
                    rows = res.verified_token_ids[row : row + nd + 1]
                    # invariant 2: t1..tk then only sentinels
                    n = res.num_accepted[r_i]
                    assert all(x >= 0 for x in rows[:n]) and all(x == -1 for x in rows[n:])
                    pushed = per_req.get(s.request_id, 0)
                    # invariant 3: pushed <= accepted + 1, and < only when the request finished
                    assert pushed <= n + 1
                    if pushed < n + 1:  # finished, or preempted while this step flew
                        assert s.request_id in finished or (overlap and s.epoch != ep)
                    row += nd + 1
            tick += 1
            assert tick < 3000
    finally:
        eng.ledger.process_outputs = real_process
        eng.budget.allot = real_allot
    assert set(finished) == set(seqs)
    for rid, (seq, r) in seqs.items():
        assert emitted[rid] == seq.output_token_ids  # emitted == appended
        assert len(emitted[rid]) == seq.num_output_tokens  # == usage
        text = "".join(texts[rid])
        if finished[rid] == "stop" and seq.stop_reason == r["stop_str"]:
            assert r["stop_str"] not in text  # trimmed at the stop string, nothing after
        if r["stop_str"] is not None and finished[rid] != "abort":
            assert r["stop_str"] not in text
        if r["stop_tok"] is not None and finished[rid] != "abort":
            assert r["stop_tok"] not in emitted[rid][:-1]
        assert seq.spec.num_accepted_tokens <= seq.num_output_tokens
    assert eng.block_manager.num_used_blocks == 0
    assert eng.slot_pool.num_in_use == 0
    eng.release_outputs()
    assert eng.pool.num_free == eng.pool.capacity
