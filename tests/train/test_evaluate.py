"""Tokens per step from chain acceptances: greedy speculation walked by hand."""

from __future__ import annotations

import pytest

from specserve.train.evaluate import summarize, walk


def test_walk_by_hand() -> None:
    # 6 tokens to emit after the first answer token; a_t of each chain start row
    acc = [2, 0, 0, 3, 1, 0]
    # k=2: row0 accepts 2 -> emits 3, lands on row 3: accepts min(3,2)=2 -> emits the last 3
    assert walk(acc, 2) == (6, 2)
    # k=1: rows 0 (2 tok), 2 (1), 3 (2), 5 (1)
    assert walk(acc, 1) == (6, 4)
    # the last step is cut at the answer's end
    assert walk([5, 0, 0], 7) == (3, 1)
    assert walk([], 3) == (0, 0)


def test_summary_curves() -> None:
    rep = summarize([[2, 0, 0, 3, 1, 0]], k_max=3)
    assert rep.tokens_per_step[1] == pytest.approx(6 / 4)
    assert rep.tokens_per_step[2] == pytest.approx(6 / 2)
    # survival: P(a > i); acceptance: P(a > i | a >= i)
    assert rep.survival_per_position == pytest.approx([3 / 6, 2 / 6, 1 / 6])
    assert rep.acceptance_per_position == pytest.approx([3 / 6, 2 / 3, 1 / 2])
