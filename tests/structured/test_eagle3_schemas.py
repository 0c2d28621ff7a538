"""JSON schemas under EAGLE-3 speculation: every schema, greedy, on a 4-layer tiny target
(EAGLE-3 needs 3 distinct target layers) with a head in the vLLM format written by the test.
Every completed output validates with jsonschema, every cut one is a prefix the grammar accepts,
and the tokens equal those with speculation off; drafts were proposed, cut by the grammar where
invalid, verified, and some accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.model.config import ModelConfig
from tests.engine.conftest import make_llm
from tests.speculative.eagle3_heads import _copy_head, tiny_target
from tests.structured.schemas import SCHEMAS
from tests.structured.test_json_schemas import _check, _run

N = len(SCHEMAS)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[str, ModelConfig]:
    return tiny_target(tmp_path_factory.mktemp("e3schemas"))


@pytest.fixture(scope="module")
def greedy_ref(target):
    off = make_llm(model=target[0], max_num_seqs=64)
    outs = _run(off, N, temperature=0.0)
    assert _check(off, outs) >= 0.8 * N  # most complete: the comparison is not vacuous
    return outs


def test_greedy_schemas_identical_with_eagle3(tmp_path: Path, target, greedy_ref):
    # the majority-token head (lm_head over the outputs' common tokens): a random one is
    # almost never right, this one is often enough that accepts of several lengths happen
    head = _copy_head(tmp_path / "head", target, [o.token_ids for o in greedy_ref])
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    llm = make_llm(
        model=target[0], max_num_seqs=64, speculative_config={**spec, "verify_budget": "off"}
    )
    drafter, proposed = llm.engine.drafter, []
    orig = drafter.propose

    def spy(seqs, limits):
        out = orig(seqs, limits)
        proposed.extend(len(d) for d, _ in out)
        return out

    drafter.propose = spy
    outs = _run(llm, N, temperature=0.0)
    assert [o.token_ids for o in outs] == [o.token_ids for o in greedy_ref]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in greedy_ref]
    assert _check(llm, outs) >= 0.8 * N
    m = llm.get_metrics()
    assert m["spec_drafts"] > 0
    # the grammar cut some drafts (with the budget off nothing else does) and kept others
    assert 0 < m["spec_draft_tokens"] < sum(proposed)
    assert m["spec_accepted_tokens"] > 0
