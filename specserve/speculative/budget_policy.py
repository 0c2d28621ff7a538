"""Applies the verify budget to the drafts of the next step: takes the step-cost curve from the
start-up calibration (calibration.py), records every step's time, and trims each request's
drafts to the prefix the chooser picks."""

from __future__ import annotations

import bisect
import statistics
import time
from collections import Counter, deque
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING

from specserve.engine.sequence import Sequence
from specserve.runner.cuda_graph import capture_sizes
from specserve.speculative.calibration import StartupCalibration
from specserve.speculative.host_overhead import HostOverhead
from specserve.speculative.period_bias import PeriodBias
from specserve.speculative.probes import ProbeSchedule
from specserve.speculative.step_cost import ENGINE_REFRESH_EVERY, StepCostCurve
from specserve.speculative.verify_budget import (
    BudgetChoice,
    OffsetCurve,
    choose_verify_budget,
    survivals,
)

if TYPE_CHECKING:
    from specserve.llm_engine import LLMEngine

# every EXPLORE_EVERY-th step verifies all drafts whatever the chooser says: the curve and the
# acceptance estimates only learn from steps that run, so a pessimistic start (a curve measured on
# a busy machine, the prior confidences) would otherwise never be corrected
EXPLORE_EVERY = 16
EXPLORE_MIN_ROWS = 8
# ... and every step explores while a drafter's learned confidences rest on fewer verifications
# than this. Confidences learned from outcomes (n-gram) confirm themselves when low: a cold
# engine's first verifications (the benchmark's warm-up: 5 first drafts, none accepted) put the
# first draft at 1/7 where 0.78 was true (CPU, HumanEval, 64 requests); no draft was kept, and
# one exploring step in 16 took 50 steps - half the run - to correct it, decoding plain meanwhile
EXPLORE_UNTIL_SAMPLES = 32
# an unmeasured plain price is doubted (and measured with one pause) while speculation beats it
# by less than this: start-up plain prices ran ~18 % above real overlapped steps on the H200
PLAIN_DOUBT = 0.35
# (the mirror case, speculation's price never re-measured while plain wins, is probes.py's)

_TOKEN_IDS = attrgetter("token_ids")


class VerifyBudgetPolicy:
    def __init__(self, engine: LLMEngine, cache_root: Path | None) -> None:
        self.engine = engine
        k = engine.slot_pool.k
        max_rows = engine.max_num_batched_tokens
        calibration = StartupCalibration(engine)
        buckets = capture_sizes(min(max_rows, engine.config.max_num_seqs * (1 + k)))
        curve = calibration.load_or_calibrate(buckets, cache_root)
        # Plain decoding can run overlapped (host work hidden) when no request verifies drafts,
        # so "no speculation at all" is priced with its own curve: start-up values of
        # decode-shaped synthetic steps (device time plus one sync), then real overlapped steps
        # (the time between consecutive readbacks, which is what such a step costs in steady
        # state). A plain step has one row per request: buckets up to max_num_seqs rows.
        plain = None
        if engine.overlap_when_paused:
            top = bisect.bisect_left(buckets, engine.config.max_num_seqs)
            plain = calibration.load_or_calibrate(
                buckets[: top + 1], cache_root, True, (curve.kv_cost, curve.req_cost)
            )
        for c in (curve, plain):
            if c is not None:
                c.refresh_every = ENGINE_REFRESH_EVERY
        self._setup(engine, max_rows, curve, plain)

    @classmethod
    def from_curves(
        cls,
        engine: LLMEngine,
        max_rows: int,
        curve: StepCostCurve,
        plain: StepCostCurve | None = None,
    ) -> VerifyBudgetPolicy:
        """A policy over given curves (no start-up calibration): tests, offline analysis."""
        policy = cls.__new__(cls)
        policy._setup(engine, max_rows, curve, plain)
        return policy

    def _setup(
        self,
        engine: LLMEngine,
        max_rows: int,
        curve: StepCostCurve,
        plain: StepCostCurve | None,
    ) -> None:
        self.engine, self.max_rows, self.curve, self.plain = engine, max_rows, curve, plain
        self.plain_chosen = 0  # trims that chose plain overlapped decoding over any speculation
        self.plain_explored = 0  # trims that paused to measure plain decoding at a new load
        self.plain_ahead = 0  # trims that kept nothing for the load being admitted (_plain_ahead)
        self.probes = ProbeSchedule()  # re-measuring speculation while plain wins
        # the speculative choice the last _choose overruled for plain decoding, or None
        self._overruled: BudgetChoice | None = None
        # the last trim's verdict kept drafts on its own merits (not a probe's or exploration's)
        self.verdict_speculates = False
        # host seconds the drafter takes per step (recent median; a metric: the sync overhead
        # below includes it)
        self._draft_times: deque[float] = deque(maxlen=32)
        self._trim_times: deque[float] = deque(maxlen=32)  # host seconds of recent trim() calls
        # host seconds a synchronous step adds to its launch-to-readback time, by load
        self.host_overhead = HostOverhead()
        # real / predicted periods of synchronous and of overlapped plain steps (period_bias.py):
        # they scale the two prices when speculation as a whole is weighed against plain
        self.sync_bias, self.plain_bias = PeriodBias(), PeriodBias()
        # the confidences of the last round that drafted (one list per request): what the end
        # of a pause is priced with (keeps_pausing)
        self._last_round: list[list[float]] = []
        self._explore_from = 0  # the request exploration starts at (they take turns)
        self.expected_accepted = 0.0  # sum of the survivals of the rows chosen
        self.chosen_rows = 0
        self.offered_rows = 0
        # requests by drafts kept (a metric: their query length is 1 + that); the trims' lists
        # are counted in prepare(), off the critical path
        self._kept_counts: Counter[int] = Counter()
        self._uncounted: list[list[int]] = []
        self._calls = 0
        # the speculative over the plain rate the last choice saw (None: not weighed)
        self._spec_over_plain: float | None = None
        self._last_range: tuple[int, int] | None = None  # the totals the chooser last priced

    def record_step(self, rows: int, seconds: float, kv_tokens: int, requests: int) -> None:
        self.curve.record(rows, seconds, kv_tokens, requests)

    def record_draft_time(self, seconds: float) -> None:
        self._draft_times.append(seconds)

    @property
    def draft_time(self) -> float:
        return statistics.median(self._draft_times) if self._draft_times else 0.0

    @property
    def trim_time(self) -> float:
        return statistics.median(self._trim_times) if self._trim_times else 0.0

    def record_sync_overhead(self, seconds: float, requests: int) -> None:
        self.host_overhead.record(seconds, requests)

    @property
    def sync_overhead(self) -> float:
        """The host overhead at the load of the newest synchronous step (a metric)."""
        return self.host_overhead.latest

    def record_sync_period(self, rows: int, seconds: float, kv_tokens: int, requests: int) -> None:
        """A synchronous step's whole period (launch-to-readback plus the host work after it)."""
        # the bias only weighs speculation against plain decoding, and only against real
        # medians: a start-up price (or one awaiting renewal) is off by its own error, which the
        # curve corrects in 3 steps
        if self.plain is not None and self.curve.current(rows):
            predicted = self.curve.at(rows, kv_tokens, requests) + self.host_overhead.at(requests)
            self.sync_bias.record(seconds, predicted)

    def record_plain_step(self, rows: int, seconds: float, kv_tokens: int, requests: int) -> None:
        if self.plain is not None:
            # predicted before the step joins the curve: out of sample, like the sync periods
            if self.plain.observed(rows):
                self.plain_bias.record(seconds, self.plain.at(rows, kv_tokens, requests))
            self.plain.record(rows, seconds, kv_tokens, requests)

    def prepare(self) -> None:
        """Work the next trim would otherwise do, done ahead while the device is busy
        (StepTimer.flush): rebuild stale curves and price the totals the chooser asked for last
        (the same requests decoding ask for the same range)."""
        self._count_kept()
        self.curve.refresh()
        if self._last_range is not None:
            self.curve.stop_lists(*self._last_range)
        if self.plain is not None:
            self.plain.refresh()

    def _count_kept(self) -> None:
        for keep in self._uncounted:
            self._kept_counts.update(keep)
        self._uncounted.clear()

    def seqlens_q(self) -> dict[int, int]:
        """How often each query length (1 + drafts kept) was chosen for a request, over all
        trims so far."""
        self._count_kept()
        return {m + 1: n for m, n in sorted(self._kept_counts.items())}

    # -- the choice -----------------------------------------------------------------------------
    def _kv_tokens(self, ready: list[Sequence]) -> int:
        """Context tokens the next step's decode requests read (drafts and prefill chunks
        left out: the same for every candidate, or small)."""
        if not self.curve.kv_cost:
            return 0
        # map/attrgetter (no Python frame per request): at 64 requests the generator over the
        # num_tokens property was a third of the whole decision's host time
        return sum(map(len, map(_TOKEN_IDS, ready)))

    def _choose(
        self, usable: list[list[float]], num_ready: int, kv: int, count: bool = True
    ) -> BudgetChoice:
        """The chooser over the synchronous curve, then speculation as a whole against plain
        overlapped decoding (num_verify all 0 when plain wins).

        The rows are priced as a decode-only step of the requests decoding (one row each plus
        their drafts): prompt chunks sharing the step are left out. The scheduler serves running
        requests in admission order before new prompts, so drafts of requests already decoding
        mostly come before the prompt chunks: where prompt work fills the token budget a draft
        row displaces a prompt row to a later step, and where it does not, the prompt rows are
        work the run does anyway. Either way a draft row costs the run one row. (Priced next to
        the prompt rows, every draft looked cheap; capped at the budget the prompt rows left,
        none was verified while prompts were coming in.)"""
        base = num_ready
        # A synchronous step's period is its launch-to-readback time (the curve) plus the host
        # work around it (scheduling, ledger, drafting, the caller): the chooser prices whole
        # periods, or extra rows would look dearer than they are next to that fixed cost. The
        # context and per-request terms are fixed too: the requests do not change with the rows.
        host = self.host_overhead.at(num_ready)
        period = OffsetCurve(self.curve, host + self.curve.fixed(kv, num_ready))
        choice = choose_verify_budget(usable, base, period, self.max_rows)
        if count:
            self._spec_over_plain = self._overruled = None
            drafts = sum(map(len, usable))
            self._last_range = (base, base + max(0, min(drafts, self.max_rows - base)))
        if self.plain is not None and any(choice.num_verify):
            # one token per decode request in an overlapped step of `base` rows (its curve holds
            # whole periods: host work hidden), against the speculative step's period
            # each price at the level of its real steps' mean (period_bias.py)
            plain_time = self.plain.at(base, kv, num_ready) * self.plain_bias.factor
            spec_time = choice.step_time * self.sync_bias.factor
            spec_over_plain = (choice.expected_tokens / spec_time) / (num_ready / plain_time)
            if count:
                self._spec_over_plain = spec_over_plain
            if spec_over_plain <= 1.0:
                if count:
                    self._overruled = choice
                return choice._replace(
                    num_verify=[0] * len(usable), expected_tokens=float(num_ready)
                )
        return choice

    def trim(
        self, ready: list[Sequence], drafts: list[list[int]], confs: list[list[float]]
    ) -> list[int]:
        """How many drafts each ready request verifies next step."""
        t0 = time.perf_counter()
        base = len(ready)  # the rows the choice is priced from (_choose)
        lens = list(map(len, drafts))
        # drafters hand out as many confidences as drafts; slice only where one does not
        usable = confs if list(map(len, confs)) == lens else [c[:n] for c, n in zip(confs, lens)]
        self._last_round = usable  # requests without drafts are left out when it is read
        kv = self._kv_tokens(ready)
        choice = self._choose(usable, base, kv)
        step = self._next_step()
        self.verdict_speculates = False
        if self._overruled is None and any(choice.num_verify) and self._plain_ahead(usable, kv):
            choice = choice._replace(num_verify=[0] * base, expected_tokens=float(base))
            self.plain_ahead += 1
        elif self._overruled is not None:
            if self._probe(step, base):
                choice = self._overruled
            else:
                self.plain_chosen += 1
        else:
            self.verdict_speculates = any(choice.num_verify)
            self.probes.not_overruled(base, self.verdict_speculates)
        keep = choice.num_verify
        self._calls += 1
        if self._calls % EXPLORE_EVERY == 0 or self._confidences_young():
            # every draft of some requests, up to a quarter of the step's rows more: deep draft
            # positions the choice skips get verified (acceptance estimates learn only from
            # verified drafts) and the curve is measured past the choice, while staying cheap at
            # high load (every draft of 256 requests would be a 5x step). Requests take turns.
            room = max(0, self.max_rows - base - sum(keep))
            keep = self._explore(usable, keep, min(room, max(EXPLORE_MIN_ROWS, base // 4)))
            choice = choice._replace(
                expected_tokens=len(ready)
                + sum(sum(survivals(c[:m])) for c, m in zip(usable, keep))
            )
        elif (
            self._calls % EXPLORE_EVERY == EXPLORE_EVERY // 2
            and any(keep)
            and self._overruled is None
            and self._spec_over_plain is not None
            and self._spec_over_plain < 1.0 + PLAIN_DOUBT
            and self._plain_unmeasured(base)
        ):
            # Plain decoding at this load has never run: its price is the start-up one
            # (synthetic steps, each with a sync: 6.0 ms at 64 rows on the H200 where overlapped
            # steps take 5.1). Weighed against that, speculation can win every step, and then
            # no plain step ever runs to correct it. One pause (its overlapped steps are
            # recorded) measures it; the end of the pause asks again with the measured price.
            # Only where that error could flip the verdict: at R = 0.8, C <= 16 speculation
            # wins 2x and a pause would cost its steps for nothing.
            keep = [0] * len(keep)
            choice = choice._replace(num_verify=keep, expected_tokens=float(len(ready)))
            self.plain_explored += 1
        if any(keep):
            self.probes.spec_ran(step)
        self.offered_rows += sum(lens)
        self.chosen_rows += sum(keep)
        self._uncounted.append(keep)
        self.expected_accepted += choice.expected_tokens - len(ready)
        self._trim_times.append(time.perf_counter() - t0)
        return keep

    def _next_step(self) -> int:
        """The id of the step being drafted for (0 for a test's stand-in scheduler)."""
        return getattr(self.engine.scheduler, "step_id", -1) + 1

    def _probe(self, step: int, num_ready: int) -> bool:
        """Plain decoding has just won: does this trim keep the speculative choice anyway, to
        re-measure it (probes.py)? A new probe renews the synchronous measurements: the curve's
        windows and the host overhead are replaced by the probe's steps."""
        near = self._spec_over_plain is not None and (
            self._spec_over_plain * (1.0 + PLAIN_DOUBT) >= 1.0
        )
        probe, fresh = self.probes.take(step, num_ready, near)
        if fresh:
            self.curve.renew()
            self.host_overhead.renew()
        return probe

    @property
    def spec_probes(self) -> int:
        return self.probes.count

    def _imminent_load(self, num_ready: int) -> int:
        """The requests that will be decoding within a few steps: the running ones (decoding or
        prefilling) and the waiting ones the scheduler can admit (room under max_num_seqs, KV
        blocks free for their prompts), up to max_num_seqs. Asked while drafting, before the
        next schedule(): prompts that fit one step complete in it, so right after a step the
        load being admitted is all in `waiting` (the H200 sweep at C = 256: 64 decoding, 192
        waiting, none prefilling). Waiting requests that memory keeps out do not count."""
        sched = self.engine.scheduler
        load = max(num_ready, len(sched.running))
        waiting = sched.waiting
        if not waiting or load >= sched.max_num_seqs:
            return load
        bm = sched.bm
        per_prompt = max(1, bm.blocks_needed(waiting[0].num_tokens + 1))
        admissible = min(len(waiting), bm.num_free_blocks // per_prompt)
        return min(sched.max_num_seqs, load + admissible)

    def _plain_ahead(self, usable: list[list[float]], kv: int) -> bool:
        """Speculation wins at the requests decoding now, but prompts being admitted will raise
        the load within a few steps to where plain decoding wins: keep no drafts. On the H200
        (R = 0.8, 256 requests arriving at once, 64 prompts per step) the first 64 requests
        verified drafts through the ~4 prompt-filled steps: each such step ran synchronously,
        exposing the host work of a step full of prompt chunks (~7 ms), and its drafts delayed
        the admission of the rest by pushing prompt rows to later steps. Auto ran 1.5-2.7 %
        below plain decoding at that level."""
        num_ready = len(usable)
        if self.plain is None or num_ready == 0:
            return False
        load = self._imminent_load(num_ready)
        return load > num_ready and self._plain_wins_at(load, usable, kv * load // num_ready)

    def _plain_wins_at(self, load: int, rounds: list[list[float]], kv: int) -> bool:
        """Would the chooser keep no drafts for `load` decoding requests whose confidences are
        those of `rounds` (requests with drafts), taken in turn?"""
        last = [c for c in rounds if c]
        if not last:
            return False
        usable = [last[i % len(last)] for i in range(load)]
        return not any(self._choose(usable, load, kv, count=False).num_verify)

    def _plain_unmeasured(self, rows: int) -> bool:
        return self.plain is not None and not self.plain.observed(rows)

    def _confidences_young(self) -> bool:
        drafter = getattr(self.engine, "drafter", None)  # None: a test's stand-in engine
        samples = drafter.confidence_samples() if drafter is not None else None
        return samples is not None and samples < EXPLORE_UNTIL_SAMPLES

    def _explore(self, confs: list[list[float]], keep: list[int], extra: int) -> list[int]:
        """keep, plus all drafts of requests taken in turn (from where the last exploration
        stopped) while they fit in `extra` more rows: still a prefix per request."""
        out, n = list(keep), len(confs)
        last = None
        for t in range(n):
            i = (self._explore_from + t) % n
            more = len(confs[i]) - out[i]
            if 0 < more <= extra:
                out[i] += more
                extra -= more
                last = i
        if last is not None:
            self._explore_from = last + 1
        return out

    def keeps_pausing(self) -> bool:
        """At the end of a pause (overlapped plain steps): would the chooser still keep no drafts
        for the requests decoding now (or soon: _imminent_load)? Confidences come from the last
        round that drafted, the one that started the pause (up to 64 pauses old: speculator.py): its
        confidences, taken in turn over those requests, priced with the current curves. Asking
        this needs no drafts, so no synchronous step; False means "draft and ask for real" (also
        when that round had no drafts at all: only drafting can tell whether there are any now)."""
        ready = [s for s in self.engine.scheduler.running if s.num_uncomputed_tokens == 1]
        if not ready:
            return False
        load = self._imminent_load(len(ready))
        kv = self._kv_tokens(ready) * load // len(ready)
        return self._plain_wins_at(load, self._last_round, kv)
