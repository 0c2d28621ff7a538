"""Int8 linear layers for the CPU: weights int8 per output channel (symmetric), two ways to run
on torch's kernels (where the CPU has AVX512-VNNI, model/quant.py runs int8 weights as integer
blocks instead: ops/cpu_qgemm.py).

Why: CPU decode streams every weight byte from DRAM once per step; the default model's fp32
weights are 537 MB a step. Int8 reads a quarter of that, and torch ships CPU kernels for it.

  weight-only ("int8")  y = (bf16(x) @ q^T) * scale. At <= INT8PACK_MAX_ROWS rows
      `aten._weight_int8pack_mm` (int8 weights, bf16 activations); above, a bf16 GEMM over a
      bf16 copy of q (its values are small integers: exact in bf16), where oneDNN's bf16 kernels
      beat int8pack several times over. Both round the product to bf16 once, then scale in fp32.
      int8pack_mm with fp32 activations exists too but runs 5-40x slower than F.linear fp32.
  dynamic ("w8a8")  activations quantized per row to int8 (symmetric, absmax) on the fly, then
      `torch._int_mm` (int8 x int8 -> int32, oneDNN VNNI), scaled back in fp32. Exact integer
      accumulation: a row's result does not depend on the other rows of the batch.

Measured on this 2-core AMD EPYC (Zen 4: avx512_bf16, avx512_vnni, no AMX), torch 2.13,
each call on a distinct weight so it streams from DRAM, median of 5, us per call
(`fp32` = F.linear fp32; `i8` = int8pack_mm; `bf16` = the bf16 GEMM over the q copy):

  shape [N, K]   rows   fp32    i8   bf16  w8a8
  3072 x 576       1     621   131    243   130
  3072 x 576       8     679   345    300   187
  3072 x 576      64    2019  1909    887   500
  576 x 1536       1     263    69    165    81
  576 x 1536      64     848   838    437   280
  960 x 576        1     202    68    160    80
  960 x 576       64     607   605    348   186
  49152 x 576      1   11815  2851   4948  1971
  49152 x 576     64   36021 46585  12520  7086
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Up to this many rows the weight-only path runs int8pack_mm; above it the bf16 GEMM wins
# (crossover measured between 4 and 16 rows on every decoder shape, see the table above).
INT8PACK_MAX_ROWS = 8
QMAX = 127  # symmetric: -128 is never used, so -q is always representable


def quantize_per_row(
    w: torch.Tensor,  # [N, K] float
) -> tuple[torch.Tensor, torch.Tensor]:  # q [N, K] int8, scale [N] float32
    """Symmetric per-output-channel int8: scale = absmax / 127, q = round(w / scale)."""
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))  # all-zero rows: q = 0
    q = torch.round(wf / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # [N, K] float32
    return q.float() * scale[:, None]


def weight_only_linear(
    x: torch.Tensor,  # [M, K] float32 or bf16
    q: torch.Tensor,  # [N, K] int8
    q_bf16: torch.Tensor,  # [N, K] bf16, q's values
    scale: torch.Tensor,  # [N] float32
    unit: torch.Tensor,  # [N] bf16 ones
) -> torch.Tensor:  # [M, N] in x's dtype
    """bf16(bf16(x) @ q^T) * scale, by either kernel. Both accumulate the same exact products in
    fp32 and round once to bf16, so they agree but for the order of the fp32 sums (measured: 0
    to 7 in 10^5 outputs differ by one bf16 ulp). A row's result is the same at 1 to 8 rows
    (batch-1 verify steps run the decode kernel); across the two kernels greedy outputs can
    differ (a prefix-cache hit, chunking, steps of more than 8 rows: docs/cpu.md). The scale
    is applied after the rounding, in fp32, so the kernels share it."""
    xb = x.to(torch.bfloat16)
    if x.shape[0] == 0:
        return x.new_zeros((0, q.shape[0]))
    if x.shape[0] <= INT8PACK_MAX_ROWS:
        acc = torch.ops.aten._weight_int8pack_mm(xb, q, unit)  # [M, N] bf16
    else:
        acc = F.linear(xb, q_bf16)
    return (acc.float() * scale).to(x.dtype)


def quantize_activations(
    x: torch.Tensor,  # [M, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # int8 [M, K], scale [M, 1] float32
    xf = x.float()
    sx = xf.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30) / QMAX
    return torch.round(xf / sx).to(torch.int8), sx


def dynamic_int8_linear(
    x: torch.Tensor,  # [M, K] float32 or bf16
    q_t: torch.Tensor,  # [K, N] int8 (q transposed, a view)
    scale: torch.Tensor,  # [N] float32
) -> torch.Tensor:  # [M, N] in x's dtype
    if x.shape[0] == 0:
        return x.new_zeros((0, q_t.shape[1]))
    xq, sx = quantize_activations(x)
    acc = torch._int_mm(xq, q_t)  # [M, N] int32, exact
    return (acc.float() * sx * scale).to(x.dtype)
