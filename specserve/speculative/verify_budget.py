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

import itertools
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from specserve.speculative.step_cost import StepCostCurve


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


SMALL = 40  # candidates up to which the plain loop beats numpy's per-call overhead (~40 us)


def _choose_loop(
    confidences: Sequence[Sequence[float]],
    base_rows: int,
    step_time: Callable[[int], float],
    max_rows: int,
) -> BudgetChoice:
    n_req = len(confidences)
    items = []  # (-survival, position, request): survivals(), the same arithmetic (1.0 * c == c)
    for i, conf in enumerate(confidences):
        if conf and (min(conf) < 0.0 or max(conf) > 1.0):
            conf = [min(max(c, 0.0), 1.0) for c in conf]  # drafters' confidences rarely need it
        for j, a in enumerate(itertools.accumulate(conf, operator.mul)):
            if a <= 0.0:
                break  # later drafts survive with probability 0 too
            items.append((-a, j, i))
    # largest survival first; ties to the earlier position so a request's choice stays a prefix,
    # then to the earlier request
    items.sort()
    cap = max(0, min(len(items), max_rows - base_rows))
    stop_lists = getattr(step_time, "stop_lists", None)
    if stop_lists is not None:  # cached by the curve: no per-step pricing
        rows, times = stop_lists(base_rows, base_rows + cap)
        ms = [r - base_rows for r in rows]
    else:
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
    lens = list(map(len, confidences))
    if sum(lens) <= SMALL:
        return _choose_loop(confidences, base_rows, step_time, max_rows)
    n_req = len(confidences)
    width = max(lens)
    if width == 0:
        return BudgetChoice([0] * n_req, float(n_req), base_rows, step_time(base_rows))
    # one conversion; -1 marks "no draft" (sorted last, as a zero survival)
    if min(lens) == width:
        flat_in = np.fromiter(itertools.chain.from_iterable(confidences), np.float64, n_req * width)
    else:
        pad = [-1.0] * width
        flat_in = np.fromiter(
            itertools.chain.from_iterable(
                c if n == width else [*c, *pad[n:]] for c, n in zip(confidences, lens)
            ),
            np.float64,
            n_req * width,
        )
    conf = flat_in.reshape(n_req, width)
    # ufuncs and their methods rather than np.clip / np.cumprod / np.cumsum / np.argsort: the
    # same arithmetic without numpy's Python-level wrappers (~1-3 us each; this runs every step)
    surv = np.multiply.accumulate(np.minimum(np.maximum(conf, 0.0), 1.0), axis=1)  # [n_req, width]
    surv[conf < 0.0] = -1.0
    # position-major (index = position * n_req + request): a stable sort on -survival leaves
    # ties in (position, request) order, i.e. earlier positions first (a request's choice stays
    # a prefix), then earlier requests. Zero survivals (that draft and all later ones are out)
    # and missing drafts sort after every positive one and are cut off.
    flat = surv.T.ravel()
    order = (-flat).argsort(kind="stable")[: int(np.count_nonzero(flat > 0.0))]
    a, req = flat[order], order % n_req
    cap = max(0, min(len(a), max_rows - base_rows))
    stop_values = getattr(step_time, "stop_values", None)
    if stop_values is not None:
        rows, times = stop_values(base_rows, base_rows + cap)
        ms = rows - base_rows
    else:
        ms = np.asarray(_candidates(step_time, base_rows, cap), dtype=np.int64)
        rows = base_rows + ms
        many = getattr(step_time, "many", None)
        times = many(rows) if many is not None else np.array([step_time(int(r)) for r in rows])
    # [cap + 1] summed in order, then the candidates' entries
    tokens = np.add.accumulate(np.concatenate(([float(n_req)], a[:cap])))[ms]
    if np.minimum.reduce(times) > 0:
        rate = tokens / times
    else:
        with np.errstate(divide="ignore"):
            rate = np.where(times > 0, tokens / np.where(times > 0, times, 1.0), np.inf)
    best = len(rate) - 1 - int(rate[::-1].argmax())  # the last maximum: verify more on ties
    best_m = int(ms[best])
    num_verify = np.bincount(req[:best_m], minlength=n_req).tolist()
    return BudgetChoice(num_verify, float(tokens[best]), base_rows + best_m, float(times[best]))


class OffsetCurve:
    """A step-cost curve plus a constant, as the chooser asks for it: the curve's cached
    candidate totals (a constant moves no total's rank) with the constant added."""

    def __init__(self, curve: StepCostCurve, add: float) -> None:
        self.curve, self.add = curve, add

    def __call__(self, rows: int) -> float:
        return self.curve(rows) + self.add

    def stop_values(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        rows, f = self.curve.stop_values(lo, hi)
        return rows, f + self.add

    def stop_lists(self, lo: int, hi: int) -> tuple[list[int], list[float]]:
        rows, f = self.curve.stop_lists(lo, hi)
        add = self.add
        return rows, [t + add for t in f]
