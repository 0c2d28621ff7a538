"""fp32 GEMM for the CPU's linear layers over weights in 16-row panels (cpu_gemm.cpp).

Decode reads every weight once a step, so a CPU step is the weights' bandwidth plus a fixed
cost per call. The kernel streams each panel contiguously (no horizontal sums), costs a ctypes
call (~3 us) where oneDNN's matmul costs ~11 us and MKL's F.linear streams at a third of the
machine's bandwidth, and gives a row the same result whatever rows share its call.

Weights whose values are all bf16 (checkpoints stored in bf16, an EAGLE-3 head's) are kept as
bf16 panels and widened in registers: half the bytes a step reads, the fp32 panels' result bit
for bit.

Built on first use by ops/cpu_build.py; None from `kernel()` when it cannot be built (the caller
keeps another path).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from specserve.ops import cpu_build

_SOURCE = Path(__file__).with_name("cpu_gemm.cpp")
_ABI_VERSION = 2
LANES = 16


# every GEMM entry point's C signature (cpu_gemm.cpp, cpu_qgemm.cpp): x, ldx, weights, bias,
# y, ldy, M, N, K, threads
GEMM_ARGTYPES = [
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
    ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
]  # fmt: skip


def declare(fn: ctypes._CFuncPtr) -> None:
    fn.argtypes, fn.restype = GEMM_ARGTYPES, ctypes.c_int


def _setup(lib: ctypes.CDLL) -> None:
    if lib.specserve_cpu_gemm_version() != _ABI_VERSION:
        raise RuntimeError("cpu_gemm library has a different ABI version")
    declare(lib.specserve_cpu_gemm)
    declare(lib.specserve_cpu_gemm_bf16)


_kernel = cpu_build.LazyKernel(_SOURCE, _setup, "oneDNN")


def kernel() -> ctypes.CDLL | None:
    return _kernel.get()


def bf16_exact(weight: torch.Tensor) -> bool:
    """Every value is a bf16 (a checkpoint stored in bf16, widened to fp32): its panels can be
    stored in bf16, read at half the bytes, with the same products."""
    w = weight.detach()
    return bool(torch.equal(w.to(torch.bfloat16).to(w.dtype), w))


def to_panels(
    weight: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:  # [N, K] -> [ceil(N / 16), K, 16] of dtype (fp32, or bf16 for bf16 values)
    n, k = weight.shape
    p = -(-n // LANES)
    padded = torch.zeros(p * LANES, k, dtype=dtype)
    padded[:n] = weight.detach()
    return padded.view(p, LANES, k).transpose(1, 2).contiguous()


def from_panels(panels: torch.Tensor, n: int) -> torch.Tensor:  # -> [N, K] fp32
    p, k, lanes = panels.shape
    return panels.transpose(1, 2).reshape(p * lanes, k)[:n].float().contiguous()


def gemm(
    lib: ctypes.CDLL,
    x: torch.Tensor,  # [M, K] fp32, last dim contiguous
    panels: torch.Tensor,  # [ceil(N / 16), K, 16] fp32 or bf16
    bias: torch.Tensor | None,  # [N] fp32
    n: int,
) -> torch.Tensor:  # [M, N]
    bf16 = panels.dtype == torch.bfloat16
    return call(lib.specserve_cpu_gemm_bf16 if bf16 else lib.specserve_cpu_gemm, x, panels, bias, n)


def call(
    fn: ctypes._CFuncPtr,  # a GEMM entry point (GEMM_ARGTYPES)
    x: torch.Tensor,  # [M, K] fp32
    weights: torch.Tensor,  # in fn's layout
    bias: torch.Tensor | None,  # [N] fp32
    n: int,
) -> torch.Tensor:  # [M, N] fp32
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        fn(
            x.data_ptr(), x.stride(0), weights.data_ptr(),
            None if bias is None else bias.data_ptr(), y.data_ptr(), n,
            m, n, k, torch.get_num_threads(),
        )  # fmt: skip
    return y
