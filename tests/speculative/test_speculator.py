"""Host drafting planned by the verify budget (speculator.py), judged by outcomes: a request
planned at zero drafts is not drafted for at all, a model drafter's newest confidences plan its
next round, and a request that skipped drafting for several steps drafts right when it resumes
(greedy outputs equal speculation off; a draft model drafting for itself, its KV caught up
across the skipped steps, is still accepted near always)."""

import json

import numpy as np
import pytest
import torch

from specserve import SamplingParams
from specserve.model.loader import load_model
from specserve.model.loader.dummy import PRESETS
from tests.engine.conftest import make_llm, prompts_of
from tests.model.harness import PagedRunner
from tests.speculative.conftest import FixedDrafter

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
SELF = {"method": "draft_model", "num_speculative_tokens": 4, "model": "self"}
TINY_DRAFT = {"method": "draft_model", "num_speculative_tokens": 3, "model": "dummy:tiny"}
SP = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _prompts() -> list[list[int]]:
    # repeated phrases give the n-gram drafter something to find
    return [p * 5 + p[:3] for p in prompts_of([6] * 4, seed=1)] + prompts_of([3, 40], seed=2)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def ref() -> list[list[int]]:
    return _ids(make_llm().generate(_prompts(), SP, use_tqdm=False))


def spy_proposals(llm) -> list[list[int]]:
    """The limits of every drafter call."""
    drafter, calls = llm.engine.drafter, []
    real = drafter.propose
    drafter.propose = lambda seqs, limits: calls.append(list(limits)) or real(seqs, limits)
    return calls


def plan_every(llm, n: int) -> None:
    """The budget plans no drafts for n - 1 rounds in n, all of each request's room in the
    other, independent of timing: every request skips drafting for n - 1 steps in a row."""
    calls = [0]

    def allot(surv, base_rows, room=None):
        calls[0] += 1
        return list(room) if calls[0] % n == 0 else [0] * len(room)

    llm.engine.budget.allot = allot


def test_a_model_drafter_is_planned_by_its_newest_confidences(ref):
    """A request with no confidences yet starts at 1 and drafts; once its drafts came with
    confidence 0 it is never drafted for again (exploration included: zero survival is never
    verified), and the steps after are plain."""
    llm = make_llm(speculative_config=TINY_DRAFT, debug_invariants=True)
    llm.engine.drafter = llm.engine.speculator.drafter = FixedDrafter([5] * 8, confidence=0.0)
    calls = spy_proposals(llm)
    outs = llm.generate(_prompts(), SP, use_tqdm=False)
    assert _ids(outs) == ref
    drafted = sum(1 for limits in calls for m in limits if m > 0)
    assert 0 < drafted <= len(ref)  # once per request at most: its first round
    m = llm.get_metrics()
    assert m["spec_draft_tokens"] <= 3 * len(ref)
    assert sum(n for q, n in m["verify_budget_seqlens_q"].items() if q > 1) <= len(ref)


@pytest.mark.parametrize("cfg", [NGRAM, SELF, TINY_DRAFT], ids=["ngram", "self", "draft"])
def test_a_request_that_skipped_drafting_for_several_steps_drafts_right(ref, cfg):
    llm = make_llm(speculative_config=cfg, debug_invariants=True, max_num_batched_tokens=64)
    plan_every(llm, 4)
    calls = spy_proposals(llm)
    outs = llm.generate(_prompts(), SP, use_tqdm=False)
    assert _ids(outs) == ref
    assert calls and all(all(m > 0 for m in limits) for limits in calls)  # planned 0: not called
    m = llm.get_metrics()
    assert m["spec_accepted_tokens"] > 0
    assert m["num_steps"] >= 3 * len(calls)  # mostly plain steps between the drafting rounds
    if cfg is SELF:  # the target drafting for itself, its KV right after the skips
        assert m["spec_accepted_tokens"] / m["spec_draft_tokens"] > 0.95
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def shallow(tmp_path_factory) -> str:
    """The tiny target with its last layer gone (same seed: the layers it keeps are the
    target's): a draft model that agrees with the target often, not always, so accepted
    prefixes of every length happen."""
    root = tmp_path_factory.mktemp("shallow")
    (root / "config.json").write_text(json.dumps(dict(PRESETS["tiny"], num_hidden_layers=1)))
    return f"dummy:{root}"


def test_a_draft_models_kv_after_skipped_steps_is_the_model_recomputed_from_scratch(shallow):
    """Sampling (rejections after accepted prefixes of every length), drafting every third
    step: the draft model's KV, kept for accepted drafts, rewritten for rejected ones and caught
    up across the skipped steps, gives each round's first draft distribution exactly as a fresh
    forward of the draft model over the request's tokens does."""
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": shallow}
    llm = make_llm(speculative_config=spec, debug_invariants=True)
    plan_every(llm, 3)
    drafter, pool, records = llm.engine.drafter, llm.engine.slot_pool, []
    real = drafter.propose

    def spy(seqs, limits):
        out = real(seqs, limits)
        for s, (d, _) in zip(seqs, out):
            if d:
                records.append((list(s.token_ids), pool.q[s.slot * pool.k].clone()))
        return out

    drafter.propose = spy
    sp = SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)
    llm.generate(_prompts(), sp, use_tqdm=False)
    m = llm.get_metrics()
    assert 0 < m["spec_accepted_tokens"] < m["spec_draft_tokens"]
    assert m["spec_acceptance_per_position"][1] > 0  # accepted prefixes longer than one
    loaded = load_model(shallow, torch.float32, torch.device("cpu"), progress=False)
    late = [r for r in records if len(r[0]) > 40]
    assert len(late) >= 10
    for tokens, q in late:
        logits = PagedRunner(loaded.model, loaded.config).logits([(0, tokens)])[-1]
        torch.testing.assert_close(q, torch.softmax(logits.float(), -1), rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("calibrated", [True, False], ids=["calibrated", "negative-control"])
def test_a_model_drafter_that_overstates_its_confidence_is_planned_by_what_verifies(
    ref, calibrated
):
    """Its remembered confidences stay at 1, but the plan learns from the outcomes that they
    overstate acceptance: the survivals the budget plans with fall to what verifies (whether
    that still pays depends on the step-cost curve). Without the calibration (negative
    control) the plan keeps believing them."""
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm = make_llm(speculative_config=TINY_DRAFT, debug_invariants=True)
    sure_and_wrong = FixedDrafter([5] * 8, confidence=1.0)
    llm.engine.drafter = llm.engine.speculator.drafter = sure_and_wrong
    if not calibrated:
        llm.engine.speculator.calibration.apply = lambda conf: conf
    budget, planned = llm.engine.budget, []
    real = budget.allot
    budget.allot = lambda surv, *a, **kw: planned.append(surv.copy()) or real(surv, *a, **kw)
    outs = llm.generate(_prompts(), sp, use_tqdm=False)
    assert [o[:32] for o in _ids(outs)] == ref
    m = llm.get_metrics()
    assert m["spec_accepted_tokens"] <= 0.2 * m["spec_draft_tokens"]  # the drafter is wrong
    late = np.concatenate(planned[len(planned) // 2 :])[:, 0]  # first-draft survival
    if calibrated:
        # how far below depends on how many first drafts the budget still verifies once they
        # stop paying, i.e. on the measured step-cost curve: (0 + 4) / (n + 4) after n of them
        assert late.max() < 0.5
    else:
        assert late.min() == 1.0
