"""55 JSON schemas in one engine run per mode (speculation off, n-gram, draft model): every
output that completes parses and validates with jsonschema, every output cut by max_tokens is a
prefix the grammar accepts, and the tokens are the same in every mode (greedy, and sampled with
a seed for n-gram, whose drafts are one-hot)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from specserve import SamplingParams
from tests.structured.schemas import SCHEMAS

MAX_TOKENS = 48  # every schema completes in < 40 tokens on the tiny model


def _prompts() -> list[str]:
    # the schema itself in the prompt: n-gram drafts copy its keys, so drafts get verified
    return [f"Reply with JSON for {json.dumps(s)}:" for s in SCHEMAS]


def _params(**kw) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_tokens=MAX_TOKENS,
            structured_outputs={"json": s, "disable_any_whitespace": True},
            **kw,
        )
        for s in SCHEMAS
    ]


def _run(llm, **kw):
    return [o.outputs[0] for o in llm.generate(_prompts(), _params(**kw), use_tqdm=False)]


def _check(llm, outs) -> int:
    """Every completed output validates; every cut one is a prefix the grammar accepts.
    Returns how many completed."""
    done = 0
    for schema, out in zip(SCHEMAS, outs):
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
            done += 1
        else:
            assert out.finish_reason == "length", out.finish_reason
            g = llm.engine.grammars.matcher(
                SamplingParams(structured_outputs={"json": schema}).structured_outputs
            )
            for t in out.token_ids:
                g.advance(t)  # raises on a token outside the grammar
    return done


@pytest.fixture(scope="module")
def greedy_off(off):
    return _run(off, temperature=0.0)


def test_outputs_validate(off, greedy_off):
    # most complete: the test is not vacuous
    assert _check(off, greedy_off) >= 0.8 * len(SCHEMAS)


@pytest.mark.parametrize("mode", ["ngram", "self_draft"])
def test_greedy_identical_under_speculation(request, greedy_off, mode):
    llm = request.getfixturevalue(mode)
    before = llm.get_metrics()["spec_draft_tokens"]
    outs = _run(llm, temperature=0.0)
    assert [o.token_ids for o in outs] == [o.token_ids for o in greedy_off]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in greedy_off]
    assert llm.get_metrics()["spec_draft_tokens"] > before  # drafts were verified


def test_seeded_sampling_identical_with_ngram(off, ngram):
    kw = dict(temperature=1.0, seed=11)
    ref = _run(off, **kw)
    _check(off, ref)
    outs = _run(ngram, **kw)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
