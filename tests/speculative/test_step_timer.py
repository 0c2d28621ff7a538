"""The step timer turns step timestamps into the verify budget's measurements."""

import pytest

from specserve.engine.scheduler import StepBatch
from specserve.llm_engine import LaunchedStep
from specserve.speculative.step_timer import StepTimer


class _Budget:
    def __init__(self) -> None:
        self.sync, self.steps, self.plain, self.periods = [], [], [], []
        self.prepared = 0
        self.loads = []

    def prepare(self) -> None:
        self.prepared += 1

    def record_sync_overhead(self, s: float, requests: int) -> None:
        self.sync.append(s)
        self.loads.append(requests)

    def record_step(self, rows, seconds, kv, requests) -> None:
        self.steps.append((rows, seconds, kv, requests))

    def record_plain_step(self, rows, seconds, kv, requests) -> None:
        self.plain.append((rows, seconds, kv, requests))

    def record_sync_period(self, rows, seconds, kv, requests) -> None:
        self.periods.append((rows, seconds, kv, requests))


def _decode_step(t0: float, overlapped: bool, behind: bool, n: int = 2) -> LaunchedStep:
    batch = StepBatch(1, [None] * n, [1] * n, [0] * n, [True] * n, [[]] * n, starts=[10] * n)
    return LaunchedStep(batch, [None] * n, None, t0, overlapped, behind)


def test_sync_overhead_is_the_gap_to_the_next_step_capped_at_the_step(monkeypatch):
    budget = _Budget()
    timer = StepTimer(budget)
    clock = iter([1.004, 2.008])  # the readbacks of the two synchronous steps below
    monkeypatch.setattr("specserve.speculative.step_timer.time.perf_counter", lambda: next(clock))
    timer.begin_step(1.0)
    timer.read_back(_decode_step(1.0, overlapped=False, behind=False))
    timer.sync_step_processed(1.0, measured=True)
    timer.end_step(unfinished=True, drained=True)
    timer.begin_step(1.005)  # 1 ms after the 4 ms launch-to-readback
    assert budget.sync == [pytest.approx(0.001)] and budget.loads == [2]
    timer.flush()
    assert budget.steps == [(2, pytest.approx(0.004), 22, 2)]
    timer.read_back(_decode_step(2.0, overlapped=False, behind=False))
    timer.sync_step_processed(2.0, measured=True)
    timer.end_step(unfinished=True, drained=True)
    timer.begin_step(9.0)  # the caller stalled for seconds: counts one step's time at most
    assert budget.sync[-1] == pytest.approx(0.008)
    # whole periods (launch-to-readback + capped overhead) reach the budget at the next flush
    assert budget.periods == [(2, pytest.approx(0.005), 22, 2)]
    timer.flush()
    assert budget.periods[-1] == (2, pytest.approx(0.016), 22, 2)


@pytest.mark.parametrize("unfinished, measured", [(False, True), (True, False)])
def test_no_overhead_after_the_last_step_or_after_a_flush(unfinished, measured):
    budget = _Budget()
    timer = StepTimer(budget)
    timer.begin_step(1.0)
    timer.read_back(_decode_step(1.0, overlapped=False, behind=False))
    timer.sync_step_processed(1.0, measured=measured)
    timer.end_step(unfinished=unfinished, drained=True)
    timer.begin_step(50.0)
    timer.flush()
    assert budget.sync == [] and len(budget.steps) == 1


def test_plain_steps_are_timed_between_readbacks_of_steps_queued_behind_another(monkeypatch):
    budget = _Budget()
    timer = StepTimer(budget)
    clock = iter([1.010, 1.015, 1.030, 1.036])
    monkeypatch.setattr("specserve.speculative.step_timer.time.perf_counter", lambda: next(clock))
    timer.read_back(_decode_step(1.0, overlapped=True, behind=False))  # first: nothing before
    timer.read_back(_decode_step(1.001, overlapped=True, behind=True))  # 5 ms after it
    timer.read_back(_decode_step(1.016, overlapped=True, behind=False))  # after a flush: skipped
    timer.end_step(unfinished=True, drained=False)
    timer.read_back(_decode_step(1.017, overlapped=True, behind=True))  # 6 ms
    timer.flush()
    assert [round(s, 6) for _, s, _, _ in budget.plain] == [0.005, 0.006]
    timer.end_step(unfinished=True, drained=True)  # drained: the next interval is idle time
    monkeypatch.setattr("specserve.speculative.step_timer.time.perf_counter", lambda: 5.0)
    timer.read_back(_decode_step(4.0, overlapped=True, behind=True))
    timer.flush()
    assert len(budget.plain) == 2


def test_measurements_reach_the_budget_at_flush_in_order(monkeypatch):
    """The engine flushes while the device runs the next step: until then nothing is recorded,
    and a flush hands over every step measured since the last one, then lets the budget
    prepare its curves."""
    budget = _Budget()
    timer = StepTimer(budget)
    clock = iter([1.004, 1.010, 1.015])
    monkeypatch.setattr("specserve.speculative.step_timer.time.perf_counter", lambda: next(clock))
    timer.read_back(_decode_step(1.0, overlapped=False, behind=False))
    assert budget.steps == [] and budget.prepared == 0
    timer.read_back(_decode_step(1.005, overlapped=True, behind=False))
    timer.read_back(_decode_step(1.006, overlapped=True, behind=True))
    timer.flush()
    assert budget.steps == [(2, pytest.approx(0.004), 22, 2)]
    assert budget.plain == [(2, pytest.approx(0.005), 22, 2)]
    assert budget.prepared == 1
    timer.flush()  # nothing new: nothing recorded twice
    assert len(budget.steps) == 1 and len(budget.plain) == 1 and budget.prepared == 2
