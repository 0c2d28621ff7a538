"""The sampler's exponential race on the CPU in one compiled pass (cpu_race.cpp): sample()'s
token for every sampling row (filtered or not: a zero-probability token scores 0), where torch
spends ~0.3 ms a row of 49k tokens on the uniforms' hashing and logs. The same token as torch's
race but where two scores agree to within about an ulp (the log rounds once, in double).

Built on first use by ops/cpu_build.py; no compiler: one warning, the torch ops.
`SPECSERVE_FUSED_OPS=0` turns it off with the other compiled CPU ops.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from specserve import env
from specserve.ops import cpu_build
from specserve.ops.random import row_keys

_SOURCE = Path(__file__).with_name("cpu_race.cpp")
_ABI_VERSION = 1


def _setup(lib: ctypes.CDLL) -> None:
    if lib.specserve_cpu_race_version() != _ABI_VERSION:
        raise RuntimeError("cpu_race library has a different ABI version")
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.specserve_race_rows.argtypes = [p, i64, i32, i32, p, p, i32]
    lib.specserve_race_rows.restype = None
    lib.specserve_race_noise.argtypes = [i64, i32, p]
    lib.specserve_race_noise.restype = None


_kernel = cpu_build.LazyKernel(_SOURCE, _setup, "the torch race")


def race(
    probs: torch.Tensor,  # [N, V]
    seed: torch.Tensor,  # [N] int64
    counter: torch.Tensor,  # [N] int64
    salt: int,
) -> torch.Tensor | None:
    """[N] int64 argmax_c probs[c] / -log(u_c), or None where the kernel does not apply."""
    if not (
        env.settings.fused_ops
        and probs.device.type == "cpu"
        and probs.dtype == torch.float32
        and probs.dim() == 2
        and probs.stride(-1) == 1
        and probs.shape[0] > 0
        and probs.shape[1] > 0
    ):
        return None
    lib = _kernel.get()
    if lib is None:
        return None
    keys = row_keys(seed, counter, salt).contiguous()
    out = torch.empty(probs.shape[0], dtype=torch.int64)
    n, v = probs.shape
    lib.specserve_race_rows(
        probs.data_ptr(), probs.stride(0), n, v, keys.data_ptr(), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def noise(seed: int, counter: int, salt: int, width: int) -> torch.Tensor:
    """[width] float32 -log(u) of one row as the kernel computes it (tests)."""
    lib = _kernel.get()
    assert lib is not None
    key = row_keys(torch.tensor([seed]), torch.tensor([counter]), salt)
    out = torch.empty(width, dtype=torch.float32)
    lib.specserve_race_noise(int(key), width, out.data_ptr())
    return out
