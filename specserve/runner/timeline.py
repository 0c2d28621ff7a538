"""Device timeline of steps: how long the device sat idle between consecutive steps.

Each launched step is bracketed by two CUDA events on the compute stream, recorded when the host
starts and finishes queueing it. The device timestamps an event when it reaches it in the
stream, so the start event of step N+1 reads the end time of step N if the host queued it in
time, and a later time if the device had run dry: the difference is the device's idle time
between the two steps. Off by default (no events, no cost); CUDA only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class TimelineSummary:
    num_steps: int
    wall_ms: float  # device time from the first step's start to the last step's end
    busy_ms: float  # sum of step spans (start event to end event)
    idle_ms: float  # sum of gaps between one step's end and the next one's start

    @property
    def idle_fraction(self) -> float:
        return self.idle_ms / self.wall_ms if self.wall_ms > 0 else 0.0


class StepTimeline:
    def __init__(self, device: torch.device) -> None:
        self.enabled = False
        self._cuda = device.type == "cuda"
        # (start, end, tag, kind): tag as begun, kind as ended (what the step turned out to be)
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event | None, str, str]] = []
        # host clock at each begin(), and where the engine went idle (idle()): a step's host
        # span ends at the next of either
        self._launched: list[float] = []
        self._idle: list[float] = []

    def start(self) -> None:
        """Record the steps launched from now on (clears earlier records)."""
        self.enabled = self._cuda
        self._events, self._launched, self._idle = [], [], []

    def stop(self) -> None:
        self.enabled = False

    def begin(self, tag: str = "") -> None:
        if self.enabled:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events.append((ev, None, tag, tag))
            self._launched.append(time.perf_counter())

    def end(self, kind: str | None = None) -> None:
        if self.enabled and self._events and self._events[-1][1] is None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            start, _, tag, begun = self._events[-1]
            self._events[-1] = (start, ev, tag, kind or begun)

    def idle(self) -> None:
        """The engine has no more work for now: the last step's host span ends here, not at the
        next launch (the runs of a benchmark that interleaves engines)."""
        if self.enabled:
            self._idle.append(time.perf_counter())

    def by_kind(self) -> dict[str, tuple[int, float, float]]:
        """Per kind each step ended as: its steps, their device milliseconds (start event to end
        event) and their host milliseconds from launch to the next step's launch or idle() (the
        step's share of the run's wall time). Waits for the device."""
        done = [(i, s, e, k) for i, (s, e, _, k) in enumerate(self._events) if e is not None]
        if done:
            done[-1][2].synchronize()
        out: dict[str, tuple[int, float, float]] = {}
        t, idle = self._launched, np.asarray(self._idle)
        for i, s, e, k in done:
            n, ms, wall = out.get(k, (0, 0.0, 0.0))
            ends = [t[i + 1]] if i + 1 < len(t) else []
            ends += idle[idle > t[i]][:1].tolist()
            gap = (min(ends) - t[i]) * 1e3 if ends else 0.0
            out[k] = (n + 1, ms + s.elapsed_time(e), wall + gap)
        return out

    def summary(self, tag: str | None = None) -> TimelineSummary:
        """Idle time between consecutive recorded steps; with a tag, only steps of that tag and
        gaps between two adjacent ones of it (e.g. the steady decode steps). Waits for the
        device."""
        done = [(s, e, t) for s, e, t, _ in self._events if e is not None]
        if not done:
            return TimelineSummary(0, 0.0, 0.0, 0.0)
        done[-1][1].synchronize()
        mine = [i for i, (_, _, t) in enumerate(done) if tag is None or t == tag]
        busy = sum(done[i][0].elapsed_time(done[i][1]) for i in mine)
        idle = 0.0
        for i in mine:
            if i + 1 < len(done) and (tag is None or done[i + 1][2] == tag):
                idle += max(0.0, done[i][1].elapsed_time(done[i + 1][0]))
        return TimelineSummary(len(mine), busy + idle, busy, idle)
