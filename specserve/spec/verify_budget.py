"""The verify budget (confidence-scheduled verification, after DSpark).

Every step, choose how many of its drafts each request verifies so that expected tokens per
second is maximal: sum_i (1 + sum_{j <= m_i} a[i][j]) / step_time(base_rows + sum_i m_i), where
a[i][j] = prod_{l <= j} c[i][l] is the survival of draft j of request i.

Survival never grows along a request's drafts (confidences are <= 1), so for any total M the best
rows are the M largest survivals overall, and taking them is always a prefix per request (ties go
to the earlier position). The chooser scores every M from 0 to the cap against the step-cost curve
and keeps the best: no greedy early stop, since measured curves are jagged.

Monotone: with a non-decreasing cost curve (StepCostCurve gives one) scaling all survivals up by a
common factor never lowers the chosen total. Raising one request's confidences alone *can* lower
it (more expected tokens per step makes extra rows for others relatively less worth their cost):
that is throughput-optimal, not a bug.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple


class BudgetChoice(NamedTuple):
    num_verify: list[int]  # m_i: drafts request i verifies (a prefix of its drafts)
    expected_tokens: float  # sum_i (1 + sum_{j < m_i} a[i][j])
    total_rows: int  # base_rows + sum m_i
    step_time: float


def survivals(confidences: Sequence[float]) -> list[float]:
    out, s = [], 1.0
    for c in confidences:
        s *= min(max(c, 0.0), 1.0)
        out.append(s)
    return out


def choose_verify_budget(
    confidences: Sequence[Sequence[float]],
    base_rows: int,
    step_time: Callable[[int], float],
    max_rows: int,
) -> BudgetChoice:
    """confidences[i][j]: confidence of draft j of decode request i (the drafts it could verify).
    base_rows: rows the step runs anyway (1 per decode request + prefill chunk rows).
    max_rows: the step's token budget; drafts beyond it are never chosen."""
    n_req = len(confidences)
    items = []  # (survival, position, request)
    for i, conf in enumerate(confidences):
        for j, a in enumerate(survivals(conf)):
            if a <= 0.0:
                break  # later drafts survive with probability 0 too
            items.append((a, j, i))
    # largest survival first; ties to the earlier position so a request's choice stays a prefix
    items.sort(key=lambda x: (-x[0], x[1]))
    cap = max(0, min(len(items), max_rows - base_rows))
    best_m, best_rate, best_tokens, best_time = 0, -1.0, float(n_req), step_time(base_rows)
    tokens = float(n_req)
    for m in range(cap + 1):
        if m > 0:
            tokens += items[m - 1][0]
        t = step_time(base_rows + m)
        rate = tokens / t if t > 0 else float("inf")
        if rate >= best_rate:  # >=: among equal rates prefer verifying more
            best_m, best_rate, best_tokens, best_time = m, rate, tokens, t
    num_verify = [0] * n_req
    for _a, _j, i in items[:best_m]:
        num_verify[i] += 1
    return BudgetChoice(num_verify, best_tokens, base_rows + best_m, best_time)
