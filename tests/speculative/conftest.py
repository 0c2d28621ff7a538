"""Helpers shared by the verify-budget tests, and the EAGLE-3 tests' target and heads."""

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from specserve.model.config import ModelConfig
from specserve.speculative.step_cost import SWEEP_REPS, StepCostCurve
from tests.engine.conftest import make_llm, prompts_of
from tests.model.test_eagle3_format import write_tiny_head
from tests.speculative.eagle3_heads import (
    LAYERS,
    SP,
    _copy_head,
    _ids,
    _with_temperatures,
    tiny_target,
)


def curve_of(buckets: list[int], cost, padded: bool = False) -> StepCostCurve:
    """A start-up curve whose bucket prices are cost(rows)."""
    return StepCostCurve(buckets, [float(cost(b)) for b in buckets], padded)


def run_steps(curve: StepCostCurve, rows: int, cost, n: int = 1 + SWEEP_REPS) -> None:
    """n real steps of `rows` rows costing cost(rows) (the first is the bucket's warm-up; by
    default the rest are just enough to price the bucket)."""
    for _ in range(n):
        curve.observe(rows, float(cost(rows)))


def conf_matrix(confs: list[list[float]], k: int) -> np.ndarray:
    """[n, k] confidences, zero past each request's drafts."""
    return np.array([c + [0.0] * (k - len(c)) for c in confs], dtype=np.float64).reshape(-1, k)


class FixedDrafter:
    """A model-like drafter (its confidences come with its drafts) that proposes the same
    tokens every step, at one confidence."""

    has_q = False

    def __init__(self, tokens, confidence=0.5):
        self.tokens, self.confidence = tokens, confidence

    def propose(self, seqs, limits):
        return [(self.tokens[:k], [self.confidence] * min(k, len(self.tokens))) for k in limits]

    def observe(self, seq, nd, na):
        pass

    def release(self, seq):
        pass

    def plan_confidences(self, seq, k):
        return None


# -- EAGLE-3 (test_eagle3*.py): a tiny random Llama target, its greedy outputs with speculation
# off, and two heads. Package-scoped: built once for the three files, as it was for the one.
@pytest.fixture(scope="package")
def target(tmp_path_factory) -> tuple[str, ModelConfig]:
    return tiny_target(tmp_path_factory.mktemp("e3target"))


@pytest.fixture(scope="package")
def prompts() -> list[list[int]]:
    base = prompts_of([5, 12, 30, 3, 17, 9], seed=11)
    return base + [base[2][:20] + p for p in prompts_of([4, 8], seed=12)]  # shared prefixes


@pytest.fixture(scope="package")
def ref(target, prompts) -> list[list[int]]:
    off = make_llm(model=target[0])
    assert off.engine.target_model.aux_capture is None  # no head: no capture, no buffer
    return _ids(off.generate(prompts, SP, use_tqdm=False))


@pytest.fixture(scope="package")
def heads(tmp_path_factory, target, ref) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e3heads")
    counts = Counter(t for r in ref for t in r)
    ids = sorted({t for t, _ in counts.most_common(8)} | set(range(100, 140)))
    return {
        "copy": _copy_head(root / "copy", target, ref),
        "random": _with_temperatures(
            write_tiny_head(root / "random", target[1], ids, LAYERS, confidence=True)
        ),
    }
