"""The decoder's linear layers: cuBLAS, or at one row on a PDL-capable GPU a Triton GEMV.

Why: a batch-1 decode step is 32 layers x four weight reads, and at one row cuBLAS runs the
smaller ones (qkv, o_proj, down) at 2.6-3.7 TB/s against a 4.0 TB/s copy: each kernel ramps up
and drains alone. The GEMV loads its first weight tile before it waits for the previous kernel
(programmatic dependent launch), so that ramp overlaps the previous kernel's tail. Measured on
the H200 over a one-row chain of 32 distinct layers in a CUDA graph: 123.0 us per layer with
cuBLAS, 122.0 with the GEMV alone, 115.0 with the GEMV under PDL. Without PDL it is no faster
than cuBLAS, so it runs only where PDL does (`specserve.ops.pdl`); elsewhere, and for more than
one row, F.linear runs unchanged. `env.settings.gemv` ($SPECSERVE_GEMV=0) turns it off.

The MLP's gate_up projection at one row runs as one GLU GEMV (`gemv_glu`): silu(gate) * up in
the GEMV's epilogue, so the [1, 2I] projection is never written and silu-and-mul is not a kernel
of its own; the result equals the GEMV followed by the fused silu-and-mul, bit for bit.
Likewise o_proj and down_proj (`gemv_add_norm`) run the residual add + RMSNorm after them in
their epilogue: the last row block to be stored (an acq_rel counter) reads the whole output row
back and norms it, with the norm kernel's code and warps, so the sums match to the bit. Three
kernels a layer fewer (a 135M decode step is ~300 kernels of a few microseconds).
`env.settings.gemv_epilogues` ($SPECSERVE_GEMV_EPILOGUES=0) keeps them separate kernels.

Safe to import without triton: the kernel module is imported on first use.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from specserve import env
from specserve.ops.fused import norm_warps
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
        blocks, split = _cdiv(rows, BLOCK_N), split_k(rows)
        self.n, self.rows, self.k, self.split_k = n, rows, k, split
        self.k_per = _cdiv(_cdiv(k, split), BLOCK_K) * BLOCK_K  # whole BLOCK_K tiles
        self.grid = (blocks, split)
        self.part = torch.empty(split, rows, device=device, dtype=torch.float32)
        self.count = torch.zeros(blocks, device=device, dtype=torch.int32)
        self.done = torch.zeros(1, device=device, dtype=torch.int32)  # NORM's row blocks stored


_plans: dict[tuple[int, int, torch.device, bool], GemvPlan] = {}


def _plan(n: int, k: int, device: torch.device, paired: bool = False) -> GemvPlan:
    key = (n, k, device, paired)
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
        and pdl_enabled(x)
    )


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    plan: GemvPlan,
    mode: int,
    norm: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    res = nw = normed = new_res = x  # placeholders: only NORM reads them
    eps, warps = 0.0, 4
    if norm is not None:
        res, nw, eps, normed, new_res = norm
        warps = norm_warps(plan.n)  # the separate norm kernel's: its sum, in its order
    _kernels()._gemv_kernel[plan.grid](
        x, weight, out, plan.part, plan.count, res, nw, normed, new_res, plan.done, eps,
        N=plan.n, NQ=plan.rows, K=plan.k, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=plan.split_k,
        K_PER=plan.k_per, MODE=mode, NORM_BLOCK=_pow2(plan.n), GDC=True, launch_pdl=True, num_warps=warps, num_stages=3,
    )  # fmt: skip
    return out


def _empty(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.empty(1, n, device=x.device, dtype=x.dtype)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [1, K] x [N, K] -> [1, N]
    n, k = weight.shape
    assert x.shape == (1, k), (x.shape, weight.shape)
    return _launch(x, weight, _empty(x, n), _plan(n, k, x.device), int(_kernels().PLAIN.value))


def gemv_glu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [1, K] x [2I, K] -> [1, I]
    """silu(x W_gate^T) * (x W_up^T) for weight = [W_gate; W_up], in one launch."""
    two_i, k = weight.shape
    assert x.shape == (1, k) and two_i % 2 == 0, (x.shape, weight.shape)
    i = two_i // 2
    plan = _plan(i, k, x.device, paired=True)
    return _launch(x, weight, _empty(x, i), plan, int(_kernels().GLU.value))


def gemv_add_norm(
    x: torch.Tensor,  # [1, K]
    weight: torch.Tensor,  # [N, K]
    residual: torch.Tensor,  # [1, N] the residual stream before this projection
    norm_weight: torch.Tensor,  # [N]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # normed [1, N], new residual [1, N]
    """ops.fused.add_rms_norm(x W^T, residual, norm_weight, eps) in one launch: the projection,
    then the residual add and the norm in its epilogue, as the two kernels compute them."""
    n, k = weight.shape
    assert x.shape == (1, k) and residual.shape == (1, n), (x.shape, weight.shape, residual.shape)
    normed, new_res = _empty(x, n), _empty(x, n)
    norm = (residual, norm_weight, eps, normed, new_res)
    _launch(x, weight, _empty(x, n), _plan(n, k, x.device), int(_kernels().NORM.value), norm=norm)
    return normed, new_res


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the GEMV where it is faster (module docstring)."""
    if gemv_eligible(x, weight, bias):
        return gemv(x, weight)
    return F.linear(x, weight, bias)


def glu_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The GLU GEMV replaces the GEMV and the fused silu-and-mul: it runs where both would."""
    return gemv_eligible(x, weight, None) and env.settings.fused_ops and env.settings.gemv_epilogues


def add_norm_eligible(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
    norm_weight: torch.Tensor,
) -> bool:  # fmt: skip
    """Where the GEMV and the fused add + RMSNorm would both run (one row, no bias)."""
    return (
        gemv_eligible(x, weight, bias)
        and env.settings.fused_ops
        and env.settings.gemv_epilogues
        and residual.shape == (1, weight.shape[0])
        and residual.dtype == x.dtype
        and residual.is_contiguous()
        and norm_weight.dtype == x.dtype
        and norm_weight.is_contiguous()
    )
