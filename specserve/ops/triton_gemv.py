"""Triton kernel: the one-row GEMV of batch-1 decode, launched with PDL (specserve.ops.pdl).

This module imports triton at the top, so only `specserve.ops.gemv` (which checks that triton is
importable and the tensors are on CUDA) should import it.
"""

import triton
import triton.language as tl

PLAIN = tl.constexpr(0)  # out[n] = w[n] . x
GLU = tl.constexpr(1)  # out[n] = silu(w[n] . x) * (w[N + n] . x): gate_up and silu-and-mul
ROPE = tl.constexpr(2)  # qkv with rotary and the KV-cache write of k and v


@triton.jit
def _rope_epilogue(
    out_ptr, rn, n_ok, a, b, cs_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_cs,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    HALF: tl.constexpr, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    """ops/triton_fused.py's _rope_write_kv_kernel on one row, from the GEMV's sums: pair rn is
    element dd of head hh's first half (row ra, sum a) and of its second half (row rb, sum b)."""
    dt = out_ptr.dtype.element_ty
    x1 = a.to(dt)  # what the plain GEMV stores
    x2 = b.to(dt)
    hh = rn // HALF
    dd = rn % HALF
    ra = hh * (2 * HALF) + dd
    rb = ra + HALF
    tl.store(out_ptr + ra, x1, mask=n_ok)
    tl.store(out_ptr + rb, x2, mask=n_ok)
    # The rotary reads the stored row back, as the separate kernel reads it: computed from the
    # registers, the cast pair fp32 -> dt -> fp32 was dropped by the compiler (an ulp off in a
    # fifth of the outputs on an H200, where v, stored from the same registers, was exact).
    tl.debug_barrier()
    f1 = tl.load(out_ptr + ra, mask=n_ok, other=0.0).to(tl.float32)
    f2 = tl.load(out_ptr + rb, mask=n_ok, other=0.0).to(tl.float32)
    cos1 = tl.load(cs_ptr + dd, mask=n_ok, other=0.0).to(tl.float32)
    cos2 = tl.load(cs_ptr + HALF + dd, mask=n_ok, other=0.0).to(tl.float32)
    sin1 = tl.load(cs_ptr + stride_cs + dd, mask=n_ok, other=0.0).to(tl.float32)
    sin2 = tl.load(cs_ptr + stride_cs + HALF + dd, mask=n_ok, other=0.0).to(tl.float32)
    out1 = ((f1 * cos1).to(dt).to(tl.float32) + (f2 * sin1).to(dt).to(tl.float32)).to(dt)
    out2 = ((f2 * cos2).to(dt).to(tl.float32) + (f1 * sin2).to(dt).to(tl.float32)).to(dt)
    # qkv as the GEMV + the fused rotary leave it: q rotated, k and v as projected
    is_q = hh < NUM_Q_HEADS
    tl.store(out_ptr + ra, out1, mask=n_ok & is_q)
    tl.store(out_ptr + rb, out2, mask=n_ok & is_q)
    slot = tl.load(slot_ptr)
    if slot >= 0:  # a padding row writes no cache slot
        page = slot // PAGE
        off = slot % PAGE
        is_k = (hh >= NUM_Q_HEADS) & (hh < NUM_Q_HEADS + NUM_KV_HEADS) & n_ok
        is_v = (hh >= NUM_Q_HEADS + NUM_KV_HEADS) & n_ok
        kh = hh - NUM_Q_HEADS
        k_dst = k_cache_ptr + page * stride_kb + off * stride_ks + kh * stride_kh + dd
        k_dt = k_cache_ptr.dtype.element_ty
        tl.store(k_dst, out1.to(k_dt), mask=is_k)
        tl.store(k_dst + HALF, out2.to(k_dt), mask=is_k)
        vh = kh - NUM_KV_HEADS
        v_dst = v_cache_ptr + page * stride_vb + off * stride_vs + vh * stride_vh + dd
        v_dt = v_cache_ptr.dtype.element_ty
        tl.store(v_dst, x1.to(v_dt), mask=is_v)
        tl.store(v_dst + HALF, x2.to(v_dt), mask=is_v)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K] contiguous
    w_ptr,  # [R, K] row-major: R = N (PLAIN), 2N (GLU: gate rows, then up rows), 2N (ROPE)
    out_ptr,  # [N] (PLAIN, GLU); ROPE: [2N], the qkv row
    part_ptr,  # [SPLIT_K, NQ] fp32 workspace (SPLIT_K > 1)
    count_ptr,  # [cdiv(NQ, BLOCK_N)] int32, zero between calls (SPLIT_K > 1)
    cs_ptr,  # ROPE: the row's cos, signed sin ([2, 1, D], last dim contiguous)
    k_cache_ptr,  # ROPE: [num_blocks, PAGE, Hkv, D]
    v_cache_ptr,
    slot_ptr,  # ROPE: [1] int64, negative = padding row
    stride_cs, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    N: tl.constexpr,  # outputs (GLU: gate/up pairs, ROPE: rotary pairs); one variant a shape
    NQ: tl.constexpr,  # weight rows read: N (PLAIN), 2N (GLU, ROPE)
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,  # weight rows a program reads
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_PER: tl.constexpr,  # the K slice of one program, whole BLOCK_K tiles
    MODE: tl.constexpr,  # PLAIN, GLU or ROPE
    HALF: tl.constexpr,  # ROPE: head_dim // 2
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    PAGE: tl.constexpr,
    GDC: tl.constexpr,
):  # fmt: skip
    # out[n] = sum_k w[n, k] x[k]. A program owns BLOCK_N weight rows over one of SPLIT_K slices
    # of K. With SPLIT_K > 1 partial sums go to the workspace and the last program of each row
    # block to finish (an acq_rel counter) adds them in split order and resets the counter: one
    # launch, no zeroing pass, safe to replay in a CUDA graph, and the same sum every time.
    # GLU and ROPE read the two rows of each output side by side in one tile (gate and up; the
    # two halves of a rotary pair): the same tile shape, grid and split as the PLAIN GEMV of the
    # whole weight, so each row is summed exactly as that GEMV sums it, and the epilogue sees
    # the values it would store.
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch (it waits for us)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    q = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # row slots, in program order
    q_ok = q < NQ
    if MODE == PLAIN:
        rows = q
    elif MODE == GLU:
        rows = q // 2 + (q % 2) * N  # pair p: gate row p, up row N + p
    else:
        pair = q // 2  # element dd of head hh's first half, then of its second half
        rows = (pair // HALF) * (2 * HALF) + pair % HALF + (q % 2) * HALF
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    rk = pid_k * K_PER + tl.arange(0, BLOCK_K)
    k_ok = rk < K
    # The first weight tile does not depend on the previous kernel: under PDL it is loaded
    # while that kernel drains (weights are what a batch-1 step waits on).
    w = tl.load(w_rows + rk[None, :], mask=q_ok[:, None] & k_ok[None, :], other=0.0)
    if GDC:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    x = tl.load(x_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)  # [BLOCK_N]
    for i in range(BLOCK_K, K_PER, BLOCK_K):
        rk = pid_k * K_PER + i + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + rk[None, :], mask=q_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    last = SPLIT_K == 1
    if SPLIT_K > 1:
        tl.store(part_ptr + pid_k * NQ + q, acc, mask=q_ok)
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        last = done == SPLIT_K - 1
        if last:
            acc = tl.zeros((BLOCK_N,), tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(part_ptr + s * NQ + q, mask=q_ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0)
    if last:
        dt = out_ptr.dtype.element_ty
        if MODE == PLAIN:
            tl.store(out_ptr + q, acc.to(dt), mask=q_ok)
        else:
            a, b = tl.split(tl.reshape(acc, (BLOCK_N // 2, 2)))  # [BLOCK_N // 2] each
            rn = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            n_ok = rn < N
            if MODE == GLU:
                # the unfused path's roundings: gate and up stored in dt by the GEMV, silu(gate)
                # rounded to dt before the product (ops/triton_fused.py's silu-and-mul)
                g = a.to(dt).to(tl.float32)
                u = b.to(dt).to(tl.float32)
                g = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u
                tl.store(out_ptr + rn, g.to(dt), mask=n_ok)
            else:
                _rope_epilogue(
                    out_ptr, rn, n_ok, a, b, cs_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                    stride_cs, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    HALF, NUM_Q_HEADS, NUM_KV_HEADS, PAGE,
                )  # fmt: skip
