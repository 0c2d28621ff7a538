"""What the verify budget learns from the engine's own steps: each step's time as the chooser
prices it. A synchronous decode/verify step costs its launch-to-readback (the step-cost curve)
plus the host work around it up to the next step() (the sync overhead); an overlapped step in
steady state costs the time between consecutive readbacks (the plain curve). A synchronous
step's whole period (the two together) is also handed over, to measure how far real periods
run above their median-based price (period_bias.py).

Measurements are handed to the budget in flush(), which the engine calls while the device runs
the next step (before it waits for that step's readback): the curves' bookkeeping then costs
the step nothing, where at the readback it delayed the next launch (synchronous steps at batch
1: the host work between a readback and the next launch is on the critical path)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specserve.llm_engine import LaunchedStep
    from specserve.speculative.budget_policy import VerifyBudgetPolicy

# a synchronous step awaiting its overhead: (step() start, launch-to-readback, rows, context
# tokens, requests)
_SyncStep = tuple[float, float, int, int, int]


class StepTimer:
    def __init__(self, budget: VerifyBudgetPolicy) -> None:
        self.budget = budget
        # a synchronous decode step's (step() start, launch-to-readback, its rows, context
        # tokens, requests), its overhead taken at the next step()
        self._sync_period: _SyncStep | None = None
        self._candidate: _SyncStep | None = None  # this step()'s, until it ends
        # of the synchronous step just read: (launch-to-readback, rows, kv tokens, requests)
        self._launch_to_readback: tuple[float, int, int, int] | None = None
        self._last_readback: float | None = None  # when the last overlapped step was read back
        # (plain?, rows, seconds, kv tokens, requests) measured since the last flush()
        self._pending: list[tuple[bool, int, float, int, int]] = []
        # whole synchronous periods (rows, seconds, kv tokens, requests) since the last flush()
        self._periods: list[tuple[int, float, int, int]] = []

    def begin_step(self, t_start: float) -> None:
        if self._sync_period is not None:
            # Overlap hides host work only up to the device time of the step it runs beside:
            # what a synchronous step costs over an overlapped one is min(host work, that step).
            # Uncapped, one caller pause between steps (a benchmark running other engines)
            # priced every later speculative step seconds dearer.
            start, launch_to_readback, rows, kv, requests = self._sync_period
            host = min(t_start - start - launch_to_readback, launch_to_readback)
            self.budget.record_sync_overhead(host, requests)
            if host >= 0:
                self._periods.append((rows, launch_to_readback + host, kv, requests))
            self._sync_period = None

    def read_back(self, step: LaunchedStep) -> None:
        """A step's results have arrived. Only decode/verify steps price the curves: the chooser
        prices such steps, and a prefill chunk's rows cost far less per row (no per-row KV
        reads, big GEMMs), so folding them in made verify rows look cheap."""
        now = time.perf_counter()
        batch = step.batch
        kv = sum(batch.starts) + batch.num_rows  # context tokens its requests read
        shaped = batch.is_decode_shaped
        requests = len(step.seqs)
        if not step.overlapped and shaped:
            self._pending.append((False, batch.num_rows, now - step.t0, kv, requests))
            self._launch_to_readback = (now - step.t0, batch.num_rows, kv, requests)
        elif step.behind and self._last_readback is not None and shaped:
            # overlapped: a step's launch-to-readback also spans its predecessor; in steady
            # state the step costs the time between consecutive readbacks. Only a step that was
            # queued behind its predecessor: one launched after a flush (a drafting round that
            # kept nothing) ran with its host work exposed, and priced plain decoding 10 % too
            # dear (H200, R = 0.5, C = 64: auto speculated and lost 6 %)
            self._pending.append((True, batch.num_rows, now - self._last_readback, kv, requests))
        self._last_readback = now if step.overlapped else None

    def flush(self) -> None:
        """Record the steps measured since the last flush and let the budget refresh its curves
        (module docstring: the engine calls this while the device is busy)."""
        budget = self.budget
        for rows, seconds, kv, requests in self._periods:  # before the records below: the
            budget.record_sync_period(rows, seconds, kv, requests)  # prediction is out of sample
        self._periods.clear()
        for plain, rows, seconds, kv, requests in self._pending:
            if plain:
                budget.record_plain_step(rows, seconds, kv, requests)
            else:
                budget.record_step(rows, seconds, kv, requests)
        self._pending.clear()
        budget.prepare()

    def sync_step_processed(self, t_start: float, measured: bool) -> None:
        """The synchronous step of this step() is through the ledger. measured=False when the
        step() began by flushing the step in flight: its period holds that wait."""
        if self._launch_to_readback is not None and measured:
            # A synchronous step costs its whole period, up to the next step(): on top of
            # launch-to-readback (the curve) come scheduling, the ledger, drafting and the
            # caller's handling of the outputs, all hidden under overlap.
            self._candidate = (t_start, *self._launch_to_readback)
        self._launch_to_readback = None

    def end_step(self, unfinished: bool, drained: bool) -> None:
        """unfinished: requests are still running once this step()'s finished ones are
        forgotten (else the gap to the next step() is idle time, not overhead); drained:
        nothing is in flight (the next readback interval would include idle time)."""
        if self._candidate is not None and unfinished:
            self._sync_period = self._candidate
        self._candidate = None
        if drained:
            self._last_readback = None
