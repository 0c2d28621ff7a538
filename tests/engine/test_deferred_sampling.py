"""Deferred sampling under overlap (step_launch.py): a step whose requests read their output
tokens on the host (grammars, penalties, bad words) is launched behind the step in flight, its
sampling planned after that step's ledger. Checked against the synchronous engine on CPU, where
the device work runs in the worker thread: same tokens (greedy and seeded), valid grammar
outputs, requests that end while their next row is queued, aborts, failures rolled back."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest

from specserve import SamplingParams
from tests.engine.conftest import make_llm, prompts_of

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "s": {"enum": ["x", "y"]},
    },
    "required": ["n", "s"],
    "additionalProperties": False,
}
REGEX = "[a-z]{2,5}-[0-9]{2}"
CHOICES = ["alpha", "beta gamma", "delta"]
_LLMS: dict = {}


def _llm(overlap: bool, **kw):
    key = (overlap, tuple(sorted(kw.items())))
    if key not in _LLMS:
        _LLMS[key] = make_llm(max_num_seqs=8, overlap=overlap, debug_invariants=True, **kw)
    return _LLMS[key]


def _workload(temperature: float) -> tuple[list, list[SamplingParams]]:
    """Grammar, penalty, bad-words and plain requests; some end by content (grammar complete,
    stop string, stop token id) while their next row is already queued, some by length."""

    def sp(i: int, **kw) -> SamplingParams:
        return SamplingParams(temperature=temperature, seed=100 + i, **kw)

    json_so = {"json": SCHEMA, "disable_any_whitespace": True}
    params = [
        sp(0, max_tokens=40, structured_outputs=json_so),
        sp(1, max_tokens=30, structured_outputs={"regex": REGEX}),
        sp(2, max_tokens=30, structured_outputs={"choice": CHOICES}, ignore_eos=True),
        sp(3, max_tokens=12, ignore_eos=True),
        sp(4, max_tokens=14, repetition_penalty=1.3, frequency_penalty=0.4, ignore_eos=True),
        sp(5, max_tokens=20, presence_penalty=0.8, stop=["e", "a"]),
        sp(6, max_tokens=16, bad_words=["the", " the", "a"], ignore_eos=True),
        sp(7, max_tokens=20, repetition_penalty=1.2, stop_token_ids=list(range(3, 30000))),
        sp(8, max_tokens=10, logprobs=2, ignore_eos=True),
        sp(9, max_tokens=5, structured_outputs=json_so),  # cut by max_tokens mid-object
        sp(10, max_tokens=18, frequency_penalty=0.5, min_tokens=4, ignore_eos=True),
        sp(11, max_tokens=25, structured_outputs={"choice": CHOICES}),
    ]
    prompts = ["Reply with JSON:", "Code:", "Pick one:"] + prompts_of([5, 40, 17, 3, 60, 9])
    prompts += ["JSON please", *prompts_of([28], seed=3), "Choose:"]
    return prompts, params


def _record(monkeypatch, eng) -> list:
    """Per step(): [a step was in flight at entry, the step it launched (or None)]."""
    steps: list = []
    real_step, real_launch = eng._step, eng._launch

    def step():
        steps.append([eng._inflight is not None, None])
        return real_step()

    def launch(batch, overlap):
        steps[-1][1] = launched = real_launch(batch, overlap)
        return launched

    monkeypatch.setattr(eng, "_step", step)
    monkeypatch.setattr(eng, "_launch", launch)
    return steps


def _run(llm, prompts, params) -> list[tuple]:
    return _results(llm.generate(prompts, params, use_tqdm=False))


def _results(outs) -> list[tuple]:
    return [
        (
            o.outputs[0].token_ids,
            o.outputs[0].text,
            o.outputs[0].finish_reason,
            o.outputs[0].stop_reason,
            o.metrics.num_output_tokens,
            o.outputs[0].logprobs,
        )
        for o in outs
    ]


def _close_logprobs(a, b, tol: float = 1e-5) -> None:
    assert (a is None) == (b is None)
    for pa, pb in zip(a or [], b or []):
        assert pa.keys() == pb.keys()
        for tok in pa:
            assert abs(pa[tok].logprob - pb[tok].logprob) <= tol, (tok, pa[tok], pb[tok])
    assert len(a or []) == len(b or [])


def _check_grammars(params: list[SamplingParams], res: list[tuple]) -> None:
    for sp, (_ids, text, reason, *_rest) in zip(params, res):
        so = sp.structured_outputs
        if so is None or reason != "stop":
            continue
        if so.json is not None:
            jsonschema.validate(json.loads(text), SCHEMA)
        elif so.regex is not None:
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in CHOICES, text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_host_token_requests_overlap_and_match_the_synchronous_engine(monkeypatch, temperature):
    prompts, params = _workload(temperature)
    chunked = dict(max_num_batched_tokens=48)  # prompt chunks ride along in deferred steps
    want = _run(_llm(False, **chunked), prompts, params)
    llm = _llm(True, **chunked)
    eng = llm.engine
    deferred0 = eng.num_deferred_steps
    steps = _record(monkeypatch, eng)
    sampled_rows: dict[str, int] = {}
    real_launch = eng._launch

    def count_rows(batch, overlap):
        for s, sm in zip(batch.seqs, batch.samples):
            sampled_rows[s.request_id] = sampled_rows.get(s.request_id, 0) + sm
        return real_launch(batch, overlap)

    monkeypatch.setattr(eng, "_launch", count_rows)
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = _results(outs)
    assert [r[:5] for r in got] == [r[:5] for r in want]
    # logprobs to 1e-5: on the CPU a row's logits depend on its batch's shape in the last bits
    # (GEMM row count, padded attention length), and the overlapped engine still schedules a row
    # for a request whose stop is in flight
    for a, b in zip(got, want):
        _close_logprobs(a[5], b[5])
    _check_grammars(params, got)
    assert all(len(r[0]) == r[4] for r in got)  # usage == tokens streamed
    # no step waited for the one in flight before launching (before: every step with such a
    # request read it back first, leaving the device idle meanwhile)
    assert eng.num_deferred_steps > deferred0
    assert eng.num_sync_steps == 0
    assert all(launched.behind for in_flight, launched in steps if in_flight and launched)
    # a request that ended by content in step N had a row in step N+1 (discarded, nothing
    # emitted from it); one ended by max_tokens had none
    ended_by_content = 0
    for o, r in zip(outs, got):
        rows = sampled_rows[o.request_id]
        if r[2] == "stop":
            ended_by_content += 1
            assert rows == len(r[0]) + 1, (o.request_id, rows, r)
        else:
            assert rows == len(r[0]), (o.request_id, rows, r)
    assert ended_by_content >= 3
    assert eng.block_manager.num_used_blocks == 0 and eng.slot_pool.num_in_use == 0


def test_aborts_while_deferred_steps_fly_emit_nothing_more():
    eng = _llm(True).engine
    prompts, params = _workload(0.0)
    seqs = [eng.add_request(p, sp) for p, sp in zip(prompts[:8], params[:8])]
    emitted: dict[str, list[int]] = {s.request_id: [] for s in seqs}
    finished: dict[str, str] = {}
    victims = [seqs[0], seqs[4], seqs[6]]  # a grammar, penalties, bad words
    for n in range(200):
        if n == 3:
            assert all(v.num_pending == 1 for v in victims)  # their next tokens are in flight
            for v in victims:
                assert eng.abort(v.request_id)
        for o in eng.step():
            assert o.request_id not in finished
            if o.token_id >= 0:
                emitted[o.request_id].append(o.token_id)
                assert o.num_output_tokens == len(emitted[o.request_id])
            if o.finished:
                finished[o.request_id] = o.finish_reason
        if not eng.has_unfinished():
            break
    assert not eng.has_unfinished()
    assert all(finished[v.request_id] == "abort" for v in victims)
    for s in seqs:
        assert emitted[s.request_id] == s.output_token_ids  # the in-flight tokens were dropped
    assert eng.block_manager.num_used_blocks == 0 and eng.slot_pool.num_in_use == 0
    eng.release_outputs()
    assert eng.pool.num_free == eng.pool.capacity


def _fail_plan_of(eng, marker: int, after: int, where: list) -> None:
    """The request whose params carry seed=marker fails to plan once it has `after` tokens, in
    a deferred plan (StepSampler.complete) and a whole one alike; where: which of them raised."""
    real_tokens, real_complete = eng.sampler._host_tokens, eng.sampler.complete
    state = {"deferred": False}

    def host_tokens(seqs, drafts):
        if any(s.params.seed == marker and s.num_output_tokens >= after for s in seqs):
            where.append("deferred" if state["deferred"] else "whole")
            raise ValueError("injected plan failure")
        return real_tokens(seqs, drafts)

    def complete(plan, seqs, drafts):
        state["deferred"] = True
        try:
            return real_complete(plan, seqs, drafts)
        finally:
            state["deferred"] = False

    eng.sampler._host_tokens = host_tokens
    eng.sampler.complete = complete


def test_a_deferred_plan_that_fails_ends_only_its_request():
    """A failure while planning a deferred step rolls that step back (its forward already
    ran) and the search finds the request, as for any step: it ends with "error" after the
    same tokens as on the synchronous engine, and every other request is unchanged."""
    prompts, params = _workload(1.0)
    marker = params[4].seed  # the penalized request
    results, where = {}, {}
    for overlap in (False, True):
        llm = make_llm(max_num_seqs=8, overlap=overlap, debug_invariants=True)
        where[overlap] = []
        _fail_plan_of(llm.engine, marker, 5, where[overlap])
        results[overlap] = _run(llm, prompts, params)
        assert llm.engine.block_manager.num_used_blocks == 0
    # logprobs left out: the search's smaller batches may round a last bit differently
    assert [r[:5] for r in results[True]] == [r[:5] for r in results[False]]
    culprit = results[True][4]
    assert culprit[2] == "error" and len(culprit[0]) == 5 and "injected" in culprit[3]
    assert where[True][0] == "deferred" and where[False][0] == "whole"


def test_a_failed_readback_rolls_back_the_deferred_step_behind_it(monkeypatch):
    """The step in flight fails at its readback while the step behind it waits for its ledger:
    both are rolled back (the deferred one counted no pending tokens yet), the failed one's
    requests are searched, nobody is to blame, and every output is the synchronous one."""
    prompts, params = _workload(1.0)
    want = _run(_llm(False), prompts, params)
    llm = make_llm(max_num_seqs=8, overlap=True, debug_invariants=True)
    eng = llm.engine
    real_read = eng._read
    failed = []

    def read(launched):
        newer = eng._inflight
        if not failed and newer is not None and newer.deferred is not None and eng.num_steps > 6:
            failed.append(launched.batch.step)
            raise RuntimeError("injected readback failure")
        return real_read(launched)

    monkeypatch.setattr(eng, "_read", read)
    got = _run(llm, prompts, params)
    # logprobs left out: the search's smaller batches may round a last bit differently
    assert [r[:5] for r in got] == [r[:5] for r in want]
    assert failed and eng.num_sync_steps > 0  # the search's steps ran alone, synchronously
    assert eng.block_manager.num_used_blocks == 0 and eng.slot_pool.num_in_use == 0


def test_a_ledger_failure_drops_the_deferred_step_behind_it(monkeypatch):
    """An engine fault in the ledger propagates (the caller fails the batch); the deferred
    step behind it is undone rather than planned from a half-run ledger, and the engine runs
    new requests cleanly after."""
    llm = make_llm(max_num_seqs=8, overlap=True, debug_invariants=True)
    eng = llm.engine
    prompts, params = _workload(0.0)
    for p, sp in zip(prompts[:4], params[:4]):
        eng.add_request(p, sp)
    real = eng.ledger.process_outputs
    while not (eng._inflight is not None and eng.num_deferred_steps >= 2):
        eng.step()

    def fail(*args, **kw):
        raise RuntimeError("injected ledger fault")

    monkeypatch.setattr(eng.ledger, "process_outputs", fail)
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    assert eng._inflight is None  # the deferred step was dropped, not left half-launched
    monkeypatch.setattr(eng.ledger, "process_outputs", real)
    eng.fail_all()  # what the server's recovery does
    while eng.has_unfinished():
        eng.step()
    assert eng.block_manager.num_used_blocks == 0 and eng.slot_pool.num_in_use == 0
    assert _run(llm, prompts[:2], params[:2]) == _run(_llm(False), prompts[:2], params[:2])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_device_drafts_and_deferred_sampling_in_one_step(temperature):
    """A device drafter (golden: its drafts get accepted at any temperature): the plain
    requests verify drafts whose rows the device shifts by the step in flight's rejections, the
    host-token requests verify none and have their sampling deferred, in the same steps. The
    plan read at launch keeps the shifted requests' RNG counters exact: tokens equal
    speculation off on the synchronous engine."""
    prompts, params = _workload(temperature)
    gold = prompts_of([40], seed=9)[0]
    for i in (3, 8):
        params[i] = dataclasses.replace(params[i], golden_token_ids=gold)
    want = _run(_llm(False), prompts, params)
    spec = {"method": "golden", "num_speculative_tokens": 3, "acceptance_rate": 0.7}
    llm = make_llm(max_num_seqs=8, overlap=True, speculative_config=spec, debug_invariants=True)
    eng = llm.engine
    assert eng.device_drafting is not None
    both = []  # deferred steps with rows shifted behind drafts in flight
    real_launch = eng._launch

    def launch(batch, overlap):
        launched = real_launch(batch, overlap)
        both.append(launched.deferred is not None and any(batch.shifts))
        return launched

    eng._launch = launch
    got = _run(llm, prompts, params)
    # logprobs left out: verify rows batch the logits differently
    assert [r[:5] for r in got] == [r[:5] for r in want]
    assert any(both) and eng.num_sync_steps == 0
    assert eng.ledger.spec.num_accepted_tokens > 0
    assert eng.block_manager.num_used_blocks == 0 and eng.slot_pool.num_in_use == 0


def test_preemption_under_deferred_steps_matches():
    """KV for a few requests only: requests are preempted while their step flies (a deferred
    one included) and recomputed; tokens equal the synchronous engine's."""
    prompts, params = _workload(1.0)
    kw = dict(kv_cache_memory_gb=13 * 8192 / 2**30, max_num_batched_tokens=32)
    want = _run(_llm(False, **kw), prompts, params)
    llm = _llm(True, **kw)
    eng = llm.engine
    preempted = []
    real = eng.scheduler._preempt
    eng.scheduler._preempt = lambda s: (preempted.append(s.request_id), real(s))
    got = _run(llm, prompts, params)
    assert [r[:5] for r in got] == [r[:5] for r in want]
    _check_grammars(params, got)
    assert preempted and eng.num_deferred_steps > 0
    assert eng.block_manager.num_used_blocks == 0 and eng.slot_pool.num_in_use == 0


def test_a_request_its_grammar_ended_gets_no_plan_in_the_step_behind():
    """A request whose grammar completes in step N still has a row in step N+1, planned after
    N's ledger: nothing is built for it there. Here its allowed ids fit no row of the complete
    grammar (only EOS may follow): checked, they would fail the step for everyone."""
    llm = _llm(True)
    eng = llm.engine
    sp = SamplingParams(
        max_tokens=10,
        temperature=0.0,
        structured_outputs={"choice": ["alpha"]},
        allowed_token_ids=eng.tokenizer.encode("alpha"),
    )
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = _run(_llm(False), ["Pick:", "hello"], [sp, plain])
    sync0, deferred0 = eng.num_sync_steps, eng.num_deferred_steps
    got = _run(llm, ["Pick:", "hello"], [sp, plain])
    assert got == want and got[0][1:3] == ("alpha", "stop")
    assert eng.num_deferred_steps > deferred0
    assert eng.num_sync_steps == sync0  # no step failed (a search runs synchronous steps)
