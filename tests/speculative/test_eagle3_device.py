"""EAGLE-3 drafting inside the step (eagle3_device.py, with overlap): greedy outputs equal
speculation off, sampled runs repeat themselves, the drafts are the host drafter's, and the
graphs' padded bodies replayed on the CPU draft what the eager chain drafts."""

from __future__ import annotations

import pytest

from specserve import SamplingParams
from specserve.speculative.catch_up_graphs import CatchUpGraphs, catch_up_sizes
from specserve.speculative.draft_graphs import _SHAPES, chain_buckets
from specserve.speculative.eagle3_chain import Eagle3Chain
from specserve.speculative.step_cost import SWEEP_REPS
from specserve.speculative.verify_budget import EXPLORE_EVERY
from tests.engine.conftest import make_llm
from tests.speculative.drafting_spy import coin_drafting, log_drafts
from tests.speculative.eagle3_heads import _ids, _spec
from tests.speculative.fake_graphs import FakeGraphs, on_buckets


@pytest.mark.parametrize("head", ["copy", "random"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_device_eagle3_drafts_inside_the_step(target, prompts, ref, heads, head, temperature):
    """With overlap the head drafts inside the step (eagle3_device.py): every step launched
    behind the one in flight, drafts accepted, preemption on the way. Greedy: the outputs of
    speculation off; sampled: rejection sampling against the head's q, seeded, so the run
    repeats itself (a flat random target accepts next to nothing there; test_lossless.py
    checks the distribution, absent drafts included)."""
    llm = make_llm(
        model=target[0],
        speculative_config=_spec(heads[head], k=3, verify_budget="off"),
        kv_cache_memory_gb=10 * 16384 / 2**30,
        max_num_batched_tokens=48,
        max_num_seqs=8,
        overlap=True,
        debug_invariants=True,
    )
    eng = llm.engine
    assert eng.device_drafting is not None and eng.device_drafting.model_drafter is not None
    sp = SamplingParams(temperature=temperature, seed=3, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    if temperature == 0.0:
        assert _ids(outs) == ref
    else:
        assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == _ids(outs)
    assert eng.num_sync_steps == 0
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    m = llm.get_metrics()
    assert m["spec_draft_tokens"] > 0
    if head == "copy" and temperature == 0.0:
        assert m["spec_accepted_tokens"] > m["spec_draft_tokens"] / 4
        assert max(m["spec_acceptance_per_position"][1:]) > 0  # multi-token accepts
    assert eng.block_manager.num_used_blocks == 0 and eng.slot_pool.num_in_use == 0


def test_device_eagle3_drafts_are_the_host_drafters(target, prompts, ref, heads):
    """Synchronous host drafting and device drafting with overlap draft the same tokens: the
    catch-up over the step's rows (prompt rows at a request's first drafting) and the chain
    leave the head's KV as the host drafter's."""
    spec = _spec(heads["random"], k=3, verify_budget="off")
    host = make_llm(model=target[0], speculative_config=spec, max_num_seqs=8)
    dev = make_llm(model=target[0], speculative_config=spec, max_num_seqs=8, overlap=True)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert _ids(dev.generate(prompts, sp, use_tqdm=False)) == _ids(
        host.generate(prompts, sp, use_tqdm=False)
    )
    a, b = dev.engine.ledger.spec, host.engine.ledger.spec
    assert a.num_accepted_tokens == b.num_accepted_tokens > 0


CATCH_UP_ROWS = 256


def _padded(llm) -> FakeGraphs:
    md = llm.engine.device_drafting.model_drafter
    old = md.chain
    md.chain = Eagle3Chain(
        md._step, md._pick, md._confidence, md.pool, old.hidden.shape[1], old.hidden.dtype, md.width,
        md.block_size, md.trash, padded=True, store=md.inner.store,
    )  # fmt: skip
    # catch-ups of up to CATCH_UP_ROWS rows in their buckets, longer ones eagerly
    md.catch_up = CatchUpGraphs(
        md._catch_up_step, md.pool.num_slots, md.width, md.chain.max_context_len, md.device,
        max_rows=CATCH_UP_ROWS, padded=True,
    )  # fmt: skip
    fake = FakeGraphs()
    md.chain.capture(fake, md.head.rotary._table)
    md.catch_up.capture(fake)
    return fake


@pytest.mark.parametrize("head", ["random", "copy"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padded_replayed_chain_drafts_what_the_eager_chain_drafts(
    target,
    prompts,
    ref,
    heads,
    temperature,
    head,
):
    """The graphs' bodies (chain, and steady catch-up + chain, padded to buckets) replayed on
    the CPU draft what the eager catch-up and chain draft, to the token."""
    spec = _spec(heads[head], k=3, verify_budget="off")
    kw = dict(model=target[0], speculative_config=spec, max_num_seqs=8, overlap=True)
    eager, graphs = make_llm(**kw), make_llm(**kw)
    fake = _padded(graphs)
    # chain, steady; catch-ups
    assert fake.captured == 2 * len(chain_buckets(8)) * len(_SHAPES) + len(
        catch_up_sizes(CATCH_UP_ROWS)
    )
    sp = SamplingParams(temperature=temperature, seed=5, max_tokens=24, ignore_eos=True)
    a = eager.generate(prompts, sp, use_tqdm=False)
    b = graphs.generate(prompts, sp, use_tqdm=False)
    assert fake.replays > 0
    # most steps caught up inside the graph (the steady state), the rest in the catch-up's
    # graphs (admissions) or, past their largest bucket, eagerly
    md = graphs.engine.device_drafting.model_drafter
    assert md.chain.num_steady > md.chain.num_replays / 2
    assert md.catch_up.num_replays > 0
    assert _ids(a) == _ids(b)
    if temperature == 0.0:
        assert _ids(b) == ref
    sa, sb = eager.engine.ledger.spec, graphs.engine.ledger.spec
    assert (sa.num_draft_tokens, sa.num_accepted_tokens) == (
        sb.num_draft_tokens,
        sb.num_accepted_tokens,
    )
    assert sb.num_draft_tokens > 0


def _tail_engine(target, head, drafted: bool):
    """An overlapped engine on the bucket layout with the chain padded (on_buckets)."""
    llm = make_llm(
        model=target[0], speculative_config=_spec(head, k=3, verify_budget="off"),
        max_num_seqs=8, overlap=True, kv_cache_memory_gb=10 * 16384 / 2**30,
        max_num_batched_tokens=48, enforce_eager=True, debug_invariants=True,
    )  # fmt: skip
    _padded(llm)
    on_buckets(llm, drafted)
    return llm


@pytest.mark.parametrize("head", ["copy", "random"])
def test_steady_greedy_steps_draft_in_the_graph_tail(target, prompts, ref, heads, head):
    """runner/graph_tail.py: a steady greedy step writes the chain's inputs inside the target's
    tail and replays the chain's graph behind it; the drafts, accepts per position and outputs
    are the eager path's, preemptions (fresh catch-ups, eagerly) on the way. Sampled requests
    keep the eager sampler (their drafts are verified against q): the seeded run is the eager
    engine's and adds no tail step."""
    eager, tail = _tail_engine(target, heads[head], False), _tail_engine(target, heads[head], True)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = tail.generate(prompts, sp, use_tqdm=False)
    assert _ids(outs) == ref == _ids(eager.generate(prompts, sp, use_tqdm=False))
    eng = tail.engine
    g, chain = eng.runner.graphs, eng.device_drafting.model_drafter.chain
    assert g.num_drafted_tail_runs > g.num_verify_replays / 2 > 0
    assert g.num_mixed_runs > 0  # prompt chunks (hidden states captured) through mixed buckets
    assert eager.engine.runner.graphs.num_drafted_tail_runs == 0
    assert chain.num_steady >= g.num_drafted_tail_runs
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert eng.num_sync_steps == 0
    assert eng.ledger.spec == eager.engine.ledger.spec
    assert eng.ledger.spec.num_draft_tokens > 0
    if head == "copy":
        assert max(eng.ledger.spec.accepted_per_position[1:]) > 0
    runs = g.num_drafted_tail_runs
    hot = SamplingParams(temperature=1.0, seed=4, max_tokens=16, ignore_eos=True)
    a = tail.generate(prompts[:4], hot, use_tqdm=False)
    assert _ids(a) == _ids(eager.generate(prompts[:4], hot, use_tqdm=False))
    assert g.num_drafted_tail_runs == runs
    assert eng.block_manager.num_used_blocks == 0 and eng.slot_pool.num_in_use == 0
    assert eng.slot_pool.rejected[0].item() == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafting_resumes_where_the_heads_kv_ends(target, prompts, ref, heads, temperature):
    """A step may not draft (VerifyBudget.plan; here a seeded coin): it is a plain step, and the
    head catches up over every position since the last step that drafted when drafting
    resumes, its anchor still in flight read from next_tokens. Greedy outputs are speculation
    off's, and every drafting step drafts what a run drafting every step drafts at the same
    request and length (a wrong catch-up token or position changes the random head's
    drafts); sampled runs repeat themselves. Preemptions (catch-ups from 0) on the way."""
    kw = dict(
        model=target[0], max_num_seqs=8, overlap=True, debug_invariants=True,
        kv_cache_memory_gb=10 * 16384 / 2**30, max_num_batched_tokens=48,
    )  # fmt: skip
    every = make_llm(**kw, speculative_config=_spec(heads["random"], k=3, verify_budget="off"))
    some = make_llm(**kw, speculative_config=_spec(heads["random"], k=3))
    some.engine.device_drafting.warm_gaps()  # CUDA's start-up, over blocks no request holds
    choices = coin_drafting(some, seed=7)
    logs = log_drafts(every), log_drafts(some)
    sp = SamplingParams(temperature=temperature, seed=3, max_tokens=24, ignore_eos=True)
    outs = some.generate(prompts, sp, use_tqdm=False)
    if temperature == 0.0:
        assert _ids(outs) == ref == _ids(every.generate(prompts, sp, use_tqdm=False))
        common = logs[0].keys() & logs[1].keys()
        assert len(common) > 20
        assert all(logs[0][key] == logs[1][key] for key in common)
    else:
        assert _ids(outs) == _ids(some.generate(prompts, sp, use_tqdm=False))
    assert 0 < sum(choices) < len(choices)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert some.engine.num_sync_steps == 0 and some.get_metrics()["spec_draft_tokens"] > 0


@pytest.mark.parametrize("chain_cost", [0.0, 100.0])
def test_the_budget_drafts_with_the_head_only_where_its_chain_pays(
    target, prompts, ref, heads, chain_cost
):
    """VerifyBudget.plan with the head: its chain priced as free, it drafts in nearly every
    step (the copy head's drafts are accepted: drafting yields more than a plain step);
    priced dearer than any drafts can yield, it drafts only to measure its yield (at first,
    then to explore) and every other step is a plain one (no chain, no feed: the sampling of
    a step without speculation). Outputs are speculation off's either way."""
    from tests.speculative.conftest import curve_of

    llm = make_llm(
        model=target[0], max_num_seqs=8, overlap=True, debug_invariants=True,
        speculative_config=_spec(heads["copy"], k=3),
    )  # fmt: skip
    budget = llm.engine.budget
    buckets = [int(b) for b in budget.curve.buckets]
    budget.curve = curve_of(buckets, lambda r: 1.0 + 0.001 * r)
    budget.observe_step = lambda *step: None
    seen = budget.observe_drafting  # the steps' seconds as priced, not as timed here
    budget.observe_drafting = lambda n, tokens, rows, _: seen(
        n, tokens, rows, 1.0 + 0.001 * rows + chain_cost
    )
    hooks = log_drafts(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert _ids(outs) == ref
    drafting, plain = budget.num_drafting_steps, budget.num_plain_steps
    if chain_cost:
        # the first measurement and each exploration: drafting until SWEEP_REPS steps verified
        assert 0 < drafting <= (plain // EXPLORE_EVERY + 1) * (1 + SWEEP_REPS)
        # the head ran for each request in those steps and the first (prompts, before a plan)
        assert len(hooks) <= len(prompts) * (drafting + 1) < len(prompts) * 24 / 4
    else:
        assert drafting > 4 * plain and llm.get_metrics()["spec_accepted_tokens"] > 0
