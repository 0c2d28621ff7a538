"""The verify budget (confidence-scheduled verification, after DSpark).

Every step, choose how many of its drafts each request verifies so that expected tokens per
second is maximal: sum_i (1 + sum_{j <= m_i} a[i][j]) / step_time(base_rows + sum_i m_i), where
a[i][j] = prod_{l <= j} c[i][l] is the survival of draft j of request i.

Survival never grows along a request's drafts (confidences are <= 1), so for any total M the best
rows are the M largest survivals overall, and taking them is always a prefix per request (ties go
to the earlier position). The chooser scores every M from 0 to the cap against the step-cost curve
and keeps the best: no greedy early stop, since measured curves are jagged (on a padded curve,
only the top of each bucket can win: more rows at the same time only bring more tokens).

Monotone: with a non-decreasing cost curve (StepCostCurve gives one) scaling all survivals up by a
common factor never lowers the chosen total. Raising one request's confidences alone *can* lower
it (more expected tokens per step makes extra rows for others relatively less worth their cost):
that is throughput-optimal, not a bug.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np


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


SMALL = 64  # candidates up to which the plain loop beats numpy's per-call overhead


def _choose_loop(
    confidences: Sequence[Sequence[float]],
    base_rows: int,
    step_time: Callable[[int], float],
    max_rows: int,
) -> BudgetChoice:
    n_req = len(confidences)
    items = []  # (-survival, position, request): survivals() inlined, the same arithmetic
    for i, conf in enumerate(confidences):
        a = 1.0
        for j, c in enumerate(conf):
            a *= min(max(c, 0.0), 1.0)
            if a <= 0.0:
                break  # later drafts survive with probability 0 too
            items.append((-a, j, i))
    # largest survival first; ties to the earlier position so a request's choice stays a prefix,
    # then to the earlier request
    items.sort()
    cap = max(0, min(len(items), max_rows - base_rows))
    ms = _candidates(step_time, base_rows, cap)
    values = getattr(step_time, "values", None)
    totals = [base_rows + m for m in ms]
    times = values(totals) if values is not None else [step_time(r) for r in totals]
    best_m, best_rate, best_tokens, best_time = 0, -1.0, float(n_req), times[0]
    tokens, taken = float(n_req), 0
    for m, t in zip(ms, times):
        while taken < m:
            tokens -= items[taken][0]
            taken += 1
        rate = tokens / t if t > 0 else float("inf")
        if rate >= best_rate:  # >=: among equal rates prefer verifying more
            best_m, best_rate, best_tokens, best_time = m, rate, tokens, t
    num_verify = [0] * n_req
    for _a, _j, i in items[:best_m]:
        num_verify[i] += 1
    return BudgetChoice(num_verify, best_tokens, base_rows + best_m, best_time)


def _candidates(step_time: Callable[[int], float], base_rows: int, cap: int) -> Sequence[int]:
    """The numbers of drafts worth scoring, ascending: all of 0..cap, or where the curve says
    only some totals can win (stops(): a padded curve's bucket tops)."""
    stops = getattr(step_time, "stops", None)
    totals = stops(base_rows, base_rows + cap) if stops is not None else None
    return range(cap + 1) if totals is None else [t - base_rows for t in totals]


def choose_verify_budget(
    confidences: Sequence[Sequence[float]],
    base_rows: int,
    step_time: Callable[[int], float],
    max_rows: int,
) -> BudgetChoice:
    """confidences[i][j]: confidence of draft j of decode request i (the drafts it could verify).
    base_rows: rows the step runs anyway (1 per decode request + prefill chunk rows).
    max_rows: the step's token budget; drafts beyond it are never chosen.

    It runs every step: a Python loop for a few candidates, numpy for many (the same arithmetic
    in the same order, so both give the same choice)."""
    if sum(len(c) for c in confidences) <= SMALL:
        return _choose_loop(confidences, base_rows, step_time, max_rows)
    n_req = len(confidences)
    width = max((len(c) for c in confidences), default=0)
    if width == 0:
        return BudgetChoice([0] * n_req, float(n_req), base_rows, step_time(base_rows))
    # one conversion (a numpy assignment per request cost ~1 us each); -1 marks "no draft"
    conf = np.array(
        [c if len(c) == width else [*c, *[-1.0] * (width - len(c))] for c in confidences],
        dtype=np.float64,
    )
    present = conf >= 0.0
    surv = np.cumprod(np.clip(conf, 0.0, 1.0), axis=1)  # [n_req, width] survivals
    keep = present & (surv > 0.0)  # a zero survival: that draft and all later ones are out
    req, pos = np.nonzero(keep)
    a = surv[req, pos]
    # largest survival first; ties to the earlier position (a request's choice stays a
    # prefix), then to the earlier request
    order = np.lexsort((req, pos, -a))
    a, req = a[order], req[order]
    cap = max(0, min(len(a), max_rows - base_rows))
    ms = np.asarray(_candidates(step_time, base_rows, cap), dtype=np.int64)
    # [cap + 1] summed in order, then the candidates' entries
    tokens = np.cumsum(np.concatenate(([float(n_req)], a[:cap])))[ms]
    rows = base_rows + ms
    many = getattr(step_time, "many", None)
    times = many(rows) if many is not None else np.array([step_time(int(r)) for r in rows])
    with np.errstate(divide="ignore"):
        rate = np.where(times > 0, tokens / np.where(times > 0, times, 1.0), np.inf)
    best = int(np.flatnonzero(rate == rate.max())[-1])  # among equal rates verify more
    best_m = int(ms[best])
    num_verify = np.bincount(req[:best_m], minlength=n_req).tolist()
    return BudgetChoice(num_verify, float(tokens[best]), base_rows + best_m, float(times[best]))
