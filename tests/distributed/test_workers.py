"""Worker lifetime: a killed worker ends the engine with a clear error (quickly, no hang), and
no worker outlives its engine: not after shutdown(), not after rank 0 is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from specserve import LLM, SamplingParams
from specserve.distributed import TensorParallelError
from tests.distributed.conftest import ENGINE, close, wait_gone

ROOT = Path(__file__).resolve().parents[2]


def test_killed_worker_is_a_clear_error_not_a_hang(uneven_llama_dir: Path) -> None:
    llm = LLM(str(uneven_llama_dir), tensor_parallel_size=2, **ENGINE)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        (pid,) = llm.engine.tp.worker_pids
        seen = 0
        with pytest.raises(TensorParallelError) as e:
            for _ in llm.stream(["hello", "good morning"], params):
                seen += 1
                if seen == 6:  # mid-generation; the next step may already be on its way
                    os.kill(pid, signal.SIGKILL)
                    t0 = time.monotonic()
        assert time.monotonic() - t0 < 10
        msg = str(e.value)
        assert f"rank 1 (pid {pid}) was killed by SIGKILL" in msg and "new one" in msg
        # the engine stays ended: the next step says so again
        with pytest.raises(TensorParallelError):
            llm.generate("again", params, use_tqdm=False)
    finally:
        close(llm)


def test_a_failing_worker_reports_its_error() -> None:
    import torch

    threads = torch.get_num_threads()
    llm = LLM("dummy:tiny", tensor_parallel_size=2, **ENGINE)
    try:
        llm.engine.tp.send(("no such command",))  # the worker raises on it, reports, exits
        with pytest.raises(TensorParallelError) as e:
            llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
        assert "rank 1" in str(e.value)
        assert "RuntimeError: unknown tensor-parallel command 'no such command'" in str(e.value)
    finally:
        close(llm)
    assert torch.get_num_threads() == threads  # rank 0's share of the cores is given back


def test_sizes_that_cannot_be_split_are_refused_and_stop_the_workers() -> None:
    import multiprocessing

    from specserve.sampling_params import InvalidRequestError

    before = set(multiprocessing.active_children())
    # dummy:tiny has 2 KV heads of 2 query heads each: 3 ranks cannot share them
    with pytest.raises(InvalidRequestError, match="2 KV heads with 2 query heads") as e:
        LLM("dummy:tiny", tensor_parallel_size=3, **ENGINE)
    assert e.value.param == "tensor_parallel_size"
    deadline = time.monotonic() + 15
    while set(multiprocessing.active_children()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(multiprocessing.active_children()) - before == set()


def test_workers_exit_when_rank0_is_killed(uneven_llama_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "rank0.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, signal
            from specserve import LLM, SamplingParams

            if __name__ == "__main__":
                llm = LLM({str(uneven_llama_dir)!r}, tensor_parallel_size=2, **{ENGINE!r})
                llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
                print(*llm.engine.tp.worker_pids, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no finalizers
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 1
    assert wait_gone(pids, 15) == [], "a worker outlived its killed engine"


class _FakePG:
    aborted = 0

    def abort(self) -> None:
        self.aborted += 1


@pytest.mark.parametrize("event", ["worker_dies", "shutdown"])
def test_watchdog_aborts_the_group_only_when_a_worker_dies(event: str) -> None:
    import multiprocessing as mp
    import threading

    from specserve.distributed.launcher import _watchdog

    worker_r, worker_w = mp.Pipe(duplex=False)  # stands in for a worker's exit sentinel
    stop_r, stop_w = mp.Pipe(duplex=False)
    pg = _FakePG()
    t = threading.Thread(target=_watchdog, args=([worker_r.fileno()], stop_r, pg))
    t.start()
    time.sleep(0.05)
    assert t.is_alive() and pg.aborted == 0
    (worker_w if event == "worker_dies" else stop_w).close()
    t.join(5)
    assert not t.is_alive()
    assert pg.aborted == (event == "worker_dies")
