"""The decoder's linear layers: cuBLAS, or at 1 to MAX_ROWS rows on a PDL-capable GPU Triton.

Why: a batch-1 decode step is 32 layers x four weight reads, and at one row cuBLAS runs the
smaller ones (qkv, o_proj, down) at 2.6-3.7 TB/s against a 4.0 TB/s copy: each kernel ramps up
and drains alone. The GEMV loads its first weight tile before it waits for the previous kernel
(programmatic dependent launch), so that ramp overlaps the previous kernel's tail. Measured on
the H200 over a one-row chain of 32 distinct layers in a CUDA graph: 123.0 us per layer with
cuBLAS, 122.0 with the GEMV alone, 115.0 with the GEMV under PDL. Without PDL it is no faster
than cuBLAS, so it runs only where PDL does (`specserve.ops.pdl`); elsewhere, and for more than
MAX_ROWS rows, F.linear runs unchanged. `env.settings.gemv` ($SPECSERVE_GEMV=0) turns it off.

2 to MAX_ROWS rows (a batch-1 verify step's k + 1 rows) take the rows kernel: the GEMV's grid,
PDL and split-K scheme with the sum a tensor-core product against x padded to 16 rows. Each
program reads its weight slice once for all rows. Against cuBLAS on an H100 (tools/gemv_chain.py,
8B shapes): 0.98-0.99x a layer at 2-8 rows, 1.00x at 16; with the GLU epilogue and PDL a whole
batch-1 verify step of 5 rows 0.965x (tools/step_cost.py --off gemv_rows). Summing row after row
on CUDA cores instead cost 1.1x-2.7x cuBLAS. A row's result does not depend on how many rows
share the launch (the padding is zeros; each sum is its own). `env.settings.gemv_rows`
($SPECSERVE_GEMV_ROWS=0) keeps more than one row on cuBLAS.

K <= WHOLE_K_MAX (every projection of a 135M-class model; all but down_proj of an 8B) is not
split: each program loads its whole weight slice before the wait, so after the previous kernel
only x is read and the sums are stored; no weight load and no cross-program reduction (a
counter round trip and a reload of partial sums) wait on it. Larger K keeps the split (a slice
would not fit in registers). `env.settings.gemv_whole_k` ($SPECSERVE_GEMV_WHOLE_K=0) splits
every K.

The MLP's gate_up projection at up to MAX_ROWS rows runs as one GLU launch (`gemv_glu`):
silu(gate) * up in the epilogue, so the [M, 2I] projection is never written and silu-and-mul is
not a kernel of its own; the result equals the GEMV followed by the fused silu-and-mul, bit for bit.
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
# The rows kernel: its tile's rows (the tensor cores' smallest), the most rows it serves, its
# tile, and the K split that fills the grid to about `programs` programs (H100: BLOCK_K 256 was
# 3-4 % slower; other tiles untried)
TILE_ROWS = 16
MAX_ROWS = TILE_ROWS
ROWS = dict(block_n=64, block_k=128, warps=4, stages=4, programs=512, max_split=8)


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


class RowsPlan:
    """Launch shape and workspace of the rows kernel for one weight shape (shared as GemvPlan's).
    Paired (GLU): the plain plan of the 2n stacked rows, interleaved."""

    def __init__(self, n: int, k: int, device: torch.device, paired: bool = False) -> None:
        rows, bn, bk = 2 * n if paired else n, ROWS["block_n"], ROWS["block_k"]
        # split K (in whole tiles, none empty) until the grid holds about `programs` programs
        blocks, split, most = _cdiv(rows, bn), 1, min(ROWS["max_split"], _cdiv(k, bk))
        while split * 2 <= most and blocks * split * 2 <= ROWS["programs"]:
            split *= 2
        per = _cdiv(_cdiv(k, bk), split)  # tiles a slice
        split = _cdiv(_cdiv(k, bk), per)  # no empty slice (5 tiles: 3 slices of 2, not 4)
        self.n, self.rows, self.k, self.split_k = n, rows, k, split
        self.block_n, self.block_k, self.warps, self.stages = bn, bk, ROWS["warps"], ROWS["stages"]
        self.k_per = per * bk
        self.grid = (blocks, split)
        self.part = torch.empty(split, TILE_ROWS, rows, device=device, dtype=torch.float32)
        self.count = torch.zeros(blocks, device=device, dtype=torch.int32)


_plans: dict[tuple, GemvPlan | RowsPlan] = {}


def _plan(
    n: int, k: int, device: torch.device, paired: bool = False, m: int = 1
) -> GemvPlan | RowsPlan:
    """The plan of one weight shape: the GEMV's for one row, the rows kernel's for more."""
    key = (n, k, device, paired, m > 1, env.settings.gemv_whole_k)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = (GemvPlan if m == 1 else RowsPlan)(n, k, device, paired)
    return plan


def gemv_eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        x.dim() == 2
        and (x.shape[0] == 1 or (1 < x.shape[0] <= MAX_ROWS and env.settings.gemv_rows))
        and bias is None
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.is_contiguous()
        and weight.is_contiguous()
        and env.settings.gemv
        and not records_grad(x, weight)  # the kernel has no backward
        and pdl_enabled(x)
    )


def _launch(
    x: torch.Tensor, weight: torch.Tensor, plan: GemvPlan | RowsPlan, mode: int
) -> torch.Tensor:
    m = x.shape[0]
    out = torch.empty(m, plan.n, device=x.device, dtype=x.dtype)
    if isinstance(plan, RowsPlan):
        _kernels()._rows_kernel[plan.grid](
            x, weight, out, plan.part, plan.count, m,
            N=plan.n, NQ=plan.rows, K=plan.k, ROWS=TILE_ROWS, BLOCK_N=plan.block_n,
            BLOCK_K=plan.block_k, SPLIT_K=plan.split_k, K_PER=plan.k_per, MODE=mode, GDC=True,
            launch_pdl=True, num_warps=plan.warps, num_stages=plan.stages,
        )  # fmt: skip
        return out
    _kernels()._gemv_kernel[plan.grid](
        x, weight, out, plan.part, plan.count,
        N=plan.n, NQ=plan.rows, K=plan.k, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=plan.split_k,
        K_PER=plan.k_per, MODE=mode, WHOLE_K=plan.whole_k, GDC=True, launch_pdl=True,
        num_warps=plan.warps, num_stages=3,
    )  # fmt: skip
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [M, K] x [N, K] -> [M, N]
    n, k = weight.shape
    m = x.shape[0]
    assert x.dim() == 2 and 1 <= m <= MAX_ROWS and x.shape[1] == k, (x.shape, k)
    return _launch(x, weight, _plan(n, k, x.device, m=m), int(_kernels().PLAIN.value))


def gemv_glu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [M, K] x [2I, K] -> [M, I]
    """silu(x W_gate^T) * (x W_up^T) for weight = [W_gate; W_up], in one launch."""
    two_i, k = weight.shape
    m = x.shape[0]
    assert x.dim() == 2 and 1 <= m <= MAX_ROWS and x.shape[1] == k, (x.shape, k)
    assert two_i % 2 == 0, weight.shape
    plan = _plan(two_i // 2, k, x.device, paired=True, m=m)
    return _launch(x, weight, plan, int(_kernels().GLU.value))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the GEMV where it is faster (module docstring)."""
    if gemv_eligible(x, weight, bias):
        return gemv(x, weight)
    return F.linear(x, weight, bias)


def glu_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The GLU GEMV replaces the GEMV and the fused silu-and-mul: it runs where both would."""
    return gemv_eligible(x, weight, None) and env.settings.fused_ops and env.settings.gemv_epilogues
