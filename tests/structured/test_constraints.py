"""regex, choice, EBNF grammar and json_object constraints end to end on the tiny model; the
grammar cache; a finished grammar stops the request; refusals naming the field; neighbours
without a constraint unchanged."""

from __future__ import annotations

import json
import re

import pytest

from specserve import SamplingParams
from specserve.sampling_params import InvalidRequestError
from specserve.structured import StructuredOutputsParams
from tests.engine.conftest import prompts_of

PROMPTS = ["The answer is", "Pick one:", "x y z"]


def _texts(llm, so, **kw):
    kw.setdefault("temperature", 0.0)
    sp = SamplingParams(max_tokens=kw.pop("max_tokens", 40), structured_outputs=so, **kw)
    return [o.outputs[0] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex(off, temperature):
    pat = r"[0-9]{3}-[a-z]{2,4}"
    for o in _texts(off, {"regex": pat}, temperature=temperature, seed=1):
        assert re.fullmatch(pat, o.text) and o.finish_reason == "stop", o.text


def test_choice_spreads_when_sampled(off):
    choices = ["yes", "no", "maybe so", 'quote "q"']
    outs = []
    for seed in range(6):
        outs += _texts(off, {"choice": choices}, temperature=1.0, seed=seed)
    assert all(o.text in choices and o.finish_reason == "stop" for o in outs)
    assert len({o.text for o in outs}) >= 2


def test_ebnf_grammar(off):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    for o in _texts(off, {"grammar": grammar}, max_tokens=60, temperature=1.0, seed=2):
        if o.finish_reason == "stop":
            assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", o.text), o.text


def test_json_object(off):
    outs = _texts(off, {"json_object": True, "disable_any_whitespace": True}, max_tokens=80)
    for o in outs:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
    assert any(o.finish_reason == "stop" for o in outs)


def test_finished_grammar_stops_even_with_ignore_eos(off):
    for o in _texts(off, {"choice": ["alpha", "beta"]}, ignore_eos=True, max_tokens=30):
        assert o.text in ("alpha", "beta") and o.finish_reason == "stop"
        assert len(o.token_ids) < 30


def test_cache_compiles_each_constraint_once(off):
    so = {"regex": "cached-[0-9]{2}"}
    before = off.engine.grammars.num_compiled
    _texts(off, so)
    _texts(off, StructuredOutputsParams(regex="cached-[0-9]{2}"))
    assert off.engine.grammars.num_compiled == before + 1
    m = off.get_metrics()
    assert m["structured_mask_steps"] > 0 and m["structured_mask_seconds"] > 0


def test_neighbours_unchanged(off):
    prompts = prompts_of([6, 9], seed=4)
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in off.generate(prompts, plain, use_tqdm=False)]
    mixed = off.generate(
        prompts + ["z"],
        [plain, plain, SamplingParams(max_tokens=10, structured_outputs={"regex": "[a-c]+"})],
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone


@pytest.mark.parametrize(
    ("so", "kw", "param"),
    [
        ({"json": {"type": "nope"}}, {}, "structured_outputs"),
        ({"regex": "("}, {}, "structured_outputs"),
        ({"grammar": "root ::= missing"}, {}, "structured_outputs"),
        ({"json": "{not json"}, {}, "structured_outputs"),
        ({"regex": "a", "choice": ["b"]}, {}, "structured_outputs"),
        ({}, {}, "structured_outputs"),
        ({"choice": []}, {}, "structured_outputs"),
        ({"regex": "a", "whitespace_pattern": " "}, {}, "structured_outputs"),
        ({"regex": "a", "bogus": 1}, {}, "structured_outputs"),
        ({"regex": "a"}, {"min_tokens": 2}, "min_tokens"),
    ],
)
def test_refusals_name_the_field(off, so, kw, param):
    with pytest.raises(InvalidRequestError) as e:
        off.generate(["x"], SamplingParams(structured_outputs=so, **kw), use_tqdm=False)
    assert e.value.param == param
    assert not off.engine.requests  # nothing queued
