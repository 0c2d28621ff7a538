"""fp32 GEMM for the CPU's linear layers over weights in 16-row panels (cpu_gemm.cpp).

Decode reads every weight once a step, so a CPU step is the weights' bandwidth plus a fixed
cost per call. The kernel streams each panel contiguously (no horizontal sums), costs a ctypes
call (~3 us) where oneDNN's matmul costs ~11 us and MKL's F.linear streams at a third of the
machine's bandwidth, and gives a row the same result whatever rows share its call.

Built on first use by ops/cpu_build.py; None from `kernel()` when it cannot be built (the caller
keeps another path).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from specserve.ops import cpu_build

_SOURCE = Path(__file__).with_name("cpu_gemm.cpp")
_ABI_VERSION = 1
LANES = 16


def _setup(lib: ctypes.CDLL) -> None:
    if lib.specserve_cpu_gemm_version() != _ABI_VERSION:
        raise RuntimeError("cpu_gemm library has a different ABI version")
    c = ctypes
    lib.specserve_cpu_gemm.argtypes = [
        c.c_void_p, c.c_int64, c.c_void_p, c.c_void_p, c.c_void_p,
        c.c_int64, c.c_int, c.c_int, c.c_int, c.c_int,
    ]  # fmt: skip
    lib.specserve_cpu_gemm.restype = c.c_int


_kernel = cpu_build.LazyKernel(_SOURCE, _setup, "oneDNN")


def kernel() -> ctypes.CDLL | None:
    return _kernel.get()


def to_panels(weight: torch.Tensor) -> torch.Tensor:  # [N, K] -> [ceil(N / 16), K, 16] fp32
    n, k = weight.shape
    p = -(-n // LANES)
    padded = torch.zeros(p * LANES, k, dtype=torch.float32)
    padded[:n] = weight.detach()
    return padded.view(p, LANES, k).transpose(1, 2).contiguous()


def from_panels(panels: torch.Tensor, n: int) -> torch.Tensor:  # -> [N, K]
    p, k, lanes = panels.shape
    return panels.transpose(1, 2).reshape(p * lanes, k)[:n].contiguous()


def gemm(
    lib: ctypes.CDLL,
    x: torch.Tensor,  # [M, K] fp32, last dim contiguous
    panels: torch.Tensor,  # [ceil(N / 16), K, 16]
    bias: torch.Tensor | None,  # [N] fp32
    n: int,
) -> torch.Tensor:  # [M, N]
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        lib.specserve_cpu_gemm(
            x.data_ptr(), x.stride(0), panels.data_ptr(),
            None if bias is None else bias.data_ptr(), y.data_ptr(), n,
            m, n, k, torch.get_num_threads(),
        )  # fmt: skip
    return y
