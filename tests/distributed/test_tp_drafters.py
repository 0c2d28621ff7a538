"""Model drafters under tensor parallelism run on rank 0 alone: an EAGLE-3 head (on the target's
captured hidden states, with a replicated copy of the vocabulary-parallel embedding) and a
separate draft model (a full replica on rank 0). Greedy outputs equal TP=1 without speculation."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve import SamplingParams
from specserve.model.config import ModelConfig
from tests.distributed.conftest import close
from tests.engine.conftest import make_llm, prompts_of
from tests.speculative.eagle3_heads import LAYERS, _copy_head, tiny_target

SP = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
KV = {"kv_cache_memory_gb": 0.05}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ModelConfig]:
    return tiny_target(tmp_path_factory.mktemp("tp_e3target"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_of([5, 12, 30, 9], seed=11)


@pytest.fixture(scope="module")
def ref(target, prompts) -> list[list[int]]:
    off = make_llm(model=target[0], **KV)
    return [o.outputs[0].token_ids for o in off.generate(prompts, SP, use_tqdm=False)]


def _run(target, prompts, spec: dict) -> tuple[list[list[int]], int, int]:
    llm = make_llm(model=target[0], tensor_parallel_size=2, speculative_config=spec, **KV)
    try:
        outs = llm.generate(prompts, SP, use_tqdm=False)
    finally:
        close(llm)
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    return [o.outputs[0].token_ids for o in outs], drafted, accepted


def test_eagle3_head_on_rank0(target, prompts, ref, tmp_path: Path) -> None:
    assert LAYERS == [0, 2, 3]
    head = _copy_head(tmp_path / "copy", target, ref)
    spec = {
        "method": "eagle3",
        "model": str(head),
        "num_speculative_tokens": 3,
        "verify_budget": "off",
    }
    got, drafted, accepted = _run(target, prompts, spec)
    assert got == ref
    assert drafted > 0 and accepted > 0


def test_separate_draft_model_on_rank0(target, prompts, ref) -> None:
    spec = {
        "method": "draft_model",
        "model": "dummy:tiny",
        "num_speculative_tokens": 2,
        "verify_budget": "off",
    }
    got, drafted, _ = _run(target, prompts, spec)
    assert got == ref
    assert drafted > 0
