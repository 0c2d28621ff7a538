"""Speculation end to end on tiny random models: lossless greedy, exact seeded sampling for
one-hot drafters, and the known bugs of other engines."""

import pytest

from specserve import SamplingParams
from tests.engine.conftest import make_llm, prompts_of
from tests.speculative.conftest import FixedDrafter

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
SELF = {"method": "draft_model", "num_speculative_tokens": 4, "model": "self"}
TINY_DRAFT = {"method": "draft_model", "num_speculative_tokens": 3, "model": "dummy:tiny"}


def _repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    # repeated phrases give the n-gram drafter something to find
    base = prompts_of([6] * n, seed=seed)
    return [p * 5 + p[:3] for p in base]


@pytest.fixture(scope="module")
def off():
    return make_llm(debug_invariants=True)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("cfg", [NGRAM, SELF, TINY_DRAFT], ids=["ngram", "self", "draft"])
def test_greedy_speculation_is_token_for_token_identical(off, cfg):
    prompts = _repetitive_prompts(6, seed=1) + prompts_of([3, 40], seed=2)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = _ids(off.generate(prompts, sp, use_tqdm=False))
    llm = make_llm(speculative_config=cfg, debug_invariants=True, max_num_batched_tokens=32)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert _ids(outs) == ref
    m = llm.get_metrics()
    assert m["spec_drafts"] > 0 and m["spec_accepted_tokens"] > 0
    if cfg is SELF:
        assert m["spec_accepted_tokens"] / m["spec_draft_tokens"] > 0.95
    if llm.engine.budget is not None:  # the step-cost curve, swept at start-up
        assert all(t > 0 for _, t in m["step_cost_curve"])
    assert llm.engine.block_manager.num_used_blocks == 0
    assert llm.engine.slot_pool.num_in_use == 0


def test_greedy_speculation_under_preemption(off):
    prompts = _repetitive_prompts(8, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = _ids(off.generate(prompts, sp, use_tqdm=False))
    llm = make_llm(
        speculative_config=SELF,
        debug_invariants=True,
        kv_cache_memory_gb=15 * 8192 / 2**30,
        enable_prefix_caching=False,
    )
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert _ids(outs) == ref
    assert llm.engine.slot_pool.num_in_use == 0


def test_seeded_sampling_with_ngram_emits_the_spec_off_tokens(off):
    """A one-hot drafter's verify draws each row's token from the row's own output-token stream,
    so a seeded request emits exactly what it emits without speculation."""
    prompts = _repetitive_prompts(4, seed=4)
    sp = SamplingParams(temperature=0.8, top_k=50, seed=99, max_tokens=30, ignore_eos=True)
    ref = _ids(off.generate(prompts, sp, use_tqdm=False))
    llm = make_llm(speculative_config=NGRAM, debug_invariants=True)
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == ref


def test_sampling_with_a_draft_model_runs_and_is_reproducible():
    """Seeded sampling with draft-model drafts repeats exactly when the same drafts are verified
    (fixed k here). Under the auto budget the verified drafts follow measured step times, so
    the tokens may differ run to run (their distribution does not)."""
    prompts = _repetitive_prompts(3, seed=5)
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    fixed = TINY_DRAFT | {"verify_budget": "off"}
    a = _ids(make_llm(speculative_config=fixed).generate(prompts, sp, use_tqdm=False))
    b = _ids(make_llm(speculative_config=fixed).generate(prompts, sp, use_tqdm=False))
    assert a == b and all(len(x) == 20 for x in a)


def test_acceptance_is_not_overcounted_when_a_stop_lands_inside_the_accepted_prefix(off):
    """vLLM #56101: tokens after a stop are not emitted, counted in usage or counted accepted."""
    prompt = _repetitive_prompts(1, seed=6)[0]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = _ids(off.generate([prompt], sp, use_tqdm=False))[0]
    stop = ref[9]
    cut = ref.index(stop) + 1
    llm = make_llm(speculative_config=SELF, debug_invariants=True)
    outs = list(
        llm.stream([prompt], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop]))
    )
    toks = [o.token_id for o in outs]
    assert toks == ref[:cut]
    anchors = [o for o in outs if o.is_anchor]
    accepted = sum(o.accept_tok for o in anchors)
    m = llm.get_metrics()
    assert m["spec_accepted_tokens"] == accepted
    # each step emits its accepted drafts plus at most the sampled token
    assert cut - len(anchors) <= accepted <= cut
    assert sum(m["spec_acceptance_per_position"]) <= m["spec_draft_tokens"]


def test_drafted_eos_does_not_finish_early_and_min_tokens_holds(off):
    """vLLM PR #41493 (premature finish on a drafted EOS) and min_tokens in the verifier."""
    prompt = prompts_of([10], seed=7)[0]
    eos = 2  # the tiny preset's EOS
    base = SamplingParams(temperature=0, max_tokens=25)
    ref = _ids(off.generate([prompt], base, use_tqdm=False))[0]
    llm = make_llm(speculative_config=NGRAM, debug_invariants=True)
    llm.engine.drafter = FixedDrafter([eos, eos, eos])
    assert _ids(llm.generate([prompt], base, use_tqdm=False))[0] == ref
    stop_tok = ref[2]
    sp = SamplingParams(temperature=0, max_tokens=25, min_tokens=6, stop_token_ids=[stop_tok])
    llm.engine.drafter = FixedDrafter([stop_tok, eos, stop_tok])
    want = _ids(off.generate([prompt], sp, use_tqdm=False))[0]
    got = _ids(llm.generate([prompt], sp, use_tqdm=False))[0]
    assert got == want
    assert stop_tok not in got[:6]


def test_penalties_see_the_drafts_before_each_verify_row(off):
    """vLLM #18902: frequency penalty ignored under speculation."""
    prompts = _repetitive_prompts(3, seed=8)
    sp = SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5
    )
    ref = _ids(off.generate(prompts, sp, use_tqdm=False))
    plain = _ids(
        off.generate(
            prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False
        )
    )
    assert ref != plain  # the penalty changes the output, so the test can fail
    llm = make_llm(speculative_config=SELF, debug_invariants=True)
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == ref
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3)
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == _ids(
        off.generate(prompts, sp, use_tqdm=False)
    )


def test_logprobs_under_speculation_come_from_the_target(off):
    prompts = _repetitive_prompts(2, seed=9)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
    ref = off.generate(prompts, sp, use_tqdm=False)
    llm = make_llm(speculative_config=SELF)
    got = llm.generate(prompts, sp, use_tqdm=False)
    for a, b in zip(ref, got):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids
        assert len(cb.logprobs) == len(cb.token_ids)
        for la, lb, tok in zip(ca.logprobs, cb.logprobs, cb.token_ids):
            assert set(la) == set(lb) and tok in lb
            for t in la:
                assert lb[t].logprob == pytest.approx(la[t].logprob, abs=1e-4)
                assert lb[t].logprob > -9999.0 or la[t].logprob == -9999.0
        assert cb.cumulative_logprob == pytest.approx(ca.cumulative_logprob, abs=1e-3)


def test_draft_model_with_another_vocabulary_is_refused(tmp_path):
    import json

    from specserve.model.errors import ModelLoadError
    from specserve.model.loader.dummy import PRESETS

    cfg = dict(PRESETS["tiny"], vocab_size=1000)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="vocabulary"):
        make_llm(
            speculative_config={
                "method": "draft_model",
                "num_speculative_tokens": 2,
                "model": f"dummy:{tmp_path}",
            }
        )
