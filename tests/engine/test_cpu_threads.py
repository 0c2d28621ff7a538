"""Intra-op thread sizing of CPU engines ($SPECSERVE_CPU_THREADS, engine/cpu_threads.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specserve import env
from specserve.engine.cpu_threads import apply_cpu_threads, available_cores, cpu_threads


@pytest.mark.parametrize(
    ("setting", "cores", "want"),
    [("auto", 1, 1), ("auto", 2, 1), ("auto", 16, 15), ("keep", 8, None), ("3", 2, 3)],
)
def test_thread_count_leaves_a_core_to_the_host_loop(setting, cores, want) -> None:
    assert cpu_threads(setting, cores) == want


@pytest.mark.parametrize("setting", ["0", "-2", "many"])
def test_bad_settings_name_the_variable(setting: str) -> None:
    with pytest.raises(ValueError, match="SPECSERVE_CPU_THREADS|invalid literal"):
        cpu_threads(setting, 4)


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_apply_sets_torch_threads_for_cpu_engines_only(restore_threads) -> None:
    with env.override(cpu_threads="auto"):
        apply_cpu_threads("cpu")
        assert torch.get_num_threads() == max(1, available_cores() - 1)
    torch.set_num_threads(1)
    with env.override(cpu_threads="keep"):
        apply_cpu_threads("cpu")
        assert torch.get_num_threads() == 1
    with env.override(cpu_threads="2"):
        apply_cpu_threads("cuda:0")  # a CUDA engine's host threads are left alone
        assert torch.get_num_threads() == 1
        apply_cpu_threads("cpu")
        assert torch.get_num_threads() == 2


def test_an_engine_built_on_the_cpu_gets_the_count(restore_threads) -> None:
    from tests.engine.conftest import make_llm

    torch.set_num_threads(1)
    with env.override(cpu_threads="2"):
        llm = make_llm(max_num_seqs=2)
    assert torch.get_num_threads() == 2
    out = llm.generate([[5, 6, 7]], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0


def test_on_own_thread_hands_back_the_result_the_error_and_the_settings(restore_threads) -> None:
    import contextvars
    import threading

    from specserve.engine.cpu_threads import on_own_thread

    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    var.set("the caller's")
    torch.set_num_threads(2)
    seen = on_own_thread(lambda: (threading.get_ident(), torch.get_num_threads(), var.get()))
    assert seen[0] != threading.get_ident() and seen[1:] == (2, "the caller's")
    err = ValueError("from the build")

    def fail() -> None:
        raise err

    with pytest.raises(ValueError) as got:
        on_own_thread(fail)
    assert got.value is err


# The threads a CPU engine's build leaves in the process, measured in a fresh interpreter:
# OpenMP keeps a pool of helper threads for every thread that ran a parallel region.
_THREADS_LEFT = """
import os, sys, time, torch
torch.set_num_threads(2)
from specserve.config import EngineConfig
from specserve.llm_engine import LLMEngine, build_engine
count = lambda: len(os.listdir("/proc/self/task"))
before = count()
cfg = EngineConfig(model="dummy:smollm2-135m", max_num_seqs=2, max_model_len=256,
                   kv_cache_memory_gb=0.05, device="cpu")
engine = build_engine(cfg, progress=False) if sys.argv[1] == "own" else LLMEngine(cfg, progress=False)
deadline = time.time() + 5
while count() > before and time.time() < deadline:  # helpers of an ended thread exit soon
    time.sleep(0.05)
print(count() - before)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_building_a_cpu_engine_leaves_the_caller_no_openmp_pool() -> None:
    """build_engine builds a CPU engine on a thread that ends with the build, so the thread
    that steps it (the server's engine thread, the overlap worker) holds the only OpenMP pool.
    Negative control: the engine built on the caller's thread leaves it a helper thread."""
    import subprocess
    import sys

    def left(how: str) -> int:
        run = subprocess.run(
            [sys.executable, "-c", _THREADS_LEFT, how],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=Path(__file__).resolve().parents[2],  # the repository: specserve imports from it
        )
        assert run.returncode == 0, run.stderr[-2000:]
        return int(run.stdout.split()[-1])

    assert left("own") == 0
    assert left("caller") > 0
