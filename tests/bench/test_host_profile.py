"""`specserve bench host-profile`: phase clocks and an end-to-end run on dummy:tiny."""

from __future__ import annotations

import json
import threading

import pytest

from specserve.bench import host_profile
from specserve.bench.host_profile import PhaseClock
from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.outputs import TokenOutput


class FakeTimer:
    """Advances only when told: phase times are exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Work:
    def __init__(self, timer: FakeTimer) -> None:
        self.timer = timer

    def outer(self) -> None:
        self.timer.now += 1.0
        self.inner()
        self.timer.now += 2.0

    def inner(self) -> None:
        self.timer.now += 10.0

    def failing(self) -> None:
        self.timer.now += 5.0
        raise ValueError("boom")


def test_phase_clock_exclusive_times_and_unwrap() -> None:
    timer = FakeTimer()
    work = Work(timer)
    clock = PhaseClock(timer)
    clock.wrap(work, "outer", "a")
    clock.wrap(work, "inner", "b")
    clock.wrap(Work, "failing", "c")
    work.outer()
    work.inner()
    with pytest.raises(ValueError):
        work.failing()
    assert dict(clock.totals) == {"a": 3.0, "b": 20.0, "c": 5.0}
    clock.unwrap()
    assert "outer" not in vars(work) and Work.failing.__name__ == "failing"
    assert not hasattr(Work.failing, "__wrapped__")
    work.outer()
    assert dict(clock.totals) == {"a": 3.0, "b": 20.0, "c": 5.0}


def test_phase_clock_ignores_other_threads() -> None:
    timer = FakeTimer()
    work = Work(timer)
    clock = PhaseClock(timer)
    clock.wrap(work, "inner", "b")
    t = threading.Thread(target=work.inner)
    t.start()
    t.join()
    assert clock.totals["b"] == 0.0
    work.inner()
    assert clock.totals["b"] == 10.0


@pytest.mark.parametrize(
    ("consumer", "layout", "overlap"),
    [("generate", "bucket", False), ("stream", "eager", True), ("engine", "bucket", False)],
)
def test_end_to_end(tmp_path, consumer: str, layout: str, overlap: bool) -> None:
    path = tmp_path / "host.json"
    argv = ["--batch-sizes", "1,3", "--input-len", "5", "--steps", "3", "--consumer", consumer,
            "--layout", layout, "--stop", "zz", "--json", str(path)]  # fmt: skip
    argv.append("--overlap" if overlap else "--no-overlap")
    args = host_profile.argparse.ArgumentParser()
    host_profile.add_args(args)
    report = host_profile.run(args.parse_args(argv), emit=lambda _: None)
    assert json.loads(path.read_text())["results"] == json.loads(json.dumps(report["results"]))
    assert report["overlap"] is overlap and report["bucket_layout"] is (layout == "bucket")
    for r, batch in zip(report["results"], (1, 3)):
        # max_tokens = warm-up + 3: the third timed step finishes every request (overlap: the
        # step after it, the ledger one step late)
        assert r["batch"] == batch and r["steps"] == 3 + overlap
        assert r["tokens_per_step"] == batch  # one token per request per step
        # the instrumented methods are the ones the engine calls
        for phase in ("schedule", "prepare", "plan", "ledger"):
            assert r["phases_us"][phase] > 0, phase
        for phase in ("ledger", "detokenize", "outputs"):
            assert r["ledger_split_mean_us"][phase] > 0, phase
        assert r["host_cpu_us"]["median"] > 0 and r["device_us"] > 0
    # every wrapper is gone again
    assert not hasattr(IncrementalDetokenizer.append, "__wrapped__")
    assert not hasattr(TokenOutput.clone, "__wrapped__")


@pytest.mark.parametrize("overlap", [False, True], ids=["host-drafts", "device-drafts"])
def test_speculation_is_profiled(overlap: bool) -> None:
    """Golden drafts that always match: steps emit more than a token a request; drafting on the
    host is its own phase, on the device it is part of the device's time. The verify budget is
    off: whether drafting pays is its choice from measured step costs (timing, not profiling)."""
    spec = (
        '{"method": "golden", "num_speculative_tokens": 3, "acceptance_rate": 1.0, '
        '"verify_budget": "off"}'
    )
    argv = ["--batch-sizes", "2", "--input-len", "5", "--steps", "9", "--speculative-config",
            spec, "--overlap" if overlap else "--no-overlap"]  # fmt: skip
    args = host_profile.argparse.ArgumentParser()
    host_profile.add_args(args)
    (r,) = host_profile.run(args.parse_args(argv), emit=lambda _: None)["results"]
    assert r["tokens_per_step"] > 2  # 2 requests, drafts accepted
    assert (r["phases_us"]["draft"] > 0) is not overlap
