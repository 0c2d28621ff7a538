"""55 JSON schemas in one engine run per mode: every output that completes parses and validates
with jsonschema, every output cut by max_tokens is a prefix the grammar accepts, and the tokens
are the same with speculation off, n-gram (all 55) and draft model (the first 24), greedy, and
sampled with a seed for n-gram (the first 12; its drafts are one-hot), and with CPU overlap
(sampling deferred behind the step in flight's ledger)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from specserve import SamplingParams
from tests.engine.conftest import make_llm
from tests.structured.schemas import SCHEMAS

MAX_TOKENS = 48  # every schema completes in < 40 tokens on the tiny model


SOME = len(SCHEMAS)  # the draft model runs them all too
SAMPLED = 12  # seeded sampling (its per-row counter RNG is the CPU's slowest op) the first 12


def _run(llm, n: int = len(SCHEMAS), **kw):
    # the schema itself in the prompt: n-gram drafts copy its keys, so drafts get verified
    prompts = [f"Reply with JSON for {json.dumps(s)}:" for s in SCHEMAS[:n]]
    params = [
        SamplingParams(
            max_tokens=MAX_TOKENS,
            structured_outputs={"json": s, "disable_any_whitespace": True},
            **kw,
        )
        for s in SCHEMAS[:n]
    ]
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _check(llm, outs) -> int:
    """Every completed output validates; every cut one is a prefix the grammar accepts.
    Returns how many completed."""
    done = 0
    for schema, out in zip(SCHEMAS, outs):  # outs: the first len(outs) schemas
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
    n = len(SCHEMAS) if mode == "ngram" else SOME
    before = llm.get_metrics()["spec_draft_tokens"]
    outs = _run(llm, n, temperature=0.0)
    assert [o.token_ids for o in outs] == [o.token_ids for o in greedy_off[:n]]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in greedy_off[:n]]
    assert llm.get_metrics()["spec_draft_tokens"] > before  # drafts were verified


def test_seeded_sampling_identical_with_ngram(off, ngram):
    kw = dict(temperature=1.0, seed=11)
    ref = _run(off, SAMPLED, **kw)
    _check(off, ref)
    outs = _run(ngram, SAMPLED, **kw)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_overlap_defers_structured_sampling_and_matches(greedy_off):
    """CPU overlap (the forward in a worker thread, the ledger one step late): a request with
    a grammar needs its tokens on the host before its next mask, so each step queues its
    forward behind the step in flight and its sampling after that step's ledger; the outputs
    are those of the synchronous engine."""
    llm = make_llm(max_num_seqs=64, overlap=True, debug_invariants=True)
    outs = _run(llm, temperature=0.0)
    assert [o.token_ids for o in outs] == [o.token_ids for o in greedy_off]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in greedy_off]
    assert llm.engine.num_deferred_steps > 0 and llm.engine.num_sync_steps == 0
