"""Triton kernel: the GEMV of small-batch decode and verify steps (1 to 8 rows), launched with
PDL (specserve.ops.pdl).

This module imports triton at the top, so only `specserve.ops.gemv` (which checks that triton is
importable and the tensors are on CUDA) should import it.
"""

import triton
import triton.language as tl

PLAIN = tl.constexpr(0)  # out[m, n] = w[n] . x[m]
GLU = tl.constexpr(1)  # out[m, n] = silu(w[n] . x[m]) * (w[N + n] . x[m]): gate_up, silu-and-mul


@triton.jit
def _rows_dot(w, x_ptr, rk, k_ok, M, K, acc, MP: tl.constexpr):
    """acc [BLOCK_N, MP] += (w [BLOCK_N, BK] . x[m, rk]) for each row m < M, one row at a time:
    a row's sum is the one-row GEMV's sum, in the same order (0 + s is s), so a row's result
    does not depend on how many rows share the launch."""
    cols = tl.arange(0, MP)
    wf = w.to(tl.float32)
    for m in tl.static_range(MP):
        m_ok = (rk * 0 + m) < M  # [BK]: row m exists (a tensor, as a mask must be)
        xm = tl.load(x_ptr + m * K + rk, mask=k_ok & m_ok, other=0.0).to(tl.float32)
        s = tl.sum(wf * xm[None, :], axis=1)  # [BLOCK_N]
        acc += tl.where(cols[None, :] == m, s[:, None], 0.0)
    return acc


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr,  # [M, K] contiguous
    w_ptr,  # [R, K] row-major: R = N (PLAIN), 2N (GLU: gate rows, then up rows)
    out_ptr,  # [M, N]
    part_ptr,  # [SPLIT_K, MP, NQ] fp32 workspace (SPLIT_K > 1)
    count_ptr,  # [cdiv(NQ, BLOCK_N)] int32, zero between calls (SPLIT_K > 1)
    M,  # rows of x (<= MP): the variant is compiled per MP, not per M
    N: tl.constexpr,  # outputs (GLU: gate/up pairs); one compiled variant per weight shape
    NQ: tl.constexpr,  # weight rows read: N (PLAIN), 2N (GLU)
    K: tl.constexpr,
    MP: tl.constexpr,  # M rounded up to a power of two
    BLOCK_N: tl.constexpr,  # weight rows a program reads
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_PER: tl.constexpr,  # the K slice of one program, whole BLOCK_K tiles
    MODE: tl.constexpr,  # PLAIN or GLU
    WHOLE_K: tl.constexpr,  # > 0: K rounded up to a power of two, the whole row read at once
    GDC: tl.constexpr,
):
    # out[m, n] = sum_k w[n, k] x[m, k]. A program owns BLOCK_N weight rows over one of SPLIT_K
    # slices of K, and reads them once for all M rows of x (a verify step of k + 1 rows costs
    # one weight read, as a decode step does). With SPLIT_K > 1 partial sums go to the
    # workspace and the last program of each row block to finish (an acq_rel counter) adds
    # them in split order and resets the counter: one launch, no zeroing pass, safe to replay
    # in a CUDA graph, and the same sum every time.
    # GLU reads the two rows of each output (gate, up) side by side in one tile: the same tile
    # shape, grid and split as the PLAIN GEMV of the whole weight, so each row is summed exactly
    # as that GEMV sums it, and the epilogue sees the values it would store.
    # WHOLE_K (small K, SPLIT_K == 1): the program's whole weight slice is loaded before the
    # wait, so once the previous kernel is done only x is read: no weight load and no
    # cross-program reduction on the critical path.
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch (it waits for us)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    q = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # row slots, in program order
    q_ok = q < NQ
    if MODE == PLAIN:
        rows = q
    else:
        rows = q // 2 + (q % 2) * N  # pair p: gate row p, up row N + p
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    rk = pid_k * K_PER + tl.arange(0, BLOCK_K if WHOLE_K == 0 else WHOLE_K)
    k_ok = rk < K
    # The first weight tile (WHOLE_K: all of them) does not depend on the previous kernel:
    # under PDL it is loaded while that kernel drains (weights are what a small step waits on).
    w = tl.load(w_rows + rk[None, :], mask=q_ok[:, None] & k_ok[None, :], other=0.0)
    if GDC:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    acc = _rows_dot(w, x_ptr, rk, k_ok, M, K, tl.zeros((BLOCK_N, MP), tl.float32), MP)
    if WHOLE_K == 0:
        for i in range(BLOCK_K, K_PER, BLOCK_K):
            ri = pid_k * K_PER + i + tl.arange(0, BLOCK_K)
            i_ok = ri < K
            wi = tl.load(w_rows + ri[None, :], mask=q_ok[:, None] & i_ok[None, :], other=0.0)
            acc = _rows_dot(wi, x_ptr, ri, i_ok, M, K, acc, MP)
    cols = tl.arange(0, MP)
    last = SPLIT_K == 1
    if SPLIT_K > 1:
        at = part_ptr + cols[None, :] * NQ + q[:, None]  # [BLOCK_N, MP]
        tl.store(at + pid_k * MP * NQ, acc, mask=q_ok[:, None])
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        last = done == SPLIT_K - 1
        if last:
            acc = tl.zeros((BLOCK_N, MP), tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(
                    at + s * MP * NQ, mask=q_ok[:, None], other=0.0, cache_modifier=".cg"
                )
            tl.atomic_xchg(count_ptr + pid_n, 0)
    if last:
        dt = out_ptr.dtype.element_ty
        m_ok = cols < M
        if MODE == PLAIN:
            tl.store(
                out_ptr + cols[None, :] * N + q[:, None],
                acc.to(dt),
                mask=q_ok[:, None] & m_ok[None, :],
            )
        else:
            # [BLOCK_N, MP] -> [BLOCK_N // 2, MP] gate and up sums (pair p: slots 2p, 2p + 1)
            pairs = tl.permute(tl.reshape(acc, (BLOCK_N // 2, 2, MP)), (0, 2, 1))
            a, b = tl.split(pairs)
            rn = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            n_ok = rn < N
            # the unfused path's roundings: gate and up stored in dt by the GEMV, silu(gate)
            # rounded to dt before the product (ops/triton_fused.py's silu-and-mul)
            g = a.to(dt).to(tl.float32)
            u = b.to(dt).to(tl.float32)
            g = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u
            tl.store(
                out_ptr + cols[None, :] * N + rn[:, None],
                g.to(dt),
                mask=n_ok[:, None] & m_ok[None, :],
            )
