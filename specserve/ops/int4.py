"""Int4 linear layers for the CPU: 4-bit weights in groups of 32 along K, torch's int4pack kernels.

Why: CPU decode streams every weight byte from DRAM once per step. Int4 reads an eighth of fp32
(plus one bf16 scale and zero per 32 weights: 5 bits a weight), and the default model already
ships as 4-bit groups of 32 (GGUF Q4_1), which this format re-encodes exactly (`from_q4_1`).

Conventions of `aten._convert_weight_to_int4pack_for_cpu` / `aten._weight_int4pack_mm_for_cpu`
(torch >= 2.6; checked by experiment, and by `int4_kernels_available` at run time):
  packing   int32 [N, K] of values 0..15 in, an opaque uint8 [N, K/2] out; N % 16 == 0
  groups    32, 64, 128 or 256 weights along K; K % group == 0
  scales    scales_and_zeros [K/group, N, 2] (scale, zero) in the activations' dtype
  dequant   w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n],  g = k // group
  rows      a row's output does not depend on the other rows of the call (bit for bit)
Activations must be bf16: the fp32 and fp16 paths exist but are 40-70x slower than bf16
(measured below). Output: one bf16 rounding of the fp32 accumulation.

int4pack_mm costs ~22 us per row of a 3072 x 576 weight at any row count (it dequantizes for
each row block), so above INT4PACK_MAX_ROWS rows (prefill, large batches) a bf16 GEMM over a
bf16 copy of the dequantized weights runs instead, as int8's weight-only path does: 627 vs
1452 us at 64 rows, 8126 vs 23294 at 1024 (3072 x 576, 1 thread; equal at 16 rows).
That copy rounds each weight to bf16 (relative 2^-9), so a row's bits depend on which side of
the threshold its step falls, as they do for fp32's own GEMMs, which block by row count.

Measured on this 2-core AMD EPYC (Zen 4: avx512_bf16, no AMX), torch 2.13, 1 thread, each call on
a distinct weight (streamed from DRAM), median of 5, us per call (`fp32` = F.linear fp32):

  shape [N, K]   rows   fp32   int4 (bf16 x)   int4 (fp32 x)
  3072 x 576       1     667         81            3454
  3072 x 576      64    3233       2203          222225
  576 x 1536       1     274         42            1745
  960 x 576        1     204         27            1138
  49152 x 576      1    9932       1451           59681
  49152 x 576     64   63182      30853         3333629
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

GROUP = 32
INT4PACK_MAX_ROWS = 16  # above: the bf16 GEMM over the dequantized copy (module doc)
ZERO_POINT = 8  # the kernel subtracts 8 from every 4-bit value before scaling
N_ALIGN = 16  # the packing wants N % 16 == 0
INNER_K_TILES = 2  # a packing argument; the CPU kernel's layout does not depend on it


@functools.cache
def int4_kernels_available() -> bool:
    """True when this torch has the CPU int4 kernels AND they follow the conventions above (a
    16 x 32 self-check): a future change of layout refuses int4 instead of computing garbage."""
    aten = torch.ops.aten
    if not (
        hasattr(aten, "_convert_weight_to_int4pack_for_cpu")
        and hasattr(aten, "_weight_int4pack_mm_for_cpu")
    ):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randint(0, 16, (N_ALIGN, GROUP), generator=g, dtype=torch.int32)
        scale = torch.rand(1, N_ALIGN, generator=g) + 0.5
        zero = torch.randn(1, N_ALIGN, generator=g)
        packed, sz = pack(q, scale, zero)
        eye = torch.eye(GROUP, dtype=torch.bfloat16)
        got = aten._weight_int4pack_mm_for_cpu(eye, packed, GROUP, sz).float().t()
        want = dequantize(q, sz[..., 0].float(), sz[..., 1].float())
        return bool(torch.allclose(got, want, rtol=1e-2, atol=1e-2))
    except RuntimeError:
        return False


def quantize_groups(
    w: torch.Tensor,  # [N, K] float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [N, Kp] uint8 0..15, scale/zero [Kp/G, N]
    """Asymmetric min/max per group of 32, in the kernel's form w ~= (q - 8) * scale + zero.
    Scale and zero are rounded to bf16 (what the kernel reads) BEFORE q is chosen against them,
    so the error stays within half a step however far a group sits from 0. K is zero-padded to
    Kp, a multiple of 32 (the caller pads the activations the same way)."""
    n, k = w.shape
    wf = F.pad(w.detach().float(), (0, -k % GROUP))
    wg = wf.reshape(n, -1, GROUP)
    lo, hi = wg.amin(dim=2), wg.amax(dim=2)  # [N, Kp/G]
    scale = ((hi - lo) / 15).to(torch.bfloat16).float()  # 0 for a constant group: w = zero
    zero = (lo + ZERO_POINT * scale).to(torch.bfloat16).float()
    step = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((wg - zero[..., None]) / step[..., None]) + ZERO_POINT
    q = q.clamp_(0, 15).to(torch.uint8).reshape(n, -1)
    return q, scale.t().contiguous(), zero.t().contiguous()


def from_q4_1(
    d: torch.Tensor,  # [N, K/32] float: GGUF Q4_1 block scales
    m: torch.Tensor,  # [N, K/32] float: GGUF Q4_1 block minimums (value = d * q + m)
) -> tuple[torch.Tensor, torch.Tensor]:  # scale, zero [K/32, N] float32
    """GGUF Q4_1 blocks in the kernel's form, same 4-bit q: d*q + m = (q - 8)*d + (m + 8d)."""
    d, m = d.float(), m.float()
    return d.t().contiguous(), (m + ZERO_POINT * d).t().contiguous()


def dequantize(
    q: torch.Tensor,  # [N, K] int 0..15
    scale: torch.Tensor,  # [K/G, N]
    zero: torch.Tensor,  # [K/G, N]
) -> torch.Tensor:  # [N, K] float32
    s = scale.float().t().repeat_interleave(GROUP, dim=1)
    z = zero.float().t().repeat_interleave(GROUP, dim=1)
    return (q.float() - ZERO_POINT) * s + z


def pack(
    q: torch.Tensor,  # [N, K] integers 0..15, N % 16 == 0, K % GROUP == 0
    scale: torch.Tensor,  # [K/G, N]
    zero: torch.Tensor,  # [K/G, N]
) -> tuple[torch.Tensor, torch.Tensor]:  # packed uint8 [N, K/2], scales_and_zeros [K/G, N, 2] bf16
    """The kernel's operands. Scale and zero round to bf16 here (the kernel wants them in the
    activations' dtype): the one rounding a Q4_1 re-encoding adds. bf16 keeps 8 significant
    bits, so a weight moves by <= 2^-8 (8 |scale| + |zero|): 1/32 of a step plus 2^-8 of the
    zero (GGUF's d and m are fp16, 11 bits)."""
    q = q.to(torch.int32)  # [N, K] uint8 or int32 in; the packing wants int32
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), INNER_K_TILES)
    return packed, torch.stack([scale, zero], dim=-1).to(torch.bfloat16).contiguous()


def int4_linear(
    x: torch.Tensor,  # [M, K] float32 or bf16
    packed: torch.Tensor,  # [N, K/2] uint8 from pack
    scales_and_zeros: torch.Tensor,  # [K/G, N, 2] bf16
    wide: torch.Tensor,  # [N, K] bf16: the dequantized weights, for many rows
) -> torch.Tensor:  # [M, N] in x's dtype
    """bf16(x) @ dequant(w)^T, accumulated in fp32, rounded once to bf16: int4pack_mm up to
    INT4PACK_MAX_ROWS rows, the bf16 GEMM over `wide` above."""
    if x.shape[0] == 0:
        return x.new_zeros((0, packed.shape[0]))
    xb = x.to(torch.bfloat16)
    if x.shape[0] > INT4PACK_MAX_ROWS:
        return F.linear(xb, wide).to(x.dtype)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, GROUP, scales_and_zeros)
    return y.to(x.dtype)
