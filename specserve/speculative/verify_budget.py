"""The verify budget: how many draft rows the next step verifies, and which ones.

A step of base_rows rows plus M draft rows yields n + (their survivals) tokens in expectation
and costs step_time(base_rows + M); `choose` keeps the M of the best rate (M = 0: a plain step).
A model drafter on the device also chooses whether to draft at all (`VerifyBudget.plan`).
docs/verify_budget.md has the why.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from specserve.runner.bucket_layout import capture_sizes
from specserve.speculative.step_cost import SWEEP_REPS, WINDOW, StepCostCurve, startup_curve

if TYPE_CHECKING:
    from specserve.llm_engine import LLMEngine

EXPLORE_EVERY = 16  # every such allot verifies one request's every draft: only rows run teach


class StepPlan(NamedTuple):
    keep: list[int]  # [n] drafts request i verifies in this step (of those in the pool)
    draft: bool  # the step's model drafter drafts (for the step after it)


class BudgetChoice(NamedTuple):
    num_verify: np.ndarray  # [n] int64: drafts request i verifies (a prefix of its drafts)
    total: int  # M: draft rows, sum of num_verify
    expected_tokens: float  # n + the survivals of the chosen rows
    step_time: float  # the curve's seconds for base_rows + M rows


def survivals(confidences: np.ndarray | Sequence[Sequence[float]]) -> np.ndarray:
    """[n, k] running products of the confidences, clamped to [0, 1] (NaN counts as 0)."""
    c = np.asarray(confidences, dtype=np.float64)  # where/minimum: clip's values, less host time
    return np.multiply.accumulate(np.where(c > 0.0, np.minimum(c, 1.0), 0.0), axis=-1)


def _in_room(surv: np.ndarray, room: Sequence[int] | None) -> np.ndarray:
    if room is None:
        return surv
    k = surv.shape[1]
    return np.where(np.arange(k)[None, :] < np.asarray(room)[:, None], surv, 0.0)


def choose(
    surv: np.ndarray,
    base_rows: int,
    step_times: Callable[[np.ndarray], np.ndarray],
    max_rows: int,
    room: np.ndarray | Sequence[int] | None = None,
) -> BudgetChoice:
    """The M maximising (n + sum of the M largest survivals [n, k]) / step_times(base_rows + M),
    within the step's max_rows and each request's room (its most drafts)."""
    surv = np.asarray(surv, dtype=np.float64)
    n, k = surv.shape
    surv = _in_room(surv, room)
    flat = surv.T.ravel()  # position-major (j * n + i): a stable sort puts ties in that order
    order = np.argsort(-flat, kind="stable")
    a = flat[order]
    cap = max(0, min(int(np.count_nonzero(a > 0.0)), max_rows - base_rows))
    tokens = n + np.concatenate(([0.0], np.cumsum(a[:cap])))  # [cap + 1]
    times = np.asarray(step_times(base_rows + np.arange(cap + 1)), dtype=np.float64)
    best = int(np.argmax(tokens / times))  # the first maximum: fewer rows on a tie
    num_verify = np.bincount(order[:best] % max(n, 1), minlength=n).astype(np.int64)
    return BudgetChoice(num_verify, best, float(tokens[best]), float(times[best]))


class VerifyBudget:
    def __init__(self, curve: StepCostCurve, max_rows: int, drafting: bool = False) -> None:
        self.curve, self.max_rows = curve, max_rows
        self.drafting = drafting  # a model drafter on the device: drafting itself is a choice
        self.num_drafting_steps = self.num_plain_steps = 0  # plans that drafted / did not
        self._plain_run = 0  # plans since the last that drafted
        self._backoff = 1  # the exploration interval, in EXPLORE_EVERY, while drafting loses
        self._exploring = False  # drafting to measure its yield afresh
        # recent steady drafting steps: (requests, tokens, seconds, seconds past the curve)
        self._yield: deque[tuple[int, int, float, float]] = deque(maxlen=WINDOW)
        self._pays: bool | None = None  # drafting_pays() of the current _yield
        self.offered_rows = 0  # draft rows of nonzero survival within room, offered to allot()
        self.chosen_rows = 0  # draft rows it chose
        self.expected_accepted = 0.0  # the survivals of the kept drafts
        self._kept: Counter[int] = Counter()  # requests by drafts kept
        self._calls = 0
        self._explore_from = 0  # the request the next exploration starts at

    @classmethod
    def for_engine(cls, engine: LLMEngine, cache_root: Path | None) -> VerifyBudget:
        """The engine's budget: the curve from the start-up sweep over its graph buckets."""
        rows = min(
            engine.max_num_batched_tokens, engine.config.max_num_seqs * (1 + engine.slot_pool.k)
        )
        curve = startup_curve(engine, capture_sizes(rows), cache_root)
        dd = engine.device_drafting
        return cls(
            curve, engine.max_num_batched_tokens, dd is not None and dd.model_drafter is not None
        )

    def observe_step(self, total_q: int, seconds: float) -> None:
        """A real decode/verify step that did not draft with a model drafter."""
        self.curve.observe(total_q, seconds)

    def observe_drafting(self, requests: int, tokens: int, rows: int, seconds: float) -> None:
        """A real steady drafting step: the tokens its requests emitted, its rows (anchors +
        drafts) and seconds."""
        self._yield.append((requests, tokens, seconds, seconds - self.curve(rows)))
        self._pays = None

    def chain_seconds(self) -> float:
        """What drafting adds to a step: the recent drafting steps' median seconds past the
        curve's price of their rows (0 before any)."""
        return max(0.0, statistics.median(y[3] for y in self._yield)) if self._yield else 0.0

    def drafting_pays(self) -> bool:
        """Did the recent drafting steps emit more tokens a second than plain steps of the same
        requests would, on the curve? Unmeasured: yes. Decided again only when a drafting step
        is measured, so a plain step's budget work stays a few lookups."""
        if not self._yield:
            return True
        if self._pays is None:
            reqs, tokens, seconds, _ = zip(*self._yield)
            plain = float(self.curve.times(np.asarray(reqs)).sum())
            self._pays = sum(tokens) / sum(seconds) > sum(reqs) / plain
        return self._pays

    def plan(
        self,
        conf: np.ndarray,
        base_rows: int,
        room: Sequence[int],
        has_drafts: np.ndarray,
        may_draft: bool,
    ) -> StepPlan:
        """A model drafter's step: whether it drafts (it pays, or it explores: after
        EXPLORE_EVERY * backoff plain plans, until SWEEP_REPS steps verified drafts; backoff
        doubles while drafting loses), and the drafts each request verifies of those it holds
        (has_drafts [n], conf [n, k]), a drafting step priced at the curve + chain_seconds()."""
        assert self.drafting
        if self._exploring and len(self._yield) >= SWEEP_REPS:
            self._exploring = False
        want = self._exploring or self.drafting_pays()
        if want and not self._exploring:
            self._backoff = 1
        elif not want and self._plain_run + 1 >= EXPLORE_EVERY * self._backoff:
            self._yield.clear()  # unmeasured: drafting_pays() is True again
            self._exploring, want = True, True
            self._backoff = min(2 * self._backoff, EXPLORE_EVERY)
        draft = may_draft and want
        self._plain_run = 0 if draft else self._plain_run + 1
        self.num_drafting_steps += draft
        self.num_plain_steps += not draft
        has = np.asarray(has_drafts, dtype=bool)
        if not has.any():  # between drafting steps every request holds none: nothing to price
            self._kept[0] += len(has)
            return StepPlan([0] * len(has), draft)
        held = np.where(has[:, None], _in_room(survivals(conf), room), 0.0)
        chain = self.chain_seconds() if draft else 0.0
        return StepPlan(
            self.allot(held, base_rows, times=lambda r: self.curve.times(r) + chain), draft
        )

    def allot(
        self,
        surv: np.ndarray,
        base_rows: int,
        room: Sequence[int] | None = None,
        times: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> list[int]:
        """The drafts each request verifies: choose() against the curve (or `times`) with the
        step priced as its decode rows' (prompt chunks beside them run anyway), exploration."""
        surv = _in_room(surv, room)
        if not surv.any():  # nothing to verify (a plain step): no choice to make or to explore
            self._kept[0] += surv.shape[0]
            return [0] * surv.shape[0]
        keep = choose(surv, base_rows, times or self.curve.times, self.max_rows).num_verify.tolist()
        self._calls += 1
        if self._calls % EXPLORE_EVERY == 0:
            self._explore(surv, keep, base_rows)
        kept = np.arange(surv.shape[1])[None, :] < np.asarray(keep, dtype=np.int64)[:, None]
        self.offered_rows += int(np.count_nonzero(surv > 0.0))
        self.chosen_rows += sum(keep)
        self.expected_accepted += float(surv[kept].sum())
        self._kept.update(keep)
        return keep

    def _explore(self, surv: np.ndarray, keep: list[int], base_rows: int) -> None:
        """All drafts of the next request in turn that has more, if they fit the step."""
        n, room = len(keep), self.max_rows - base_rows - sum(keep)
        for t in range(n):
            i = (self._explore_from + t) % n
            more = int(np.count_nonzero(surv[i] > 0.0)) - keep[i]
            if 0 < more <= room:
                keep[i] += more
                self._explore_from = i + 1
                return

    def seqlens_q(self) -> dict[int, int]:
        """How often each query length (1 + drafts kept) was chosen for a request."""
        return {m + 1: c for m, c in sorted(self._kept.items())}
