"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start
while its predecessor in the stream still runs; it waits (griddepcontrol.wait) before it reads
anything the predecessor wrote. At batch 1 every kernel of a layer is short, so each one's launch
and ramp-up otherwise sit between two memory-bound GEMVs (H200, a one-row layer chain: 123 us
with cuBLAS, 115 us with Triton GEMVs under PDL).

A kernel opts in with a `GDC: tl.constexpr` flag: when set it calls `gdc_launch_dependents()`
(its successor may launch) and `gdc_wait()` before its first read of a predecessor's output, and
its launcher passes `launch_pdl=True`. `launch_options` gives both. Kernels launched without
the flag keep plain stream order, so kernels with and without PDL mix freely.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

from specserve import env


@functools.lru_cache(maxsize=8)
def _supported(device_index: int) -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    import triton.language as tl

    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


def pdl_enabled(x: torch.Tensor) -> bool:
    """True when kernels on x's device may be launched with PDL: CUDA, compute capability >= 9,
    a triton with griddepcontrol, and `env.settings.pdl` (read per call; a captured CUDA graph
    keeps what it was captured with)."""
    return (
        x.is_cuda
        and env.settings.pdl
        and _supported(x.device.index if x.device.index is not None else 0)
    )


def launch_options(x: torch.Tensor) -> dict[str, Any]:
    """Keyword arguments for a GDC-aware kernel launch over tensors like x."""
    return {"GDC": True, "launch_pdl": True} if pdl_enabled(x) else {"GDC": False}
