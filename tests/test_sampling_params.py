"""SamplingParams checks every field's type and range where a request enters (issue 21): a bad
value is an InvalidRequestError naming the field, never a crash inside a step. The fuzz at the
end throws extreme values at every field of a request running beside innocent ones: each fuzzed
request is refused at entry or runs to a normal end, and the innocent ones emit exactly their
reference tokens."""

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from specserve import InvalidRequestError, SamplingParams
from tests.engine.conftest import make_llm, prompts_of

INT_FIELDS = ["n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs"]
FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]
BOOL_FIELDS = ["include_stop_str_in_output", "ignore_eos", "skip_special_tokens"]
TOKEN_LIST_FIELDS = ["stop_token_ids", "golden_token_ids"]


def refused(field: str, **kw) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == field, e.value


@pytest.mark.parametrize("field", INT_FIELDS + ["truncate_prompt_tokens"])
@pytest.mark.parametrize("value", [True, False, 2.0, 1.5, "3", [1]])
def test_int_fields_refuse_bools_floats_and_other_types(field, value):
    refused(field, **{field: value})


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e39, 10**400, True, "0.5", None])
def test_float_fields_refuse_non_finite_values_and_other_types(field, value):
    refused(field, **{field: value})


@pytest.mark.parametrize("field", BOOL_FIELDS)
@pytest.mark.parametrize("value", [1, 0, "true", None, 1.0])
def test_bool_fields_take_only_bools(field, value):
    refused(field, **{field: value})


@pytest.mark.parametrize("field", TOKEN_LIST_FIELDS)
@pytest.mark.parametrize("value", [[-1], [True], [1.0], ["3"], "abc", 7, {1: 2}])
def test_token_id_lists_take_non_negative_ints(field, value):
    refused(field, **{field: value})


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(n=0), "n"),
        (dict(top_k=-2), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.0001), "top_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(temperature=-1e-3), "temperature"),
        (dict(seed=2**64), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(seed=10**25), "seed"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
        (dict(stop=""), "stop"),
        (dict(stop=["a", ""]), "stop"),
        (dict(stop=["a", 3]), "stop"),
        (dict(stop=5), "stop"),
        (dict(stop={"a": 1}), "stop"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    ],
)
def test_out_of_range_values_name_their_field(kw, field):
    refused(field, **kw)


def test_accepted_values_are_normalised():
    import numpy as np

    sp = SamplingParams(
        top_k=-1,
        temperature=1,
        seed=2**64 - 1,
        max_tokens=10**25,
        stop="x",
        stop_token_ids=(np.int64(3), 4),
        truncate_prompt_tokens=-1,
        min_p=np.float32(0.25),
    )
    assert sp.top_k == 0 and sp.temperature == 1.0 and type(sp.temperature) is float
    assert sp.stop == ["x"] and sp.stop_token_ids == [3, 4]
    assert all(type(t) is int for t in sp.stop_token_ids) and type(sp.min_p) is float
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(top_k=2**31).top_k == 2**31  # off once the model is known, below


def test_a_field_changed_after_construction_is_checked_again():
    sp = SamplingParams()
    sp.top_k = True
    with pytest.raises(InvalidRequestError) as e:
        sp.validate()
    assert e.value.param == "top_k"


def test_model_checks():
    sp = SamplingParams(stop_token_ids=[99], golden_token_ids=[5])
    sp.validate_for_model(100, 64)
    for kw, field in [
        (dict(stop_token_ids=[100]), "stop_token_ids"),
        (dict(golden_token_ids=[7, 100]), "golden_token_ids"),
        (dict(truncate_prompt_tokens=65), "truncate_prompt_tokens"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**kw).validate_for_model(100, 64)
        assert e.value.param == field
    for k, effective in [(99, 99), (100, 0), (2**31, 0), (10**25, 0)]:
        sp = SamplingParams(top_k=k)
        sp.validate_for_model(100, 64)
        assert sp.top_k == effective  # >= the vocabulary keeps every token: off (vLLM)


# -- the fuzz --------------------------------------------------------------------------------
FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.init]
EXTREME_INTS = [0, 1, -1, 2, 3, 20, 21, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63)]
EXTREME_INTS += [10**25, -(10**25), 49151, 49152]
WEIRD = st.one_of(
    st.sampled_from(EXTREME_INTS),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 0.5, 1.0, 1.5, -0.5, 1e-6, 1e30, 3e38, 1e39]),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.lists(
        st.one_of(st.integers(-3, 10**6), st.sampled_from([2**31, 10**25, True, 1.5, "a", None])),
        max_size=3,
    ),
    st.lists(st.text(max_size=3), max_size=2),
    st.dictionaries(st.integers(-2, 10**5), st.floats(allow_nan=True), max_size=2),
)
IDS = st.integers(0, 49151)  # the tiny model's vocabulary
VALID = {  # values a request may well use, so most fuzzed requests get past entry and run
    "n": st.integers(1, 4),
    "temperature": st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    "top_p": st.sampled_from([0.5, 0.9, 1.0]),
    "top_k": st.sampled_from([-1, 0, 1, 5, 50, 2**31, 10**25]),
    "min_p": st.sampled_from([0.0, 0.1]),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "max_tokens": st.sampled_from([None, 1, 4, 10**25]),
    "min_tokens": st.sampled_from([0, 2, 5]),
    "stop": st.sampled_from([None, "a", ["the", "x"]]),
    "stop_token_ids": st.lists(IDS, max_size=3),
    "include_stop_str_in_output": st.booleans(),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "logprobs": st.sampled_from([None, 0, 5, 20]),
    "truncate_prompt_tokens": st.sampled_from([None, -1, 1, 3, 16]),
    "golden_token_ids": st.lists(IDS, max_size=4),
    "logit_bias": st.dictionaries(IDS, st.floats(-100, 100), max_size=3),
    "allowed_token_ids": st.lists(IDS, min_size=1, max_size=5),
    "bad_words": st.lists(st.text(min_size=1, max_size=4), max_size=2),
    "prompt_logprobs": st.sampled_from([None, 0, 3]),
}
# plausible values for some fields, then one extreme value (or none) for any field
FUZZED = st.builds(
    lambda valid, weird: valid | dict(weird),
    st.fixed_dictionaries({}, optional={f: VALID.get(f, WEIRD) for f in FIELDS}),
    st.lists(st.tuples(st.sampled_from(FIELDS), WEIRD), max_size=1),
)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def fuzz_llm():
    # a short context bounds a fuzzed request that may run to it (max_tokens huge or None)
    return make_llm(max_model_len=16, max_num_seqs=8, debug_invariants=True)


@pytest.fixture(scope="module")
def innocents(fuzz_llm):
    prompts = prompts_of([5, 9], seed=5)
    return prompts, [o.outputs[0].token_ids for o in fuzz_llm.generate(prompts, GREEDY, False)]


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(kw=FUZZED, late=st.booleans())
def test_fuzzed_requests_are_refused_or_run_and_never_harm_others(fuzz_llm, innocents, kw, late):
    eng = fuzz_llm.engine
    try:
        if late:  # set after construction: add_request checks again
            sp = SamplingParams()
            for k, v in kw.items():
                setattr(sp, k, v)
        else:
            sp = SamplingParams(**kw)
    except InvalidRequestError as e:
        assert e.param in kw, (e.param, str(e))
        event("refused at construction")
        return
    prompts, ref = innocents
    good = [eng.add_request(p, GREEDY) for p in prompts]
    try:
        fuzzed = eng.add_request(prompts_of([6], seed=6)[0], sp)
    except InvalidRequestError as e:
        assert e.param in kw, (e.param, str(e))
        event("refused by add_request")
        fuzzed = None
    toks = {s.request_id: [] for s in good}
    reasons = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.token_id >= 0 and out.request_id in toks:
                toks[out.request_id].append(out.token_id)
            if out.finished:
                reasons[out.request_id] = (out.finish_reason, out.stop_reason)
    assert [toks[s.request_id] for s in good] == ref
    event("ran" if fuzzed is not None else "refused")
    if fuzzed is not None:  # it ran: to a normal end, not an isolated failure
        assert reasons[fuzzed.request_id][0] in ("stop", "length"), reasons[fuzzed.request_id]
    eng.release_outputs()
    assert not eng.requests and eng.block_manager.num_used_blocks == 0
    assert eng.pool.num_free == eng.pool.capacity
