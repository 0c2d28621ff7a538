"""Triton kernels of few-row linears, launched with PDL (specserve.ops.pdl): the one-row GEMV of
batch-1 decode, and its tensor-core sibling for 2 to 16 rows (a batch-1 verify step's k + 1 rows).

This module imports triton at the top, so only `specserve.ops.gemv` (which checks that triton is
importable and the tensors are on CUDA) should import it.
"""

import triton
import triton.language as tl

PLAIN = tl.constexpr(0)  # out[n] = w[n] . x
GLU = tl.constexpr(1)  # out[n] = silu(w[n] . x) * (w[N + n] . x): gate_up and silu-and-mul


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K] contiguous
    w_ptr,  # [R, K] row-major: R = N (PLAIN), 2N (GLU: gate rows, then up rows)
    out_ptr,  # [N]
    part_ptr,  # [SPLIT_K, NQ] fp32 workspace (SPLIT_K > 1)
    count_ptr,  # [cdiv(NQ, BLOCK_N)] int32, zero between calls (SPLIT_K > 1)
    N: tl.constexpr,  # outputs (GLU: gate/up pairs); one compiled variant per weight shape
    NQ: tl.constexpr,  # weight rows read: N (PLAIN), 2N (GLU)
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,  # weight rows a program reads
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_PER: tl.constexpr,  # the K slice of one program, whole BLOCK_K tiles
    MODE: tl.constexpr,  # PLAIN or GLU
    WHOLE_K: tl.constexpr,  # > 0: K rounded up to a power of two, the whole row read at once
    GDC: tl.constexpr,
):
    # out[n] = sum_k w[n, k] x[k]. A program owns BLOCK_N weight rows over one of SPLIT_K slices
    # of K. With SPLIT_K > 1 partial sums go to the workspace and the last program of each row
    # block to finish (an acq_rel counter) adds them in split order and resets the counter: one
    # launch, no zeroing pass, safe to replay in a CUDA graph, and the same sum every time.
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
    # under PDL it is loaded while that kernel drains (weights are what a batch-1 step waits on).
    w = tl.load(w_rows + rk[None, :], mask=q_ok[:, None] & k_ok[None, :], other=0.0)
    if GDC:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    x = tl.load(x_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)  # [BLOCK_N]
    if WHOLE_K == 0:
        for i in range(BLOCK_K, K_PER, BLOCK_K):
            ri = pid_k * K_PER + i + tl.arange(0, BLOCK_K)
            i_ok = ri < K
            xi = tl.load(x_ptr + ri, mask=i_ok, other=0.0).to(tl.float32)
            wi = tl.load(w_rows + ri[None, :], mask=q_ok[:, None] & i_ok[None, :], other=0.0)
            acc += tl.sum(wi.to(tl.float32) * xi[None, :], axis=1)
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
            # the unfused path's roundings: gate and up stored in dt by the GEMV, silu(gate)
            # rounded to dt before the product (ops/triton_fused.py's silu-and-mul)
            g = a.to(dt).to(tl.float32)
            u = b.to(dt).to(tl.float32)
            g = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u
            tl.store(out_ptr + rn, g.to(dt), mask=n_ok)


@triton.jit(do_not_specialize=["M"])
def _rows_kernel(
    x_ptr,  # [M, K] contiguous, M <= ROWS
    w_ptr,  # [R, K] row-major: R = N (PLAIN), 2N (GLU: gate rows, then up rows)
    out_ptr,  # [M, N]
    part_ptr,  # [SPLIT_K, ROWS, NQ] fp32 workspace (SPLIT_K > 1)
    count_ptr,  # [cdiv(NQ, BLOCK_N)] int32, zero between calls (SPLIT_K > 1)
    M,  # rows of x: one compiled variant serves every M <= ROWS
    N: tl.constexpr,
    NQ: tl.constexpr,
    K: tl.constexpr,
    ROWS: tl.constexpr,  # the rows of the tile (16, the tensor cores' smallest): M padded
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_PER: tl.constexpr,
    MODE: tl.constexpr,
    GDC: tl.constexpr,
):
    # out[m, n] = sum_k w[n, k] x[m, k] for M <= ROWS rows: the GEMV's grid, split-K completion
    # and GLU pairing, with the sum a tensor-core product w [BLOCK_N, BLOCK_K] . x^T
    # [BLOCK_K, ROWS]. A program reads its weight slice once for all rows, so k + 1 verify rows
    # cost about one weight read, as one decode row does. Summing row after row on CUDA cores
    # (one reduction across the program per row) costs 1.1x-2.7x cuBLAS at 2-8 rows instead.
    # Padded rows are zeros and the product sums each (row, output) on its own: a row's result
    # does not depend on M or on the other rows' values.
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    q = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    q_ok = q < NQ
    if MODE == PLAIN:
        rows = q
    else:
        rows = q // 2 + (q % 2) * N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    cols = tl.arange(0, ROWS)
    m_ok = cols < M
    x_cols = x_ptr + cols[None, :] * K  # [1, ROWS]
    rk = pid_k * K_PER + tl.arange(0, BLOCK_K)
    k_ok = rk < K
    w = tl.load(w_rows + rk[None, :], mask=q_ok[:, None] & k_ok[None, :], other=0.0)
    if GDC:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    xt = tl.load(x_cols + rk[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
    acc = tl.dot(w, xt)  # [BLOCK_N, ROWS] fp32
    for i in range(BLOCK_K, K_PER, BLOCK_K):
        ri = pid_k * K_PER + i + tl.arange(0, BLOCK_K)
        i_ok = ri < K
        wi = tl.load(w_rows + ri[None, :], mask=q_ok[:, None] & i_ok[None, :], other=0.0)
        xi = tl.load(x_cols + ri[:, None], mask=i_ok[:, None] & m_ok[None, :], other=0.0)
        acc = tl.dot(wi, xi, acc)
    last = SPLIT_K == 1
    if SPLIT_K > 1:
        at = part_ptr + cols[None, :] * NQ + q[:, None]  # [BLOCK_N, ROWS]
        ok = q_ok[:, None] & m_ok[None, :]
        tl.store(at + pid_k * ROWS * NQ, acc, mask=ok)
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        last = done == SPLIT_K - 1
        if last:
            acc = tl.zeros((BLOCK_N, ROWS), tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(at + s * ROWS * NQ, mask=ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0)
    if last:
        dt = out_ptr.dtype.element_ty
        if MODE == PLAIN:
            out_ok = q_ok[:, None] & m_ok[None, :]
            tl.store(out_ptr + cols[None, :] * N + q[:, None], acc.to(dt), mask=out_ok)
        else:
            # [BLOCK_N, ROWS] -> gate and up [BLOCK_N // 2, ROWS] (pair p: slots 2p, 2p + 1)
            a, b = tl.split(tl.permute(tl.reshape(acc, (BLOCK_N // 2, 2, ROWS)), (0, 2, 1)))
            rn = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            # the unfused path's roundings, as the GEMV's GLU epilogue
            g = a.to(dt).to(tl.float32)
            u = b.to(dt).to(tl.float32)
            g = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u
            pair_ok = (rn < N)[:, None] & m_ok[None, :]  # [BLOCK_N // 2, ROWS]
            tl.store(out_ptr + cols[None, :] * N + rn[:, None], g.to(dt), mask=pair_ok)
