"""Triton kernels for the elementwise parts of a decoder layer: residual add + RMSNorm, rotary
embedding over q and k (alone, or with the KV-cache write of k and v), and SiLU-and-mul.

This module imports triton at the top, so only `specserve.ops.fused` (which checks that triton is
importable and the tensors are on CUDA) should import it; the launch logic lives there.

Numerics: every kernel loads in the storage dtype, computes in fp32 and rounds to the storage
dtype at the same points as the torch ops it replaces (e.g. the bf16 residual sum before the norm
reads it, the normalised row before the weight multiply, silu(gate) before the product with
up). Each rounding is a cast that costs nothing next to the memory traffic, and it keeps the fused
path within an ulp or so of the unfused torch path (and of HF transformers, which rounds at the
same places) instead of drifting from it by using extra precision.
"""

import triton
import triton.language as tl


@triton.jit
def _gdc_begin(GDC: tl.constexpr):
    """Launched with PDL (specserve.ops.pdl): let the next kernel launch, then wait until the
    previous one has finished and its writes are visible. Every kernel here reads its
    predecessor's output at once, so both go first."""
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, N]
    res_ptr,  # [T, N] (unused when not HAS_RESIDUAL)
    w_ptr,  # [N]
    out_ptr,  # [T, N] contiguous: normed
    new_res_ptr,  # [T, N] contiguous: x + residual (unused when not HAS_RESIDUAL)
    stride_x,
    stride_r,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # n_cols rounded up to a power of two: the whole row in one tile
    GDC: tl.constexpr,
):
    _gdc_begin(GDC)
    # One program per row: a row of a decoder's hidden state (<= 16k values) fits in registers,
    # so the row is read once and the reduction needs no second pass.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        # Round the sum to the storage dtype first: the unfused `x + residual` stores it that
        # way, and both the norm and the next layer read that rounded value.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * n_cols + cols, x, mask=ok)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, 0) / n_cols
    normed = xf * tl.rsqrt(mean_sq + eps)
    # F.rms_norm / HF: normalise in fp32, cast to the input dtype, then multiply by the weight in
    # that dtype (one more rounding).
    normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotate_row(
    x_ptr, cs_ptr, t, hh, dd, ok, d_ok, stride_xt, stride_xh, stride_ct, stride_cs,
    HALF: tl.constexpr,
):  # fmt: skip
    """Rotary of BLOCK_H heads of row t, in halves: (x1, x2) as loaded (fp32), (out1, out2)
    rotated and rounded to x's dtype. roll(x, D/2) is [x2, x1], so
      out1 = x1 * cos1 + x2 * ssin1,   out2 = x2 * cos2 + x1 * ssin2.
    The row's cos/sin are loaded once for all its heads."""
    cos_row = cs_ptr + t * stride_ct
    sin_row = cos_row + stride_cs
    cos1 = tl.load(cos_row + dd, mask=d_ok, other=0.0).to(tl.float32)  # [1, BLOCK_HALF]
    cos2 = tl.load(cos_row + HALF + dd, mask=d_ok, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row + dd, mask=d_ok, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + HALF + dd, mask=d_ok, other=0.0).to(tl.float32)

    p1 = x_ptr + t * stride_xt + hh * stride_xh + dd  # [BLOCK_H, BLOCK_HALF]
    x1 = tl.load(p1, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=ok, other=0.0).to(tl.float32)
    dt = x_ptr.dtype.element_ty
    # Rounded like the unfused x*cos + rotated*sin in the storage dtype (three ops, three
    # roundings); for fp32 the casts vanish.
    out1 = ((x1 * cos1).to(dt).to(tl.float32) + (x2 * sin1).to(dt).to(tl.float32)).to(dt)
    out2 = ((x2 * cos2).to(dt).to(tl.float32) + (x1 * sin2).to(dt).to(tl.float32)).to(dt)
    return p1, x1, x2, out1, out2


@triton.jit
def _rope_kernel(
    x_ptr,  # [T, NH, D], rotated in place; last dim contiguous
    cs_ptr,  # [T, 2, 1, D]: cos, signed sin; last dim contiguous
    stride_xt,
    stride_xh,
    stride_ct,
    stride_cs,
    num_heads,  # NH
    HALF: tl.constexpr,  # D // 2
    BLOCK_HALF: tl.constexpr,  # HALF rounded up to a power of two
    BLOCK_H: tl.constexpr,  # heads per program
    GDC: tl.constexpr,
):
    _gdc_begin(GDC)
    # A program owns BLOCK_H heads of one row.
    t = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    dd = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    d_ok = dd < HALF
    ok = (hh < num_heads) & d_ok
    p1, _, _, out1, out2 = _rotate_row(
        x_ptr, cs_ptr, t, hh, dd, ok, d_ok, stride_xt, stride_xh, stride_ct, stride_cs, HALF
    )
    tl.store(p1, out1, mask=ok)
    tl.store(p1 + HALF, out2, mask=ok)


@triton.jit
def _rope_write_kv_kernel(
    x_ptr,  # [T, H + 2 Hkv, D]: the qkv projection output; last dim contiguous
    cs_ptr,  # [T, 2, 1, D]: cos, signed sin; last dim contiguous
    k_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    v_cache_ptr,
    slot_ptr,  # [T] int64, negative = padding row
    stride_xt,
    stride_xh,
    stride_ct,
    stride_cs,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    NUM_Q_HEADS: tl.constexpr,  # H
    NUM_KV_HEADS: tl.constexpr,  # Hkv
    HALF: tl.constexpr,  # D // 2
    BLOCK_HALF: tl.constexpr,  # HALF rounded up to a power of two
    BLOCK_H: tl.constexpr,  # heads per program
    PAGE: tl.constexpr,  # cache block size
    GDC: tl.constexpr,
):
    _gdc_begin(GDC)
    # A program owns BLOCK_H heads of one row, of any kind: q heads are rotated in place, k heads
    # rotated into the cache (not back into x: only the cache is read after this), v heads
    # copied into the cache. One launch instead of rotary + KV write.
    t = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    dd = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    d_ok = dd < HALF
    ok = (hh < NUM_Q_HEADS + 2 * NUM_KV_HEADS) & d_ok
    p1, x1, x2, out1, out2 = _rotate_row(
        x_ptr, cs_ptr, t, hh, dd, ok, d_ok, stride_xt, stride_xh, stride_ct, stride_cs, HALF
    )
    is_q = hh < NUM_Q_HEADS
    tl.store(p1, out1, mask=ok & is_q)
    tl.store(p1 + HALF, out2, mask=ok & is_q)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:  # padding rows write no cache slot
        page = slot // PAGE
        off = slot % PAGE
        is_v = hh >= NUM_Q_HEADS + NUM_KV_HEADS
        is_k = (hh >= NUM_Q_HEADS) & (hh < NUM_Q_HEADS + NUM_KV_HEADS)
        kh = hh - NUM_Q_HEADS  # [BLOCK_H, 1] k head index (for k rows)
        k_dst = k_cache_ptr + page * stride_kb + off * stride_ks + kh * stride_kh + dd
        k_dt = k_cache_ptr.dtype.element_ty
        tl.store(k_dst, out1.to(k_dt), mask=ok & is_k)
        tl.store(k_dst + HALF, out2.to(k_dt), mask=ok & is_k)
        vh = kh - NUM_KV_HEADS  # v head index (for v rows)
        v_dst = v_cache_ptr + page * stride_vb + off * stride_vs + vh * stride_vh + dd
        v_dt = v_cache_ptr.dtype.element_ty
        tl.store(v_dst, x1.to(v_dt), mask=ok & is_v)
        tl.store(v_dst + HALF, x2.to(v_dt), mask=ok & is_v)


@triton.jit
def _silu_and_mul_kernel(
    gu_ptr,  # [T, 2I]: gate columns [0, I), up columns [I, 2I); last dim contiguous
    out_ptr,  # [T, I] contiguous
    stride_gu,
    inter,  # I
    BLOCK: tl.constexpr,
    GDC: tl.constexpr,
):
    _gdc_begin(GDC)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    base = gu_ptr + row * stride_gu
    gate = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(base + inter + cols, mask=ok, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    # F.silu rounds silu(gate) to the storage dtype before the (rounded) product with up.
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (act * up).to(dt), mask=ok)
