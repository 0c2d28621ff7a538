"""The decoder's linear layers: cuBLAS, or at one row on a PDL-capable GPU a Triton GEMV.

Why: a batch-1 decode step is 32 layers x four weight reads, and at one row cuBLAS runs the
smaller ones (qkv, o_proj, down) at 2.6-3.7 TB/s against a 4.0 TB/s copy: each kernel ramps up
and drains alone. The GEMV loads its first weight tile before it waits for the previous kernel
(programmatic dependent launch), so that ramp overlaps the previous kernel's tail. Measured on
the H200 over a one-row chain of 32 distinct layers in a CUDA graph: 123.0 us per layer with
cuBLAS, 122.0 with the GEMV alone, 115.0 with the GEMV under PDL. Without PDL it is no faster
than cuBLAS, so it runs only where PDL does (`specserve.ops.pdl`); elsewhere, and for more than
one row, F.linear runs unchanged. `env.settings.gemv` ($SPECSERVE_GEMV=0) turns it off.

Safe to import without triton: the kernel module is imported on first use.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from specserve import env
from specserve.ops.pdl import pdl_enabled

BLOCK_N = 8  # outputs per program: the best on the H200 for every decoder shape swept
BLOCK_K = 256
# Split K until the grid holds about this many programs (H200: qkv 2 splits, o_proj and down 4,
# gate_up 1, the sweep's best per shape).
TARGET_PROGRAMS = 2048
MAX_SPLIT_K = 4


@functools.lru_cache(maxsize=1)
def _kernels() -> ModuleType:
    from specserve.ops import triton_gemv

    return triton_gemv


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GemvPlan:
    """Launch shape and workspace of one weight shape. The workspace is shared by every weight
    of that shape: the launches are ordered on one stream (under PDL a kernel touches it only
    after its wait), and the counters are back at zero after each launch."""

    def __init__(self, n: int, k: int, device: torch.device) -> None:
        blocks = _cdiv(n, BLOCK_N)
        split = 1
        while split < MAX_SPLIT_K and blocks * split * 2 <= TARGET_PROGRAMS:
            split *= 2
        self.n, self.k, self.split_k = n, k, split
        self.k_per = _cdiv(_cdiv(k, split), BLOCK_K) * BLOCK_K  # whole BLOCK_K tiles
        self.grid = (blocks, split)
        self.part = torch.empty(split, n, device=device, dtype=torch.float32)
        self.count = torch.zeros(blocks, device=device, dtype=torch.int32)


_plans: dict[tuple[int, int, torch.device], GemvPlan] = {}


def _plan(n: int, k: int, device: torch.device) -> GemvPlan:
    key = (n, k, device)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = GemvPlan(n, k, device)
    return plan


def gemv_eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and bias is None
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.is_contiguous()
        and weight.is_contiguous()
        and env.settings.gemv
        and pdl_enabled(x)
    )


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [1, K] x [N, K] -> [1, N]
    n, k = weight.shape
    assert x.shape == (1, k), (x.shape, weight.shape)
    plan = _plan(n, k, x.device)
    out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    _kernels()._gemv_kernel[plan.grid](
        x, weight, out, plan.part, plan.count,
        N=n, K=k, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=plan.split_k, K_PER=plan.k_per,
        GDC=True, launch_pdl=True, num_warps=4, num_stages=3,
    )  # fmt: skip
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the GEMV where it is faster (module docstring)."""
    if gemv_eligible(x, weight, bias):
        return gemv(x, weight)
    return F.linear(x, weight, bias)
