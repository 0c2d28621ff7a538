"""logit_bias, allowed_token_ids and bad_words end to end on the tiny dummy model: what they do
to every emitted token, losslessness under speculation (n-gram and draft model), no effect on
the requests beside them, and refusals that name the field."""

from __future__ import annotations

import pytest

from specserve import SamplingParams
from specserve.sampling_params import InvalidRequestError
from tests.engine.conftest import make_llm, prompts_of

# budget off: every step verifies the drafts, so each case below has verify rows to process
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "verify_budget": "off",
}
SELF = {
    "method": "draft_model",
    "num_speculative_tokens": 3,
    "model": "self",
    "verify_budget": "off",
}
WORDS = [" the", " cat", " sat", " on", " mat", " dog", " ran", " a"]


@pytest.fixture(scope="module")
def off():
    return make_llm(max_num_seqs=8, debug_invariants=True)


@pytest.fixture(scope="module")
def ngram():
    return make_llm(max_num_seqs=8, speculative_config=NGRAM, debug_invariants=True)


@pytest.fixture(scope="module")
def self_draft():
    return make_llm(max_num_seqs=8, speculative_config=SELF, debug_invariants=True)


@pytest.fixture(scope="module")
def allowed(off) -> list[int]:
    ids = [off.tokenizer.encode(w, add_special_tokens=False) for w in WORDS]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _gen(llm, prompts, sp) -> list[list[int]]:
    return _ids(llm.generate(prompts, sp, use_tqdm=False))


def _contains(tokens: list[int], word: list[int]) -> bool:
    k = len(word)
    return any(tokens[i : i + k] == word for i in range(len(tokens) - k + 1))


PROMPTS = prompts_of([5, 12, 30], seed=3)
GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
SAMPLED = dict(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("kw", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_allowed_token_ids_restrict_every_token(off, allowed, kw) -> None:
    outs = _gen(off, PROMPTS, SamplingParams(**kw, allowed_token_ids=allowed))
    assert all(t in allowed for o in outs for t in o)
    if kw is SAMPLED:  # sampling really spreads over the whitelist, not one forced token
        assert len({t for o in outs for t in o}) >= 4


def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_it(off) -> None:
    base = _gen(off, PROMPTS, SamplingParams(**GREEDY))
    sampled_base = _gen(off, PROMPTS, SamplingParams(**SAMPLED))
    for kw in (GREEDY, SAMPLED):
        forced = _gen(off, PROMPTS, SamplingParams(**kw, logit_bias={4321: 100.0}))
        assert all(t == 4321 for o in forced for t in o)
    # ban the tokens the unbiased runs emit: they never come out, and the rest still varies
    frequent = sorted({t for o in base + sampled_base for t in o})
    ban = {t: -100.0 for t in frequent}
    for kw in (GREEDY, SAMPLED):
        outs = _gen(off, PROMPTS, SamplingParams(**kw, logit_bias=ban))
        assert not {t for o in outs for t in o} & set(frequent)


def test_bad_words_never_appear(off, allowed) -> None:
    tok = off.tokenizer
    bases = {
        name: _gen(off, PROMPTS, SamplingParams(**kw, allowed_token_ids=allowed))
        for name, kw in (("sampled", SAMPLED), ("greedy", GREEDY))
    }
    sampled, greedy = bases["sampled"], bases["greedy"]
    # a one-token word and two-token phrases the unconstrained runs do emit (greedy repeats
    # its first token)
    pairs = {(a, b) for o in sampled for a, b in zip(o, o[1:]) if a != b}
    phrases = [tok.decode(list(p)) for p in sorted(pairs)[:3]]
    g = greedy[0][0]
    words = [tok.decode([sampled[0][0]]), tok.decode([g, g])] + phrases
    ref = SamplingParams(bad_words=words)
    ref.resolve_bad_words(tok, off.engine.model_config.vocab_size)  # as add_request does
    banned = ref.bad_words_token_ids
    assert [sampled[0][0]] in banned and [g, g] in banned
    for name, kw in (("sampled", SAMPLED), ("greedy", GREEDY)):
        sp = SamplingParams(**kw, allowed_token_ids=allowed, bad_words=words)
        outs = _gen(off, PROMPTS, sp)
        for ids in outs:
            assert len(ids) == kw["max_tokens"]
            assert not any(_contains(ids, w) for w in banned), (ids, banned)
        assert outs != bases[name]  # the ban changed what the unconstrained run emitted
    # [g, g] banned, g alone is not: greedy still starts with it
    assert outs[0][0] == g


def _processed(allowed: list[int]) -> list[SamplingParams]:
    """Bias alone, whitelist + bad words, and everything with a penalty; greedy, so speculation
    must match exactly."""
    # the tiny model's greedy choice repeats its last token; banning every doubled word makes it
    # alternate, so n-gram drafts hold the banned words' first tokens before the rows they ban
    doubled = [w + w for w in WORDS]
    return [
        SamplingParams(**GREEDY, logit_bias={allowed[0]: 8.0, allowed[5]: -3.0, 4321: 2.5}),
        SamplingParams(**GREEDY, allowed_token_ids=allowed, bad_words=doubled),
        SamplingParams(
            **GREEDY,
            allowed_token_ids=allowed,
            logit_bias={allowed[1]: 2.0},
            bad_words=[" dog dog", " cat"],
            repetition_penalty=1.2,
        ),
    ]


@pytest.mark.parametrize("spec", ["ngram", "self_draft"])
def test_greedy_speculation_is_lossless_with_processing(off, allowed, spec, request) -> None:
    llm = request.getfixturevalue(spec)
    prompts = [p * 2 for p in PROMPTS]  # repeats give the n-gram drafter something to find
    for sp in _processed(allowed):
        want = _gen(off, prompts, sp)
        before = llm.get_metrics()
        assert _gen(llm, prompts, sp) == want, sp
        m = llm.get_metrics()
        assert m["spec_draft_tokens"] > before["spec_draft_tokens"]  # verify rows were processed
    assert llm.get_metrics()["spec_accepted_tokens"] > 0


def test_seeded_sampling_with_ngram_emits_the_spec_off_tokens(off, ngram, allowed) -> None:
    """One-hot drafts: each row draws from its own stream, so a seeded request emits exactly
    its spec-off tokens, processing included."""
    prompts = [p * 2 for p in PROMPTS]
    sp = SamplingParams(
        **SAMPLED, allowed_token_ids=allowed, logit_bias={allowed[2]: 1.5}, bad_words=[" on on"]
    )
    assert _gen(ngram, prompts, sp) == _gen(off, prompts, sp)


def test_requests_beside_processed_ones_are_unchanged(off, allowed) -> None:
    plain = [SamplingParams(**GREEDY), SamplingParams(**SAMPLED)]
    want = [_gen(off, PROMPTS, sp) for sp in plain]
    procs = _processed(allowed)
    prompts = PROMPTS * 2 + PROMPTS[:2] * len(procs)
    params = [plain[0]] * 3 + [plain[1]] * 3 + [p for p in procs for _ in range(2)]
    outs = _ids(off.generate(prompts, params, use_tqdm=False))
    assert outs[:3] == want[0] and outs[3:6] == want[1]


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(logit_bias={5: 100.5}), "logit_bias"),
        (dict(logit_bias={5: float("nan")}), "logit_bias"),
        (dict(logit_bias={5: float("inf")}), "logit_bias"),
        (dict(logit_bias={"5": 1.0}), "logit_bias"),
        (dict(logit_bias=[5]), "logit_bias"),
        (dict(logit_bias={49152: 1.0}), "logit_bias"),  # the vocabulary is 49152
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1, 2.0]), "allowed_token_ids"),
        (dict(allowed_token_ids=[49152]), "allowed_token_ids"),
        (dict(bad_words=[3]), "bad_words"),
        (dict(bad_words="dog"), "bad_words"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(prompt_logprobs=True), "prompt_logprobs"),
    ],
)
def test_bad_values_are_refused_naming_the_field(off, kw, field) -> None:
    with pytest.raises(InvalidRequestError) as err:
        sp = SamplingParams(max_tokens=2)
        for k, v in kw.items():
            setattr(sp, k, v)  # past the constructor's check: add_request checks again
        off.generate([[5, 6, 7]], sp, use_tqdm=False)
    assert err.value.param == field
    assert not off.engine.has_unfinished()


def test_constraints_that_leave_no_token_are_refused_or_end_the_request_alone():
    """allowed_token_ids emptied by the request's own bans would sample from a row of -inf."""
    llm = make_llm(max_num_seqs=4)
    tok = llm.get_tokenizer()
    eos = sorted(llm.engine.eos_ids)[0]
    word = tok.encode(" hello", add_special_tokens=False)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([[5, 6]], SamplingParams(allowed_token_ids=[word[0]], bad_words=["hello"]))
    assert e.value.param == "allowed_token_ids"
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([[5, 6]], SamplingParams(allowed_token_ids=[eos], min_tokens=2))
    assert e.value.param == "min_tokens"
    # after " the", the bad words " the the" and " the cat" ban both allowed tokens
    the, cat = (tok.encode(w, add_special_tokens=False) for w in (" the", " cat"))
    assert len(the) == len(cat) == 1 and tok.encode(" the the cat", add_special_tokens=False) == [*the, *the, *cat]  # fmt: skip
    bad = SamplingParams(
        allowed_token_ids=[*the, *cat], bad_words=["the the", "the cat"], max_tokens=4,
        temperature=0, logit_bias={the[0]: 100.0},
    )  # fmt: skip
    good = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ref = llm.generate([[9, 10, 11]], good, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate([[5, 6], [9, 10, 11]], [bad, good], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "bad_words" in outs[0].error
    assert outs[0].outputs[0].token_ids == the
    assert outs[1].outputs[0].token_ids == ref
