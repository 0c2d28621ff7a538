"""Overlap scheduling (ZOS) on CPU: the same pipeline as on the GPU (ledger one step late, anchor
tokens read from the device-resident next_tokens buffer), checked against the synchronous path.
On CPU the device work runs in the engine's worker thread. Steps whose sampling reads the tokens
of the step in flight on the host: test_deferred_sampling.py."""

import dataclasses

import pytest

from specserve import SamplingParams, env
from specserve.engine.sequence import FinishReason
from tests.engine.conftest import make_llm, prompts_of

_LLMS = {}


def _llm(overlap: bool, **kw):
    key = (overlap, tuple(sorted(kw.items())))
    if key not in _LLMS:
        _LLMS[key] = make_llm(max_num_seqs=8, overlap=overlap, debug_invariants=True, **kw)
    return _LLMS[key]


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            o.outputs[0].text,
            o.outputs[0].finish_reason,
            o.outputs[0].stop_reason,
            o.metrics.num_output_tokens,
        )
        for o in outs
    ]


def _record_launches(monkeypatch, eng, what) -> list:
    """Wrap the engine's _launch: each launched step appends what(batch, overlap) to the list."""
    seen = []
    real_launch = eng._launch

    def launch(batch, overlap):
        seen.append(what(batch, overlap))
        return real_launch(batch, overlap)

    monkeypatch.setattr(eng, "_launch", launch)
    return seen


def _mixed_params(n: int) -> list[SamplingParams]:
    eos_free = dict(ignore_eos=True)
    table = [
        SamplingParams(max_tokens=12, **eos_free),
        SamplingParams(temperature=1.0, seed=7, max_tokens=15, **eos_free),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=9),
        SamplingParams(max_tokens=20, stop_token_ids=list(range(3, 30000)), min_tokens=2),
        SamplingParams(max_tokens=14, stop=["e", "a"]),
        SamplingParams(max_tokens=10, logprobs=3, **eos_free),
        SamplingParams(temperature=1.0, seed=11, max_tokens=1, **eos_free),
    ]
    return [table[i % len(table)] for i in range(n)]


def test_overlap_outputs_identical_to_synchronous():
    prompts = prompts_of([5, 40, 17, 3, 60, 9, 28, 33, 12, 7, 50])
    params = _mixed_params(len(prompts))
    sync = _run(_llm(False), prompts, params)
    over = _run(_llm(True), prompts, params)
    assert over == sync
    # the stop-token request really stopped early, mid-flight (a row was already scheduled)
    assert sync[3][2] == "stop" and len(sync[3][0]) < 20


@pytest.mark.parametrize("overlap", [False, True])
def test_streamed_text_is_the_generated_text_and_usage_what_was_streamed(overlap):
    """Text of requests without stop strings is made after the stop decisions (the ledger's
    fill_text; under overlap after the next step's launch): streamed deltas still add up to
    the offline text, stop strings still cut exactly, usage counts what was streamed."""
    prompts = prompts_of([5, 40, 17, 3, 60, 9, 28, 33, 12, 7, 50], seed=5)
    # seeded: the two runs draw the same tokens (an unseeded request gets a fresh seed)
    params = [dataclasses.replace(sp, seed=sp.seed or i) for i, sp in enumerate(_mixed_params(11))]
    want = _run(_llm(False), prompts, params)
    llm = _llm(overlap)
    text: dict[str, list[str]] = {}
    ids: dict[str, list[int]] = {}
    last = {}
    for out in llm.stream(prompts, params):
        text.setdefault(out.request_id, []).append(out.text)
        ids.setdefault(out.request_id, []).append(out.token_id)
        assert out.num_output_tokens == len(ids[out.request_id])
        last[out.request_id] = out
    assert len(last) == len(prompts)
    for (w_ids, w_text, reason, stop_reason, usage), rid in zip(want, sorted(last, key=int)):
        assert ids[rid] == w_ids and "".join(text[rid]) == w_text
        assert (last[rid].finish_reason, last[rid].stop_reason) == (reason, stop_reason)
        assert last[rid].num_output_tokens == usage == len(w_ids)
    plain = [i for i, sp in enumerate(params) if not sp.stop]
    tok = llm.get_tokenizer()
    for i in plain:
        assert want[i][1] == tok.decode(want[i][0], skip_special_tokens=True)
    cut = [w for w, sp in zip(want, params) if sp.stop and w[2] == "stop"]
    assert cut and all(w[3] in ("e", "a") and not set(w[1]) & {"e", "a"} for w in cut)


def test_overlap_logprobs_match():
    prompts = prompts_of([8, 21])
    sp = SamplingParams(max_tokens=6, logprobs=2, ignore_eos=True)
    a = _llm(False).generate(prompts, sp, use_tqdm=False)
    b = _llm(True).generate(prompts, sp, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].logprobs == y.outputs[0].logprobs


def test_overlap_under_preemption_matches_synchronous():
    # 12 usable blocks of 16 tokens for 8 requests of ~40 tokens: preemption in flight
    kw = dict(kv_cache_memory_gb=13 * 8192 / 2**30, max_num_batched_tokens=32)
    prompts = prompts_of([20, 25, 18, 30, 22, 27, 19, 24], seed=5)
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    sync_llm, over_llm = _llm(False, **kw), _llm(True, **kw)
    sync = _run(sync_llm, prompts, sp)
    outs = over_llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [t[0] for t in sync]
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert over_llm.engine.block_manager.num_used_blocks == 0


def test_penalties_defer_their_sampling_and_match():
    prompts = prompts_of([6, 13, 9])
    params = [
        SamplingParams(max_tokens=10, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=2, frequency_penalty=0.5, max_tokens=8),
    ]
    assert _run(_llm(True), prompts, params) == _run(_llm(False), prompts, params)


def test_abort_while_in_flight_emits_nothing_more():
    eng = _llm(True).engine
    seq = eng.add_request(prompts_of([10])[0], SamplingParams(max_tokens=50, ignore_eos=True))
    other = eng.add_request(prompts_of([7])[0], SamplingParams(max_tokens=5, ignore_eos=True))
    emitted: dict[str, list[int]] = {seq.request_id: [], other.request_id: []}
    finished = {}
    for _ in range(4):
        for o in eng.step():
            emitted[o.request_id].append(o.token_id)
    assert eng._inflight is not None and seq.num_pending == 1  # its next token is in flight
    eng.abort(seq.request_id)
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id not in finished
            if o.token_id >= 0:
                emitted[o.request_id].append(o.token_id)
            if o.finished:
                finished[o.request_id] = o.finish_reason
    assert finished == {seq.request_id: "abort", other.request_id: "length"}
    assert emitted[seq.request_id] == seq.output_token_ids  # the in-flight token was dropped
    assert len(emitted[other.request_id]) == 5 == other.num_output_tokens
    assert seq.finish_reason is FinishReason.ABORT
    assert eng.block_manager.num_used_blocks == 0
    assert eng.slot_pool.num_in_use == 0


def test_flush_at_drain_keeps_the_final_token_and_max_tokens_needs_no_extra_row():
    eng = _llm(True).engine
    seq = eng.add_request(prompts_of([4])[0], SamplingParams(max_tokens=6, ignore_eos=True))
    rows = 0
    n = 0
    while eng.has_unfinished():
        before = eng.scheduler.step_id
        n += sum(o.token_id >= 0 for o in eng.step())
        if eng._inflight is not None and eng._inflight.batch.step == before + 1:
            rows += eng._inflight.batch.num_rows
    assert n == 6 == seq.num_output_tokens
    # 4 prompt rows + 5 decode rows: the 6th token ends at max_tokens, never fed back
    assert rows == 4 + 5


def test_no_step_is_launched_that_the_drafts_in_flight_would_discard():
    """Golden drafts all accepted (k = 4): a request makes 1 token in its prompt step, then 5 a
    step, so 11 and 21 tokens take 2 and 4 decode steps. Once the drafts in flight may end
    every request, the engine reads them back before launching another step (which they would
    discard whole): 5 steps in all, where launching ahead took 6. Outputs equal off's."""
    golden = {"method": "golden", "num_speculative_tokens": 4, "acceptance_rate": 1.0}
    llm = make_llm(
        max_num_seqs=4, overlap=True, speculative_config={**golden, "verify_budget": "off"}
    )
    prompts = prompts_of([7, 9], seed=5)
    gold = prompts_of([21, 21], seed=6)
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, golden_token_ids=g)
        for n, g in zip((11, 21), gold)
    ]
    before = llm.engine.num_steps
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.num_steps - before == 5 and llm.engine.num_sync_steps == 0
    assert [o.outputs[0].token_ids for o in outs] == [g[:n] for n, g in zip((11, 21), gold)]


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_flag_defaults(overlap):
    llm = _llm(overlap)
    assert llm.engine.overlap is overlap
    assert make_llm(max_num_seqs=2).engine.overlap is False  # CPU default: synchronous


NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
GOLDEN_DEVICE = {"method": "golden", "num_speculative_tokens": 4, "acceptance_rate": 0.8}


def make_host_drafting_llm(**kw):
    """The host-drafting path (the draft model's and EAGLE-3's: synchronous steps to draft,
    overlap while speculation pauses), driven by the n-gram and golden drafters on the host."""
    with env.override(device_drafts=False):
        return make_llm(**kw)


def test_steps_whose_drafts_the_budget_drops_run_overlapped_and_stay_lossless(monkeypatch):
    """With a host drafter, a step for which the verify budget plans no drafts runs overlapped
    (plain decoding); a step that verifies drafts runs synchronously. Greedy outputs equal the
    synchronous engine's and speculation off."""
    prompts = prompts_of([12, 30, 8, 21])
    prompts.append([101, 102, 103, 104] * 8)  # n-gram drafts from the start
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = _run(_llm(False), prompts, sp)
    llm = make_host_drafting_llm(
        max_num_seqs=8, overlap=True, speculative_config=NGRAM, debug_invariants=True
    )
    eng = llm.engine
    assert not eng.overlap and eng.overlap_when_paused
    calls = []

    def allot(surv, base_rows, room=None):  # the plan is "no drafts" except every third call
        calls.append(base_rows)
        return list(room) if len(calls) % 3 == 0 else [0] * len(room)

    monkeypatch.setattr(eng.budget, "allot", allot)
    kinds = _record_launches(monkeypatch, eng, lambda b, o: (o, sum(b.num_drafts)))
    assert _run(llm, prompts, sp) == want
    assert any(o for o, _ in kinds), "no step ran overlapped"
    assert any(nd > 0 for o, nd in kinds if not o), "no step verified drafts"
    assert all(nd == 0 for o, nd in kinds if o), "an overlapped step verified drafts"
    assert eng.block_manager.num_used_blocks == 0 and eng.slot_pool.num_in_use == 0


def test_steps_with_drafts_run_synchronously_and_only_they(monkeypatch):
    """Golden drafts exist at every decode step with room and the budget keeps them all: only
    steps without drafts (prefills, a request at its last token) may run overlapped."""
    golden = {"method": "golden", "num_speculative_tokens": 3, "acceptance_rate": 0.5}
    llm = make_host_drafting_llm(max_num_seqs=4, overlap=True, speculative_config=golden)
    eng = llm.engine
    monkeypatch.setattr(eng.budget, "allot", lambda surv, base_rows, room=None: list(room))
    kinds = _record_launches(monkeypatch, eng, lambda b, o: (o, sum(b.num_drafts)))
    for i, prompt in enumerate(prompts_of([9, 14, 6])):  # one request after another
        gold = [(31 * i + 7 * j) % 400 + 3 for j in range(12)]
        sp = SamplingParams(max_tokens=12, temperature=0.0, golden_token_ids=gold)
        out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == gold
    assert len(kinds) >= 9
    assert all(not overlapped for overlapped, drafts in kinds if drafts)
    # each request: its prefill and its last-token step carry no drafts; every other step does
    assert sum(1 for _, drafts in kinds if not drafts) <= 2 * 3


def test_steps_that_cannot_carry_drafts_run_overlapped_with_a_drafter(monkeypatch):
    """Only a step that verifies drafts needs the synchronous path: the prefill chunks ahead of
    the first decode step (no request can draft yet) run overlapped, as do the steps whose
    drafting round planned nothing. Outputs stay lossless."""
    prompts = prompts_of([70, 90, 50])
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = _run(_llm(False), prompts, sp)
    llm = make_host_drafting_llm(
        max_num_seqs=8, overlap=True, speculative_config=NGRAM, max_num_batched_tokens=32
    )
    eng = llm.engine
    monkeypatch.setattr(eng.budget, "allot", lambda surv, base_rows, room=None: [0] * len(room))
    kinds = _record_launches(monkeypatch, eng, lambda b, o: (o, sum(b.samples)))
    assert _run(llm, prompts, sp) == want
    assert kinds[0] == (True, 0), "the first prefill chunk ran synchronously"
    # the first request completes its prompt in the third chunk (70 = 32 + 32 + 6): the steps
    # after it flush to draft; with no drafts planned they run overlapped all the same
    assert all(overlapped for overlapped, _ in kinds)
    assert eng.num_sync_steps == 0


def test_fixed_k_overlaps_the_steps_without_drafts_and_matches_the_synchronous_engine():
    """verify_budget "off" (fixed k) with overlap: steps where no request has an
    n-gram draft run overlapped, steps with drafts synchronously; greedy outputs are the
    synchronous engine's (tests/gpu/test_cuda_graph.py runs this configuration on CUDA)."""
    prompts = prompts_of([12, 30, 8])
    prompts.append([101, 102, 103, 104] * 8)  # n-gram drafts from the start
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    spec = NGRAM | {"verify_budget": "off"}
    want = _run(make_host_drafting_llm(max_num_seqs=8, speculative_config=spec), prompts, sp)
    llm = make_host_drafting_llm(
        max_num_seqs=8, overlap=True, speculative_config=spec, debug_invariants=True
    )
    eng = llm.engine
    assert eng.budget is None and eng.overlap_when_paused
    assert _run(llm, prompts, sp) == want
    assert 0 < eng.num_sync_steps < eng.num_steps
    assert eng.block_manager.num_used_blocks == 0 and eng.slot_pool.num_in_use == 0


def test_a_flush_for_penalties_with_drafts_kept_runs_the_step_synchronously(monkeypatch):
    """With a host drafter a decode step reads the one in flight first, to draft; when that
    drafting keeps drafts for a penalized request's batch, the step that verifies them must
    not be launched overlapped."""
    prompts = prompts_of([12, 20]) + [[101, 102, 103, 104] * 8]
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, repetition_penalty=1.2),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
    ]
    want = _run(_llm(False), prompts, params)
    llm = make_host_drafting_llm(
        max_num_seqs=8, overlap=True, speculative_config=NGRAM, debug_invariants=True
    )
    eng = llm.engine
    calls = []

    def allot(surv, base_rows, room=None):  # no drafts, then all the room, in turns
        calls.append(1)
        return list(room) if len(calls) % 2 == 0 else [0] * len(room)

    monkeypatch.setattr(eng.budget, "allot", allot)
    kinds = _record_launches(monkeypatch, eng, lambda b, o: (o, sum(b.num_drafts)))
    assert _run(llm, prompts, params) == want
    assert any(d for _, d in kinds), "no step verified drafts"
    assert any(o for o, _ in kinds), "no step ran overlapped"


@pytest.mark.parametrize("overlap", [False, True])
def test_only_decode_shaped_steps_price_the_step_cost_curve(overlap):
    """A step that completes a prompt samples too, but its chunk's rows are not decode rows:
    folded into the curve, a first prefill (eager, compiling kernels: 2.5 s on the H200 where a
    decode step takes 6 ms) priced every bucket near it far too high. Only steps whose every
    request feeds its anchor row and drafts are observed, with those rows and the time since
    the previous readback (a whole period: device time and the host work not hidden)."""
    prompts = prompts_of([12, 30, 8, 21])
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = make_host_drafting_llm(max_num_seqs=8, overlap=overlap, speculative_config=NGRAM)
    eng = llm.engine
    shapes = []
    real_launch = eng._launch

    def launch(batch, ov):
        shapes.append((batch.num_rows, len(batch.seqs), sum(batch.num_drafts)))
        return real_launch(batch, ov)

    eng._launch = launch
    recorded = []
    real = eng.budget.observe_step
    eng.budget.observe_step = lambda rows, secs, *kind: (
        recorded.append((rows, secs)) or real(rows, secs, *kind)
    )
    _run(llm, prompts, sp)
    assert recorded and all(secs > 0 for _, secs in recorded)
    decode_rows = {rows for rows, n, drafts in shapes if rows == n + drafts}
    assert all(rows in decode_rows for rows, _ in recorded)
    assert max(rows for rows, _ in recorded) < 30  # never the 30-token prompt's step
    assert any(eng.budget.curve.observed(rows) for rows, _ in recorded)


def test_idle_time_between_runs_is_no_step_s_cost():
    """A step costs the time since the previous readback, but not across an idle engine: the
    caller's pause between two runs must not price the next run's first step."""
    import time

    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = make_llm(max_num_seqs=8, speculative_config=NGRAM)
    eng = llm.engine
    seen = []
    real = eng.budget.observe_step
    eng.budget.observe_step = lambda rows, secs, *kind: seen.append(secs) or real(rows, secs, *kind)
    llm.generate(prompts_of([12, 30]), sp, use_tqdm=False)
    n = len(seen)
    time.sleep(0.5)
    llm.generate([[7]], sp, use_tqdm=False)  # one prompt token: its first step is decode-shaped
    assert n and len(seen) > n and max(seen) < 0.5


def test_a_step_left_in_flight_across_an_idle_pause_is_no_step_s_cost():
    """A caller that stops stepping once every request has finished (a closed loop) leaves the
    last overlapped step in flight; the next run reads it back after the pause. That readback's
    period is the caller's pause, not a step's cost: it must not price its bucket (it did, at
    ~0.47 s, in the GPU sweeps, where the other engines ran during the pause)."""
    import time

    gold = prompts_of([40], seed=5)[0]  # drafts the device may accept (or not) up to the end
    # the stop token ends them where the host cannot foresee it. max_tokens it can (no step is
    # launched that the drafts in flight would end), so it lies past any drafts in flight when
    # the stop comes (the 9th token; k = 4): how many the budget keeps depends on its timings
    assert gold[8] not in gold[:8]
    sp = SamplingParams(
        max_tokens=30, temperature=0.0, golden_token_ids=gold, stop_token_ids=[gold[8]]
    )
    llm = make_llm(max_num_seqs=8, overlap=True, speculative_config=GOLDEN_DEVICE)
    eng = llm.engine
    seen = []
    real = eng.budget.observe_step
    eng.budget.observe_step = lambda rows, secs, *kind: seen.append(secs) or real(rows, secs, *kind)
    left_in_flight = 0
    for _ in range(3):
        ids = {eng.add_request(p, sp).request_id for p in prompts_of([12, 7, 9])}
        while ids:  # until every request has finished, then no further step()
            ids -= {o.request_id for o in eng.step() if o.finished}
        left_in_flight += eng._inflight is not None
        time.sleep(0.4)
    assert left_in_flight  # else this test tests nothing
    assert seen and max(seen) < 0.4


def test_a_prompt_step_s_launch_is_no_cost_of_the_step_in_flight():
    """Overlap: step N's readback period holds the launch of step N + 1. A prompt step's launch
    (or a model drafter's switch back to drafting, its gap catch-up) is one-off host work;
    priced, it makes the step before it look several times dearer than it is. The step in
    flight behind which such a step was launched does not price the curve."""
    import time

    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = make_llm(max_num_seqs=8, overlap=True, speculative_config=GOLDEN_DEVICE)
    eng = llm.engine
    seen = []
    real = eng.budget.observe_step
    eng.budget.observe_step = lambda rows, secs, *kind: seen.append(secs) or real(rows, secs, *kind)
    real_launch, slow = eng._launch, []

    def launch(batch, overlap):
        if not batch.is_decode_shaped and eng._inflight is not None:
            slow.append(batch.step)
            time.sleep(0.3)
        return real_launch(batch, overlap)

    eng._launch = launch
    for p in prompts_of([12, 7, 9, 15]):  # one admitted every few steps, behind decode steps
        eng.add_request(p, sp)
        for _ in range(4):
            eng.step()
    while eng.has_unfinished():
        eng.step()
    assert slow and seen  # else this test tests nothing
    assert max(seen) < 0.3


def test_no_overlap_flag_keeps_speculation_synchronous():
    llm = make_host_drafting_llm(max_num_seqs=2, overlap=False, speculative_config=NGRAM)
    assert not llm.engine.overlap and not llm.engine.overlap_when_paused


def test_a_step_whose_processing_failed_is_not_processed_again(monkeypatch):
    """Overlap: if reading back / processing the step in flight raises, that step is dropped (the
    server then fails its requests); the next step() does not hit the same error again."""
    eng = make_llm(max_num_seqs=4, overlap=True).engine
    eng.add_request(prompts_of([6])[0], SamplingParams(max_tokens=8, ignore_eos=True))
    eng.step()
    real = eng.ledger.process_outputs
    bad = []

    def fail_on_one_step(batch, *rest):  # a step whose results can never be processed
        if not bad:
            bad.append(batch)
        if batch is bad[0]:
            raise RuntimeError("injected")
        return real(batch, *rest)

    monkeypatch.setattr(eng.ledger, "process_outputs", fail_on_one_step)
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    for s in list(eng.scheduler.running):  # what the server's recovery does: fail the batch
        eng.abort(s.request_id)
    seq = eng.add_request(prompts_of([5])[0], SamplingParams(max_tokens=4, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert seq.num_output_tokens == 4
    assert eng.block_manager.num_used_blocks == 0 and eng.slot_pool.num_in_use == 0
