"""Device drafters (n-gram, golden) with overlap: drafts written inside the step into the draft
slot pool, read there by the next step, which the host launched before seeing them. On CPU the
device work runs in the worker thread; the same code runs on CUDA (tests/gpu/test_overlap.py)."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve import SamplingParams, env
from specserve.speculative.verify_budget import EXPLORE_EVERY
from tests.engine.conftest import make_llm, prompts_of
from tests.speculative.conftest import curve_of

GOLD = [random.Random(0).randrange(3, 49000) for _ in range(40)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
GOLDEN = {"method": "golden", "num_speculative_tokens": 4, "acceptance_rate": 0.7}


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def _params(temperature: float, n: int) -> list[SamplingParams]:
    """Golden ids on every other request (teacher forcing: golden drafts get accepted), a stop
    token inside them, min_tokens, a stop string, seeds for the sampled runs."""
    out = []
    for i in range(n):
        out.append(
            SamplingParams(
                temperature=temperature,
                seed=i,
                max_tokens=25 + i,
                ignore_eos=i != 5,
                golden_token_ids=GOLD[: 10 + 5 * i] if i % 2 == 0 else None,
                min_tokens=3 if i == 3 else 0,
                stop_token_ids=[GOLD[20]] if i == 4 else None,
                stop=["e"] if i == 5 else None,
            )
        )
    return out


_PROMPTS = prompts_of([12, 30, 8, 5, 17, 9], seed=3) + [[101, 102, 103, 104] * 6]
_WANT: dict[float, list] = {}


def _want(temperature: float) -> list:
    if temperature not in _WANT:
        _WANT[temperature] = _run(make_llm(max_num_seqs=8), _PROMPTS, _params(temperature, 7))
    return _WANT[temperature]


@pytest.mark.parametrize("spec", [NGRAM, GOLDEN], ids=["ngram", "golden"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kv_gb", [None, 0.0001], ids=["roomy", "preempting"])
def test_outputs_are_those_of_speculation_off(spec, temperature, kv_gb):
    """Greedy: token for token. Sampled: one-hot drafters keep each request's own random
    stream (RNG counters corrected on the device for the rows the step in flight rejected),
    so seeded requests emit exactly what they emit with speculation off."""
    kw = {} if kv_gb is None else {"kv_cache_memory_gb": kv_gb}
    llm = make_llm(
        max_num_seqs=8, overlap=True, speculative_config=spec, debug_invariants=True, **kw
    )
    eng = llm.engine
    assert eng.device_drafting is not None and eng.overlap and eng.drafter is None
    preempted = []
    real = eng.scheduler._preempt
    eng.scheduler._preempt = lambda s: (preempted.append(s.request_id), real(s))
    assert _run(llm, _PROMPTS, _params(temperature, 7)) == _want(temperature)
    assert eng.num_sync_steps == 0  # every step launched behind the one in flight
    assert eng.ledger.spec.num_accepted_tokens > 0
    assert bool(preempted) == (kv_gb is not None)
    assert eng.block_manager.num_used_blocks == 0 and eng.slot_pool.num_in_use == 0


def test_device_golden_verifies_what_the_host_golden_drafter_verifies():
    """Same coins, same fixed k: the device drafter's drafts and acceptance are the host
    drafter's (synchronous) ones. max_tokens past the golden ids: near max_tokens the device
    path verifies fewer drafts (the room is priced as if the drafts in flight were accepted)."""
    prompts = prompts_of([5] * 6, seed=13)
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, golden_token_ids=GOLD)
    spec = GOLDEN | {"verify_budget": "off"}
    host = make_llm(speculative_config=spec)
    dev = make_llm(overlap=True, speculative_config=spec)
    assert host.engine.device_drafting is None and dev.engine.device_drafting is not None
    got = _run(dev, prompts, sp)
    assert got == _run(host, prompts, sp)
    assert all(o[:40] == GOLD for o, _, _ in got)
    assert dev.engine.ledger.spec == host.engine.ledger.spec  # drafts, accepted, per position
    assert dev.engine.ledger.spec.num_accepted_tokens > 0


def test_the_switch_keeps_drafting_on_the_host():
    with env.override(device_drafts=False):
        llm = make_llm(overlap=True, speculative_config=NGRAM)
    assert llm.engine.device_drafting is None and llm.engine.overlap_when_paused


def test_requests_that_read_their_tokens_on_the_host_verify_no_device_drafts():
    """Penalties (like bad words and grammars) read every token on the host: such a request
    gets no draft rows and its sampling waits for the ledger of the step in flight; the
    others keep speculating."""
    prompts = [[101, 102, 103, 104] * 6, [101, 102, 103, 104] * 6]
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
    ]
    want = _run(make_llm(max_num_seqs=4), prompts, params)
    llm = make_llm(max_num_seqs=4, overlap=True, speculative_config=NGRAM)
    seen = []
    real = llm.engine._launch

    def launch(batch, overlap):
        seen.append({s.request_id: nd for s, nd in zip(batch.seqs, batch.num_drafts)})
        return real(batch, overlap)

    llm.engine._launch = launch
    assert _run(llm, prompts, params) == want
    penalized = min(int(r) for step in seen for r in step)
    assert all(step.get(str(penalized), 0) == 0 for step in seen)
    assert any(nd for step in seen for r, nd in step.items() if int(r) != penalized)


def test_max_model_len_reached_with_drafts_in_flight():
    """Requests run into max_model_len while their drafts fly: the room is priced from the
    upper bound, nothing is emitted past the limit, outputs are those of speculation off."""
    prompts = prompts_of([20, 33, 7], seed=5) + [[101, 102, 103, 104] * 5]
    gold = GOLD + GOLD
    sp = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True, golden_token_ids=gold)
    want = _run(make_llm(max_num_seqs=4, max_model_len=48), prompts, sp)
    for spec in (NGRAM, GOLDEN):
        llm = make_llm(
            max_num_seqs=4,
            max_model_len=48,
            overlap=True,
            speculative_config=spec,
            debug_invariants=True,
        )
        assert _run(llm, prompts, sp) == want
    assert all(len(p) + len(o) == 48 and r == "length" for p, (o, _, r) in zip(prompts, want))


request = st.fixed_dictionaries(
    {
        "prompt_len": st.integers(1, 40),
        "max_tokens": st.integers(1, 30),
        "stop_tok": st.one_of(st.none(), st.integers(3, 60)),
        "golden": st.booleans(),
        "temperature": st.sampled_from([0.0, 1.0]),
        "arrive_at": st.integers(0, 6),
        "abort_at": st.one_of(st.none(), st.integers(0, 20)),
    }
)
_PROP: dict[str, object] = {}


_SELF_DRAFT = {"method": "draft_model", "model": "self", "num_speculative_tokens": 3}


@pytest.mark.parametrize("spec", [NGRAM, GOLDEN, _SELF_DRAFT], ids=["ngram", "golden", "draft"])
@settings(max_examples=15, deadline=None)
@given(st.lists(request, min_size=1, max_size=6), st.integers(0, 2**31))
def test_invariants_over_random_workloads(spec, reqs, seed):
    """Arrivals, aborts, stops inside accepted drafts (golden ids drawn from the stop range),
    preemption (13 KV blocks) and max_model_len, all with drafts in flight: debug invariants
    hold at every step, and each request's outputs are exactly the tokens appended to it. The
    draft model also switches between drafting and plain steps (a seeded coin for the
    budget's choice), catching up when it resumes."""
    from tests.speculative.drafting_spy import coin_drafting

    key = spec["method"]
    if key not in _PROP:
        _PROP[key] = make_llm(
            max_num_seqs=4,
            max_model_len=64,
            kv_cache_memory_gb=0.0001,
            overlap=True,
            speculative_config=spec,
            debug_invariants=True,
        )
        if key == "draft_model":
            coin_drafting(_PROP[key], seed=3)
    eng = _PROP[key].engine
    rng = random.Random(seed)
    seqs, emitted, finished = {}, {}, {}
    pending = sorted(reqs, key=lambda r: r["arrive_at"])
    tick = 0
    while pending or eng.has_unfinished():
        while pending and pending[0]["arrive_at"] <= tick:
            r = pending.pop(0)
            prompt = [rng.randrange(3, 60) for _ in range(r["prompt_len"])]
            gold = [rng.randrange(3, 60) for _ in range(40)] if r["golden"] else None
            sp = SamplingParams(
                temperature=r["temperature"],
                max_tokens=r["max_tokens"],
                stop_token_ids=[r["stop_tok"]] if r["stop_tok"] is not None else None,
                golden_token_ids=gold,
            )
            seq = eng.add_request(prompt, sp)
            seqs[seq.request_id] = (seq, r)
            emitted[seq.request_id] = []
        for rid, (_seq, r) in seqs.items():
            if r["abort_at"] == tick and rid not in finished:
                eng.abort(rid)
        for o in eng.step():
            assert o.request_id not in finished
            if o.token_id >= 0:
                emitted[o.request_id].append(o.token_id)
            if o.finished:
                finished[o.request_id] = o.finish_reason
        tick += 1
        assert tick < 2000
    assert set(finished) == set(seqs)
    for rid, (seq, r) in seqs.items():
        assert emitted[rid] == seq.output_token_ids
        assert seq.spec.num_accepted_tokens <= seq.num_output_tokens
        if r["stop_tok"] is not None and finished[rid] != "abort":
            assert r["stop_tok"] not in emitted[rid][:-1]
        assert seq.num_tokens <= 64
    assert eng.block_manager.num_used_blocks == 0 and eng.slot_pool.num_in_use == 0
    eng.release_outputs()
    assert eng.pool.num_free == eng.pool.capacity


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_device_draft_model(temperature):
    """The draft model ("self": the target drafting for itself) inside the step: greedy
    outputs of speculation off with every draft accepted, preemption on the way; sampled:
    rejection sampling against its q (test_lossless.py checks the distribution)."""
    spec = {"method": "draft_model", "model": "self", "num_speculative_tokens": 3}
    spec |= {"verify_budget": "off"}
    prompts = prompts_of([12, 30, 8, 5, 17], seed=4)
    sp = SamplingParams(temperature=temperature, seed=2, max_tokens=20, ignore_eos=True)
    llm = make_llm(
        max_num_seqs=8,
        overlap=True,
        speculative_config=spec,
        debug_invariants=True,
        kv_cache_memory_gb=0.0001,
    )
    eng = llm.engine
    assert eng.device_drafting is not None and eng.device_drafting.model_drafter is not None
    got = _run(llm, prompts, sp)
    assert eng.num_sync_steps == 0
    spec_counts = eng.ledger.spec
    if temperature == 0.0:
        assert got == _run(make_llm(max_num_seqs=8), prompts, sp)
        assert spec_counts.num_accepted_tokens == spec_counts.num_draft_tokens > 0
    else:
        # p and q differ only by rounding here, so a rejection's residual max(p - q, 0) is
        # rounding noise: compare with a rerun, not with the host drafter's batch shapes
        assert _run(llm, prompts, sp) == got
        assert spec_counts.num_accepted_tokens > 0
    assert eng.block_manager.num_used_blocks == 0 and eng.slot_pool.num_in_use == 0


def _draft_model_engine(tmp_path, draft: str, **kw) -> dict:
    """make_llm's arguments: the target drafting for itself ("self") or a 1-layer model."""
    from specserve.model.loader.dummy import PRESETS

    (tmp_path / "config.json").write_text(json.dumps(dict(PRESETS["tiny"], num_hidden_layers=1)))
    model = "self" if draft == "self" else f"dummy:{tmp_path}"
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    return (
        dict(max_num_seqs=8, overlap=True, speculative_config=spec | {"verify_budget": "off"}) | kw
    )


CATCH_UP_ROWS = 256


def _padded_draft_model(llm):
    """The draft model's chain and catch-ups padded to buckets, as on CUDA, captured on fake
    graphs."""
    from specserve.speculative.catch_up_graphs import CatchUpGraphs
    from specserve.speculative.draft_model_chain import DraftModelChain
    from tests.speculative.fake_graphs import FakeGraphs

    md = llm.engine.device_drafting.model_drafter
    md.chain = DraftModelChain(md._logits, md.pool, md.width, md.block_size, md.trash, True)
    md.catch_up = CatchUpGraphs(
        lambda *rows: (md._logits(*rows),), md.pool.num_slots, md.width,
        md.chain.max_context_len, md.device, max_rows=CATCH_UP_ROWS, padded=True,
    )  # fmt: skip
    fake = FakeGraphs()
    md.capture(fake)
    return md, fake


@pytest.mark.parametrize("draft,temperature", [("self", 0.0), ("other", 0.0), ("other", 1.0)])
def test_padded_replayed_draft_model_drafts_what_the_eager_path_drafts(
    tmp_path, draft, temperature
):
    """Draft-model drafting as the CUDA graphs run it (draft_model_chain.py: steady, the
    catch-up padded to k + 1 rows a request, then the chain; else the catch-up in its rows
    bucket, catch_up_graphs.py, then the chain), replayed on the CPU, drafts what the eager
    path drafts, to the token: the same outputs and the same draft and accept counts. The
    target drafting for itself must have every draft accepted (a wrong position or token
    anywhere would show as a rejection); another model gets some rejected."""
    from specserve.speculative.catch_up_graphs import catch_up_sizes
    from specserve.speculative.draft_graphs import _SHAPES, chain_buckets

    kw = _draft_model_engine(tmp_path, draft)
    eager, graphs = make_llm(**kw), make_llm(**kw)
    md, fake = _padded_draft_model(graphs)
    assert fake.captured == 2 * len(chain_buckets(8)) * len(_SHAPES) + len(
        catch_up_sizes(CATCH_UP_ROWS)
    )
    prompts = prompts_of([12, 30, 8, 5, 17, 9], seed=4)
    sp = SamplingParams(temperature=temperature, seed=2, max_tokens=24, ignore_eos=True)
    assert _run(graphs, prompts, sp) == _run(eager, prompts, sp)
    assert md.chain.num_steady > 0 and fake.replays >= md.chain.num_steady
    assert md.catch_up.num_replays > 0
    sa, sb = eager.engine.ledger.spec, graphs.engine.ledger.spec
    assert (sb.num_draft_tokens, sb.num_accepted_tokens) == (
        sa.num_draft_tokens,
        sa.num_accepted_tokens,
    )
    if draft == "self":
        assert sb.num_accepted_tokens == sb.num_draft_tokens > 0
    else:
        assert 0 < sb.num_accepted_tokens < sb.num_draft_tokens


@pytest.mark.parametrize("draft", ["self", "other"])
def test_steady_greedy_draft_model_steps_draft_in_the_graph_tail(tmp_path, draft):
    """runner/graph_tail.py: a steady greedy step writes the draft model's chain inputs inside
    the target's tail and replays the chain behind it; outputs and drafts accepted per position
    are the eager sampler's (the target drafting for itself has every draft accepted: a wrong
    position or token anywhere shows as a rejection)."""
    from tests.speculative.fake_graphs import on_buckets

    prompts = prompts_of([12, 30, 8, 5, 17, 9], seed=4)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = []
    for drafted in (False, True):
        llm = make_llm(**_draft_model_engine(tmp_path, draft), enforce_eager=True)
        _padded_draft_model(llm)
        on_buckets(llm, drafted)
        runs.append((_run(llm, prompts, sp), llm.engine.ledger.spec))
        g = llm.engine.runner.graphs
        assert (g.num_drafted_tail_runs > g.num_verify_replays / 2) == drafted
        assert g.num_mixed_runs > 0 and llm.engine.num_sync_steps == 0
    assert runs[0] == runs[1]
    spec = runs[1][1]
    if draft == "self":
        assert spec.num_accepted_tokens == spec.num_draft_tokens > 0
    else:
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def _budgeted(rate: float, cost, k: int = 4):
    """An overlapped golden engine whose verify budget prices a step of r rows at cost(r),
    real steps never correcting it (so what it chooses is what the curve says)."""
    spec = GOLDEN | {"acceptance_rate": rate, "num_speculative_tokens": k}
    llm = make_llm(max_num_seqs=4, overlap=True, speculative_config=spec, debug_invariants=True)
    budget = llm.engine.budget
    assert budget is not None and llm.engine.device_drafting is not None
    budget.curve = curve_of([int(b) for b in budget.curve.buckets], cost)
    budget.observe_step = lambda *step: None
    rows: list[tuple[int, int]] = []  # (decode requests, rows) of each decode-shaped step
    launch = llm.engine._launch

    def spy(batch, overlap):
        if batch.is_decode_shaped:
            rows.append((len(batch.seqs), batch.num_rows))
        return launch(batch, overlap)

    llm.engine._launch = spy
    return llm, rows


_BUDGET_PROMPTS = prompts_of([5] * 4, seed=13)
_BUDGET_SP = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, golden_token_ids=GOLD)


def test_the_budget_sizes_device_drafts_by_the_curve():
    """Draft rows that cost more than they can yield are laid out only by the budget's
    exploration (one request's drafts every EXPLORE_EVERY-th step): every other decode step is
    a plain step. Free rows are all taken. Outputs are those of speculation off either way."""
    want = _run(make_llm(max_num_seqs=4), _BUDGET_PROMPTS, _BUDGET_SP)
    dear, dear_rows = _budgeted(0.7, lambda r: 1.0 if r <= 4 else 100.0)
    assert _run(dear, _BUDGET_PROMPTS, _BUDGET_SP) == want
    explored = dear.engine.budget._calls // EXPLORE_EVERY
    assert dear.engine.ledger.spec.num_drafts <= explored
    assert sum(n != r for n, r in dear_rows) <= explored < len(dear_rows) // 4
    assert dear.engine.num_sync_steps == 0
    free, free_rows = _budgeted(0.7, lambda r: 1.0)
    assert _run(free, _BUDGET_PROMPTS, _BUDGET_SP) == want
    assert any(r == 5 * n for n, r in free_rows)  # every request its k = 4 drafts
    assert free.engine.ledger.spec.num_accepted_tokens > 0


def test_zero_confidence_gives_no_draft_rows_once_read_back():
    """Golden drafts that are always wrong come with confidence 0: after the first decode step
    of each request (verified at the prior, before any readback) no draft row is laid out."""
    want = _run(make_llm(max_num_seqs=4), _BUDGET_PROMPTS, _BUDGET_SP)
    llm, rows = _budgeted(0.0, lambda r: 1.0 + 0.01 * r)
    assert _run(llm, _BUDGET_PROMPTS, _BUDGET_SP) == want
    spec = llm.engine.ledger.spec
    assert spec.num_accepted_tokens == 0
    assert spec.num_draft_tokens <= len(_BUDGET_PROMPTS) * 4
    assert all(n == r for n, r in rows[2:])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_rows_by_their_true_output_index(temperature):
    """With drafts in flight the host knows each row's output index only from below: it lays
    out the mask for the lower bound and the device keeps the rows still under min_tokens. A
    stop list covering most of the vocabulary ends each request right at min_tokens."""
    prompts = [[101, 102, 103, 104] * 6, [7, 8, 9] * 5] + prompts_of([9], seed=2)
    sp = SamplingParams(
        temperature=temperature,
        seed=5,
        max_tokens=30,
        min_tokens=7,
        stop_token_ids=list(range(3, 40000)),
    )
    want = _run(make_llm(max_num_seqs=4), prompts, sp)
    for spec in (NGRAM, GOLDEN):
        llm = make_llm(max_num_seqs=4, overlap=True, speculative_config=spec)
        assert _run(llm, prompts, sp) == want
    assert all(len(o) >= 7 for o, _, _ in want)


@pytest.mark.parametrize("buckets", [False, True], ids=["eager", "graph-tail"])
def test_draft_model_drafting_resumes_where_its_kv_ends(tmp_path, target, buckets):
    """Steps that do not draft (a seeded coin for the budget's choice) are plain steps; when
    drafting resumes the draft model catches up from the length after the last step that
    drafted, its anchor in flight from next_tokens. Outputs are speculation off's and each
    drafting step drafts what a run drafting at every length (verifying none) drafts at the
    same request and length. graph-tail: on the bucket layout, steady steps drafting inside
    the target's graph tail, plain ones sampling in the plain tail (the drafts logged are the
    eager hook's only: outputs and accepts judge it). The target (the EAGLE-3 tests', whose
    outputs depend on their context) drafts for itself."""
    from tests.speculative.drafting_spy import coin_drafting, log_drafts
    from tests.speculative.fake_graphs import on_buckets

    prompts = prompts_of([12, 30, 8, 5, 17, 9], seed=4)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = _run(make_llm(model=target[0], max_num_seqs=8), prompts, sp)
    runs, logs, choices = [], [], []
    for every in (True, False):
        kw = _draft_model_engine(tmp_path, "self", enforce_eager=buckets, model=target[0])
        kw["speculative_config"] = kw["speculative_config"] | {"verify_budget": "auto"}
        llm = make_llm(**kw, debug_invariants=True)
        if buckets:
            _padded_draft_model(llm)
            on_buckets(llm, True)
        choices.append(coin_drafting(llm, seed=5, p=1.0 if every else 0.5, verify=not every))
        logs.append(log_drafts(llm))
        runs.append(_run(llm, prompts, sp))
        assert llm.engine.num_sync_steps == 0
    assert runs[0] == runs[1] == want
    assert all(choices[0]) and 0 < sum(choices[1]) < len(choices[1])
    assert llm.get_metrics()["spec_accepted_tokens"] > 0
    if buckets:
        g = llm.engine.runner.graphs
        assert g.num_drafted_tail_runs > 0 and g.num_tail_runs > g.num_drafted_tail_runs
        return
    assert logs[1].keys() <= logs[0].keys() and len(logs[1]) > 20
    assert all(logs[0][key] == logs[1][key] for key in logs[1])
