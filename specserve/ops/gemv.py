"""The decoder's linear layers: cuBLAS, or at one row on a PDL-capable GPU a Triton GEMV.

Why: a batch-1 decode step is 32 layers x four weight reads, and at one row cuBLAS runs the
smaller ones (qkv, o_proj, down) at 2.6-3.7 TB/s against a 4.0 TB/s copy: each kernel ramps up
and drains alone. The GEMV loads its first weight tile before it waits for the previous kernel
(programmatic dependent launch), so that ramp overlaps the previous kernel's tail. Measured on
the H200 over a one-row chain of 32 distinct layers in a CUDA graph: 123.0 us per layer with
cuBLAS, 122.0 with the GEMV alone, 115.0 with the GEMV under PDL. Without PDL it is no faster
than cuBLAS, so it runs only where PDL does (`specserve.ops.pdl`); elsewhere, and for more than
one row, F.linear runs unchanged. `env.settings.gemv` ($SPECSERVE_GEMV=0) turns it off.

K <= WHOLE_K_MAX (every projection of a 135M-class model; all but down_proj of an 8B) is not
split: each program loads its whole weight slice before the wait, so after the previous kernel
only x is read and the sums are stored; no weight load and no cross-program reduction (a
counter round trip and a reload of partial sums) wait on it. Larger K keeps the split (a slice
would not fit in registers). `env.settings.gemv_whole_k` ($SPECSERVE_GEMV_WHOLE_K=0) splits
every K.

The MLP's gate_up projection at one row runs as one GLU GEMV (`gemv_glu`): silu(gate) * up in
the GEMV's epilogue, so the [1, 2I] projection is never written and silu-and-mul is not a kernel
of its own; the result equals the GEMV followed by the fused silu-and-mul, bit for bit.
One kernel a layer fewer: a 135M decode step is ~300 kernels of a few microseconds, bound by
their count. `env.settings.gemv_epilogues` ($SPECSERVE_GEMV_EPILOGUES=0) keeps them separate.

Safe to import without triton: the kernel module is imported on first use.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from specserve import env
from specserve.ops.fused import records_grad
from specserve.ops.pdl import pdl_enabled

BLOCK_N = 8  # outputs per program: the best on the H200 for every decoder shape swept
BLOCK_K = 256
# Split K until the grid holds about this many programs (H200: qkv 2 splits, o_proj and down 4,
# gate_up 1, the sweep's best per shape).
TARGET_PROGRAMS = 2048
MAX_SPLIT_K = 4
# Up to this K a program reads its whole weight slice at once, before the wait (WHOLE_K): a
# BLOCK_N x 4096 bf16 slice is 64 values a thread in 16 warps, registers without spills.
WHOLE_K_MAX = 4096


@functools.lru_cache(maxsize=1)
def _kernels() -> ModuleType:
    from specserve.ops import triton_gemv

    return triton_gemv


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def split_k(n: int) -> int:
    """K splits for n outputs (of one weight row each)."""
    blocks, split = _cdiv(n, BLOCK_N), 1
    while split < MAX_SPLIT_K and blocks * split * 2 <= TARGET_PROGRAMS:
        split *= 2
    return split


class GemvPlan:
    """Launch shape and workspace of one weight shape. The workspace is shared by every weight
    of that shape: the launches are ordered on one stream (under PDL a kernel touches it only
    after its wait), and the counters are back at zero after each launch. A paired plan (GLU)
    of n outputs reads two weight rows per output, 2n in all, with the grid, tiles and K
    split of the plain plan of those 2n rows: the same sums, in the same order."""

    def __init__(self, n: int, k: int, device: torch.device, paired: bool = False) -> None:
        rows = 2 * n if paired else n
        # small K: one program per row block reads all of K before it waits (WHOLE_K); else K
        # is split until the grid is wide and read in BLOCK_K tiles
        whole = _pow2(k) if k <= WHOLE_K_MAX and env.settings.gemv_whole_k else 0
        blocks, split = _cdiv(rows, BLOCK_N), 1 if whole else split_k(rows)
        self.n, self.rows, self.k, self.split_k, self.whole_k = n, rows, k, split, whole
        self.warps = max(4, BLOCK_N * whole // 2048)  # <= 64 slice values a thread
        # whole BLOCK_K tiles (WHOLE_K: the one power-of-two tile)
        self.k_per = whole or _cdiv(_cdiv(k, split), BLOCK_K) * BLOCK_K
        self.grid = (blocks, split)
        self.part = torch.empty(split, rows, device=device, dtype=torch.float32)
        self.count = torch.zeros(blocks, device=device, dtype=torch.int32)


_plans: dict[tuple[int, int, torch.device, bool, bool], GemvPlan] = {}


def _plan(n: int, k: int, device: torch.device, paired: bool = False) -> GemvPlan:
    key = (n, k, device, paired, env.settings.gemv_whole_k)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = GemvPlan(n, k, device, paired)
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
        and not records_grad(x, weight)  # the kernel has no backward
        and pdl_enabled(x)
    )


def _launch(x: torch.Tensor, weight: torch.Tensor, plan: GemvPlan, mode: int) -> torch.Tensor:
    out = torch.empty(1, plan.n, device=x.device, dtype=x.dtype)
    _kernels()._gemv_kernel[plan.grid](
        x, weight, out, plan.part, plan.count,
        N=plan.n, NQ=plan.rows, K=plan.k, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=plan.split_k,
        K_PER=plan.k_per, MODE=mode, WHOLE_K=plan.whole_k, GDC=True, launch_pdl=True,
        num_warps=plan.warps, num_stages=3,
    )  # fmt: skip
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [1, K] x [N, K] -> [1, N]
    n, k = weight.shape
    assert x.shape == (1, k), (x.shape, weight.shape)
    return _launch(x, weight, _plan(n, k, x.device), int(_kernels().PLAIN.value))


def gemv_glu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [1, K] x [2I, K] -> [1, I]
    """silu(x W_gate^T) * (x W_up^T) for weight = [W_gate; W_up], in one launch."""
    two_i, k = weight.shape
    assert x.shape == (1, k) and two_i % 2 == 0, (x.shape, weight.shape)
    plan = _plan(two_i // 2, k, x.device, paired=True)
    return _launch(x, weight, plan, int(_kernels().GLU.value))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the GEMV where it is faster (module docstring)."""
    if gemv_eligible(x, weight, bias):
        return gemv(x, weight)
    return F.linear(x, weight, bias)


def glu_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The GLU GEMV replaces the GEMV and the fused silu-and-mul: it runs where both would."""
    return gemv_eligible(x, weight, None) and env.settings.fused_ops and env.settings.gemv_epilogues
