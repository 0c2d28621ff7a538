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

import os

import torch

from specserve import env


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
