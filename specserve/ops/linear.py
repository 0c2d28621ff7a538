"""The decoder's linear layers: a Triton GEMV at a few rows on CUDA, F.linear everywhere else.

Dispatch, per call: `specserve.ops.triton_gemv` when x is on CUDA in bf16/fp16 with at most
GEMV_MAX_ROWS rows, triton is importable and $SPECSERVE_GEMV is not "0" (read at call time; a
captured CUDA graph keeps the path it was captured with). Otherwise F.linear (cuBLAS on CUDA,
the CPU path unchanged).

Numerics: the GEMV accumulates in fp32 like cuBLAS but in a different order, so outputs may
differ from F.linear by bf16 rounding; silu_and_mul's roundings are reproduced exactly in the
gated form. Nothing here syncs, and the launch depends only on shapes (graph capturable).
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch
import torch.nn.functional as F

from specserve.ops.fused import silu_and_mul
from specserve.ops.triton_attention import use_triton

ENV_SWITCH = "SPECSERVE_GEMV"
GEMV_MAX_ROWS = 4


def gemv_enabled(x: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and os.environ.get(ENV_SWITCH, "1") != "0"
        and use_triton(x.device)
    )


# looked up per call, so a test can accept CPU tensors to run the kernel under TRITON_INTERPRET=1
_enabled = gemv_enabled


@functools.lru_cache(maxsize=1)
def _kernels() -> ModuleType:
    from specserve.ops import triton_gemv

    return triton_gemv


def _config(n: int, k: int) -> tuple[int, int, int, int] | None:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [n, k] weight, or None (use cuBLAS).

    At batch 1 every weight byte is read once, so the kernel must keep enough loads in flight on
    every SM: BLOCK_N is the largest that still gives >= 2 programs per SM of an H100/H200
    (132 SMs), BLOCK_K as wide as K allows (up to 512 bf16 = 1 KB per weight row per load)."""
    block_k = next((b for b in (512, 256, 128, 64) if k % b == 0), None)
    if block_k is None:
        return None
    block_n = 4
    for b in (32, 16, 8):
        if -(-n // b) >= 264:
            block_n = b
            break
    return block_n, block_k, 4, 3


def _gemv(x: torch.Tensor, weight: torch.Tensor, gated: bool) -> torch.Tensor | None:
    m = x.shape[0]
    n, k = weight.shape
    cfg = _config(n, k)
    if cfg is None or weight.stride(-1) != 1 or x.stride(-1) != 1 or weight.dtype != x.dtype:
        return None
    block_n, block_k, warps, stages = cfg
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    _kernels()._gemv_kernel[(-(-n // block_n),)](
        x, weight, out, m, n, x.stride(0), weight.stride(0),
        K=k, GATED=gated, BLOCK_M=1 << max(0, m - 1).bit_length(), BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    if bias is None and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and _enabled(x):
        out = _gemv(x, weight, gated=False)
        if out is not None:
            return out
    return F.linear(x, weight, bias)


def gated_linear(
    gate_up: torch.Tensor,  # [M, 2I]: gate columns, then up columns
    weight: torch.Tensor,  # [N, I]
) -> torch.Tensor:  # [M, N] = (silu(gate) * up) @ weight^T
    """The MLP's down projection with silu_and_mul folded in where the GEMV runs."""
    if gate_up.dim() == 2 and gate_up.shape[0] <= GEMV_MAX_ROWS and _enabled(gate_up):
        if weight.shape[1] * 2 == gate_up.shape[1]:
            out = _gemv(gate_up, weight, gated=True)
            if out is not None:
                return out
    return F.linear(silu_and_mul(gate_up), weight)
