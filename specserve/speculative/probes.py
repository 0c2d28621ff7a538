"""Probes: when speculation that lost to plain decoding is measured again.

While plain decoding wins, no synchronous step runs, so speculation's price is never re-measured
(a CPU run stayed paused at ~1,700 tok/s where the same setup had speculated at 2,400-2,600: its
synchronous prices came from a slow spell). When plain wins by less than the budget's doubt and
speculation's newest step is old enough, the next PROBE_STEPS trims keep the speculative choice,
and their steps replace the old synchronous measurements (the budget renews its curve and host
overhead when a probe starts).

What a probe costs where plain is right: on the H200 at R = 0.5, C = 64 its 4 synchronous steps
ran ~14 % below plain, and entering and leaving it exposed two steps' host work (~2.3 ms each):
~2 % every 128 steps, ~0.5 % every 512 by that count. Sweeps said more (runs with probes at
0.93-0.98 of plain decoding, the session-11 sweep without them at 0.994), so a probe that
confirms plain decoding doubles the wait before the next one at its load, up to
PROBE_AFTER_MAX; speculation winning there on its own starts the wait over.
"""

from __future__ import annotations

from specserve.speculative.host_overhead import load_range

PROBE_AFTER = 512  # steps without speculation before the first probe at a load
PROBE_AFTER_MAX = 8 * PROBE_AFTER
PROBE_STEPS = 4


class ProbeSchedule:
    def __init__(self) -> None:
        self.count = 0  # probes started (a metric)
        self.left = 0  # trims left in the current probe
        self.last_spec_step = 0  # the step id of the newest step that verified drafts
        # steps without speculation before the next probe, by load range (PROBE_AFTER if absent)
        self._after: dict[int, int] = {}

    def spec_ran(self, step: int) -> None:
        self.last_spec_step = step

    def take(self, step: int, num_ready: int, near: bool) -> tuple[bool, bool]:
        """Plain decoding has just won a trim for `num_ready` requests (near: by a margin a
        probe could flip). Returns (probe: keep the speculative choice, fresh: a new probe starts
        with this trim and the synchronous measurements are to be renewed)."""
        fresh = False
        if not self.left:
            r = load_range(num_ready)
            wait = self._after.get(r, PROBE_AFTER)
            if not near or step - self.last_spec_step < wait:
                return False, False
            self._after[r] = min(2 * wait, PROBE_AFTER_MAX)
            self.left = PROBE_STEPS
            self.count += 1
            fresh = True
        self.left -= 1
        return True, fresh

    def not_overruled(self, num_ready: int, speculates: bool) -> None:
        """The chooser's own verdict stood (no plain-decoding overrule): a probe's step is spent
        anyway, and where it speculates the waits at this load start over."""
        if self.left:
            self.left -= 1
        if speculates and self._after:
            self._after.pop(load_range(num_ready), None)
