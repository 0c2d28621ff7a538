"""Intra-op threads of a CPU engine ($SPECSERVE_CPU_THREADS), sized as vLLM's CPU backend does:
every core the process may run on but one, which stays free for the host loop (scheduling, the
ledger, detokenizing; with overlap, the thread that builds the next step while the forward runs).

Why: torch's default is one OpenMP thread per core. Each op then splits over all cores and waits
at a barrier for the slowest thread, so the moment anything else wants a core (the host loop of
this very engine under overlap, or another process on a shared machine) the op waits for a
descheduled thread. On the 2-core box this project runs on, two threads against one, interleaved
in one process (tools/cpu_ab.py, median of 5 ratios), see docs/cpu.md.

Set once, when a CPU engine is built and before it is (the overlap worker copies the caller's
count; the step-cost cache is keyed by it). torch's setting is process-wide: the last CPU engine
built decides.
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from specserve import env

T = TypeVar("T")


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def cpu_threads(setting: str, cores: int) -> int | None:
    """Threads for `setting` ("auto", "keep", or a count) on `cores` cores; None: leave torch's."""
    if setting == "keep":
        return None
    if setting == "auto":
        return max(1, cores - 1)
    n = int(setting)
    if n < 1:
        raise ValueError(f"SPECSERVE_CPU_THREADS must be auto, keep or >= 1, got {setting!r}")
    return n


def apply_cpu_threads(device: str) -> None:
    """Size torch's intra-op threads for an engine about to be built on `device`."""
    kind = device.partition(":")[0]
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        return
    n = cpu_threads(env.settings.cpu_threads, available_cores())
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)


def on_own_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a thread that ends with it (torch's thread count and the caller's context
    variables carried over); its result, or its exception raised here.

    Why: under OpenMP every thread that runs a parallel region keeps a pool of helper threads
    for good, and once two threads' pools hold more threads than there are cores, libgomp stops
    spinning at its barriers, so each of a CPU step's many short regions waits for a futex
    wake-up. An engine built on the caller's thread and stepped on another (the server's engine
    thread, the overlap worker) ran 2.6x slower for it: 61 against 160 tok/s at batch 1, the
    default model, the 2-core EPYC. Built here, the build's pool ends with its thread, and the
    thread that steps the engine holds the only one."""
    threads = torch.get_num_threads()
    ctx = contextvars.copy_context()
    box: dict[str, Any] = {}

    def run() -> None:
        torch.set_num_threads(threads)  # per thread under OpenMP
        try:
            box["out"] = ctx.run(fn, *args)
        except BaseException as e:  # handed to the caller
            box["err"] = e

    t = threading.Thread(target=run, name="specserve-build", daemon=True)
    t.start()
    t.join()
    if "err" in box:
        raise box["err"]
    return box["out"]
