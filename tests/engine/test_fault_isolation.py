"""One request's bad input never fails the batch (issue 21): a step that raises is rolled back,
its requests bisected, only the culprit ends (finish_reason "error") and every other request
emits exactly the tokens it emits without the culprit. The bad inputs are injected past
validation (a field changed on the request's own params after add_request, or an op patched to
raise for one request), so these tests hold for inputs validation does not know about."""

import gc
import weakref

import pytest

from specserve import InvalidRequestError, SamplingParams
from specserve.engine.isolation import EngineStepError
from tests.engine.conftest import make_llm, prompts_of

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "verify_budget": "off",
}
SELF_DRAFT = {
    "method": "draft_model",
    "num_speculative_tokens": 3,
    "model": "self",
    "verify_budget": "off",
}


def assert_idle(eng) -> None:
    assert not eng.requests and not eng.has_unfinished()
    assert eng.block_manager.num_used_blocks == 0  # invariant 5
    eng.release_outputs()
    assert eng.pool.num_free == eng.pool.capacity  # invariant 6
    if eng.slot_pool is not None:
        assert eng.slot_pool.num_in_use == 0  # invariant 4
    eng.check_invariants()


def run(eng, prompts, params, corrupt=None):
    """Run these requests to the end on the engine; corrupt(i, seq) may break request i's
    state after add_request. Returns [(token_ids, finish_reason, stop_reason)] per request."""
    seqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    for i, seq in enumerate(seqs):
        if corrupt is not None:
            corrupt(i, seq)
    toks = {s.request_id: [] for s in seqs}
    end = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.token_id >= 0:
                toks[out.request_id].append(out.token_id)
            if out.finished:
                end[out.request_id] = (out.finish_reason, out.stop_reason)
    assert_idle(eng)
    return [(toks[s.request_id], *end[s.request_id]) for s in seqs]


def reference(eng, prompts, params):
    return [r[0] for r in run(eng, prompts, params)]


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=seed, max_tokens=8, ignore_eos=True)


def huge_top_k(seq) -> None:
    seq.params.top_k = 2**31  # the int32 sampler table overflows (host side, at launch)


def stop_id_past_vocab(seq) -> None:
    # with min_tokens the sampler masks the stop ids: index out of range (device part)
    seq.params.stop_token_ids = [10**9]


@pytest.fixture(scope="module")
def sync_llm():
    return make_llm(max_num_seqs=8, debug_invariants=True)


@pytest.fixture(scope="module")
def overlap_llm():
    # CPU overlap: the forward and sampler run in the worker thread, one step ahead
    return make_llm(max_num_seqs=8, overlap=True, debug_invariants=True)


@pytest.mark.parametrize("which", ["sync", "overlap"])
@pytest.mark.parametrize("bad", ["top_k", "stop_token_ids"])
def test_a_bad_request_fails_alone(sync_llm, overlap_llm, which, bad):
    eng = (sync_llm if which == "sync" else overlap_llm).engine
    prompts = prompts_of([5, 9, 3, 12, 7], seed=3)
    good = [GREEDY, GREEDY, sampled(4), GREEDY]
    ref = reference(eng, prompts[:4], good)
    culprit = (
        sampled(5)
        if bad == "top_k"
        else SamplingParams(temperature=0, min_tokens=4, max_tokens=8, ignore_eos=False)
    )
    breaker = huge_top_k if bad == "top_k" else stop_id_past_vocab
    res = run(eng, prompts, good + [culprit], lambda i, s: i == 4 and breaker(s))
    assert [r[0] for r in res[:4]] == ref
    assert all(r[1] == "length" for r in res[:4])
    toks, reason, why = res[4]
    assert reason == "error" and toks == []
    assert ("overflow" in why) if bad == "top_k" else ("index" in why.lower())


def test_the_same_inputs_are_refused_at_entry_or_made_harmless(sync_llm):
    eng = sync_llm.engine
    vocab = eng.model_config.vocab_size
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request([5, 6], SamplingParams(stop_token_ids=[vocab], min_tokens=2))
    assert e.value.param == "stop_token_ids"
    assert not eng.requests
    # top_k past the vocabulary keeps every token (vLLM): the same tokens as top_k off
    prompts = prompts_of([6, 6], seed=9)
    ks = [SamplingParams(temperature=0.8, seed=7, max_tokens=6, top_k=k) for k in (0, 2**31)]
    ks.append(SamplingParams(temperature=0.8, seed=7, max_tokens=6, top_k=10**25))
    res = run(eng, [prompts[0]] * 3, ks)
    assert res[0][0] == res[1][0] == res[2][0] and len(res[0][0]) == 6


def test_several_culprits_in_one_step_are_all_found(sync_llm):
    eng = sync_llm.engine
    prompts = prompts_of([4, 8, 5, 6, 9, 3, 7, 5], seed=11)
    params = [GREEDY] * 8
    ref = reference(eng, prompts, params)
    bad = {1, 6}
    params = list(params)
    params[6] = SamplingParams(temperature=0, min_tokens=3, max_tokens=10)

    def corrupt(i, seq):
        if i == 1:
            seq.params.temperature = 0.7  # greedy rows never read top_k
            huge_top_k(seq)
        elif i == 6:
            stop_id_past_vocab(seq)

    res = run(eng, prompts, params, corrupt)
    for i, (toks, reason, _) in enumerate(res):
        if i in bad:
            assert reason == "error" and toks == []
        else:
            assert toks == ref[i] and reason == "length"


def test_a_request_that_fails_mid_run_keeps_its_emitted_tokens_and_the_others_continue(sync_llm):
    """The failure comes at the culprit's 4th token (an op patched to raise for it), after
    tokens were emitted and KV committed: the rollback undoes only the failed step."""
    eng = sync_llm.engine
    prompts = prompts_of([6, 10, 4], seed=21)
    ref = reference(eng, prompts, [GREEDY] * 3)
    real_plan = eng.sampler.plan
    victim = {}

    def plan(seqs, drafts, **kw):
        if any(s is victim.get("seq") and s.num_output_tokens >= 3 for s in seqs):
            raise RuntimeError("boom")
        return real_plan(seqs, drafts, **kw)

    eng.sampler.plan = plan
    try:
        res = run(eng, prompts, [GREEDY] * 3, lambda i, s: i == 1 and victim.update(seq=s))
    finally:
        del eng.sampler.plan
    assert res[0][0] == ref[0] and res[2][0] == ref[2]
    assert res[1][0] == ref[1][:3] and res[1][1] == "error" and "boom" in res[1][2]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failure_while_building_the_step_is_isolated(overlap):
    """An exception in input preparation (the runner, before any sampling) for one request."""
    llm = make_llm(max_num_seqs=8, overlap=overlap, debug_invariants=True)
    eng = llm.engine
    prompts = prompts_of([7, 3, 11, 5], seed=31)
    ref = reference(eng, prompts, [GREEDY] * 4)
    real_prepare = eng.runner.prepare
    bad = {}

    def prepare(batch):
        # the step that would emit its third token (under overlap, one token is in flight)
        if any(
            s is bad.get("seq") and s.num_output_tokens + s.num_pending >= 2 for s in batch.seqs
        ):
            raise ValueError("cannot build rows")
        return real_prepare(batch)

    eng.runner.prepare = prepare
    res = run(eng, prompts, [GREEDY] * 4, lambda i, s: i == 2 and bad.update(seq=s))
    assert [r[0] for i, r in enumerate(res) if i != 2] == [ref[0], ref[1], ref[3]]
    assert res[2][1] == "error" and res[2][0] == ref[2][:2]


@pytest.mark.parametrize("spec", [NGRAM, SELF_DRAFT], ids=["ngram", "draft_model"])
def test_isolation_with_speculation_keeps_greedy_outputs(sync_llm, spec):
    """Mid-run, after drafts were verified and the draft model's KV grown: the rolled-back
    step's drafts are verified again, and the others' outputs are unchanged."""
    eng = make_llm(max_num_seqs=8, speculative_config=spec, debug_invariants=True).engine
    base = prompts_of([6, 5, 7], seed=41)
    prompts = [p * 4 for p in base] + [base[0]]  # repeats: the n-gram drafter finds drafts
    ref = reference(sync_llm.engine, prompts[:3], [GREEDY] * 3)
    real_plan = eng.sampler.plan
    victim = {}

    def plan(seqs, drafts, **kw):
        if any(s is victim.get("seq") and s.num_output_tokens >= 4 for s in seqs):
            raise RuntimeError("late boom")
        return real_plan(seqs, drafts, **kw)

    eng.sampler.plan = plan
    res = run(eng, prompts, [GREEDY] * 4, lambda i, s: i == 3 and victim.update(seq=s))
    assert [r[0] for r in res[:3]] == ref
    assert res[3][1] == "error" and len(res[3][0]) >= 4
    assert eng.ledger.spec.num_draft_tokens > 0  # speculation did run


@pytest.mark.parametrize("which", ["sync", "overlap"])
def test_a_host_failure_in_the_ledger_ends_only_that_request(sync_llm, overlap_llm, which):
    eng = (sync_llm if which == "sync" else overlap_llm).engine
    assert eng.tokenizer is not None
    prompts = prompts_of([5, 8], seed=51)
    ref = reference(eng, prompts, [GREEDY] * 2)

    def break_detokenizer(i, seq):
        if i == 0:
            decoder = seq.detokenizer._decoder  # the window decoder every append feeds
            real = decoder.push

            def push(tok):
                if seq.num_output_tokens >= 4:
                    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")
                return real(tok)

            decoder.push = push

    res = run(eng, prompts, [GREEDY] * 2, break_detokenizer)
    assert res[1][0] == ref[1]
    # tokens 1-3 were emitted; the 4th step's token is dropped with the failure
    assert res[0][1] == "error" and res[0][0] == ref[0][:3]


def test_a_fault_no_request_explains_is_an_engine_error():
    llm = make_llm(max_num_seqs=8)
    eng = llm.engine

    def plan(seqs, drafts, **kw):
        raise RuntimeError("the sampler is broken")

    eng.sampler.plan = plan
    with pytest.raises(EngineStepError, match="each of its 3 requests fails alone"):
        llm.generate(prompts_of([4, 5, 6], seed=61), GREEDY, use_tqdm=False)
    llm._drain_terminal()  # generate aborted its requests; report them so the engine is idle
    assert_idle(eng)
    # alone, a request that fails is that request's failure, not the engine's
    out = llm.generate(prompts_of([4], seed=62), GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error"
    del eng.sampler.plan
    assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 10
    assert_idle(eng)


def test_an_abort_during_the_search_is_honoured(sync_llm):
    eng = sync_llm.engine
    prompts = prompts_of([5, 6, 7, 8], seed=71)
    seqs = [eng.add_request(p, GREEDY) for p in prompts[:3]]
    seqs.append(eng.add_request(prompts[3], sampled(1)))
    huge_top_k(seqs[3])
    ends = {}
    aborted = False
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                ends[out.request_id] = out.finish_reason
        if eng._isolation is not None and not aborted:
            aborted = eng.abort(seqs[0].request_id)
    assert aborted
    assert ends == {
        seqs[0].request_id: "abort",
        seqs[1].request_id: "length",
        seqs[2].request_id: "length",
        seqs[3].request_id: "error",
    }
    assert_idle(eng)


def test_refused_requests_are_not_kept(sync_llm):
    """Issue 22: the scheduler kept every prompt_length_exceeded request forever."""
    eng = sync_llm.engine
    seq = eng.add_request([5] * (eng.max_model_len + 1), GREEDY)
    assert seq.finish_reason.value == "prompt_length_exceeded"
    ref = weakref.ref(seq)
    del seq
    outs = []
    while eng.has_unfinished():
        outs += [(o.finished, o.finish_reason) for o in eng.step()]
    assert outs == [(True, "prompt_length_exceeded")]
    gc.collect()
    assert ref() is None
    assert_idle(eng)


def test_truncate_prompt_tokens_keeps_the_last_tokens(sync_llm):
    eng = sync_llm.engine
    prompt = prompts_of([20], seed=81)[0]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, truncate_prompt_tokens=6)
    seq = eng.add_request(prompt, sp)
    assert seq.prompt_token_ids == prompt[-6:]
    eng.abort(seq.request_id)
    while eng.has_unfinished():
        eng.step()
    short = run(eng, [prompt[-6:]], [GREEDY])[0][0][:5]
    assert run(eng, [prompt], [sp])[0][0] == short
    everything = SamplingParams(max_tokens=2, truncate_prompt_tokens=-1)
    assert eng.add_request(prompt, everything).prompt_token_ids == prompt
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request(prompt, SamplingParams(truncate_prompt_tokens=eng.max_model_len + 1))
    assert e.value.param == "truncate_prompt_tokens"
    while eng.has_unfinished():
        eng.step()
    assert_idle(eng)


def test_the_server_answers_only_the_failed_request_with_a_500():
    pytest.importorskip("fastapi")
    import asyncio
    import time

    from specserve.server.async_engine import AsyncEngine
    from specserve.server.errors import ServerError

    eng = make_llm(max_num_seqs=4).engine
    real_plan = eng.sampler.plan

    def plan(seqs, drafts, **kw):
        if any(s.request_id.startswith("bad") for s in seqs):
            raise RuntimeError("boom")
        return real_plan(seqs, drafts, **kw)

    eng.sampler.plan = plan
    client = AsyncEngine(eng)

    async def one(base):
        stream = await client.add(base, [[5, 6, 7]], [GREEDY], time.perf_counter())
        return [t.token_id async for u in stream.updates() for t in u.tokens if t.token_id >= 0]

    async def both():
        return await asyncio.gather(one("good"), one("bad"), return_exceptions=True)

    try:
        good, bad = asyncio.run(both())
        state = client.call_sync(client.idle_state, timeout=30)
    finally:
        client.shutdown()
    assert len(good) == 10
    assert isinstance(bad, ServerError) and bad.status == 500 and "boom" in bad.message
    assert state["used_blocks"] == 0 and state["live"] == 0


def test_offline_results_say_why_a_request_failed(sync_llm, monkeypatch):
    from specserve.runner import step_sampler

    real = step_sampler.build_inputs  # every step's sampler plan builds its inputs
    poisoned: set[str] = set()

    def build(seqs, drafts, device):
        if any(s.request_id in poisoned for s in seqs):
            raise IndexError("poisoned request")
        return real(seqs, drafts, device)

    monkeypatch.setattr(step_sampler, "build_inputs", build)
    engine_add = sync_llm.engine.add_request

    def add(prompt, params, *a, **kw):
        seq = engine_add(prompt, params, *a, **kw)
        if list(prompt)[:1] == [7]:
            poisoned.add(seq.request_id)
        return seq

    monkeypatch.setattr(sync_llm.engine, "add_request", add)
    outs = sync_llm.generate([[7, 8, 9], [3, 4, 5]], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "poisoned" in outs[0].error
    assert outs[1].outputs[0].finish_reason == "length" and outs[1].error is None


def test_a_request_failing_midway_keeps_the_text_of_its_tokens(sync_llm, monkeypatch):
    """generate decodes text once, at the end: a request that fails after emitting tokens
    still gets their text, as the stream would have given it."""
    from specserve.runner import step_sampler

    real = step_sampler.build_inputs

    def build(seqs, drafts, device):
        if any(s.prompt_token_ids[:1] == [7] and s.num_output_tokens >= 3 for s in seqs):
            raise IndexError("poisoned request")
        return real(seqs, drafts, device)

    monkeypatch.setattr(step_sampler, "build_inputs", build)
    # the tiny model's tokens are special ones: kept, so the text is not empty
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, skip_special_tokens=False)
    outs = sync_llm.generate([[7, 8, 9], [3, 4, 5]], sp, use_tqdm=False)
    failed = outs[0].outputs[0]
    assert failed.finish_reason == "error" and len(failed.token_ids) >= 3
    assert failed.text == sync_llm.engine.tokenizer.decode(failed.token_ids)
    assert outs[1].outputs[0].finish_reason == "length"


def test_a_device_drafters_rolled_back_step_leaves_its_kv_caught_up(sync_llm):
    """The target drafting for itself on the device (overlap): a step that fails after its
    forward is queued never drafts, so its requests catch up again when they next draft;
    every draft the survivors verify stays accepted (a draft from a stale KV or the pool's old
    drafts would be rejected) and their outputs are unchanged."""
    eng = make_llm(max_num_seqs=8, speculative_config=SELF_DRAFT, overlap=True).engine
    prompts = prompts_of([6, 5, 7, 9], seed=43)
    ref = reference(sync_llm.engine, prompts[:3], [GREEDY] * 3)
    real_plan = eng.sampler.plan
    victim, failed = {}, []

    def plan(seqs, drafts, **kw):
        if any(s is victim.get("seq") and s.num_output_tokens >= 4 for s in seqs):
            failed.append(len(seqs))
            raise RuntimeError("late boom")
        return real_plan(seqs, drafts, **kw)

    eng.sampler.plan = plan
    res = run(eng, prompts, [GREEDY] * 4, lambda i, s: i == 3 and victim.update(seq=s))
    assert [r[0] for r in res[:3]] == ref and res[3][1] == "error"
    assert max(failed) > 1  # the survivors were in a failed step
    spec = eng.ledger.spec
    assert spec.num_draft_tokens > 0
    assert spec.num_accepted_tokens == spec.num_draft_tokens
