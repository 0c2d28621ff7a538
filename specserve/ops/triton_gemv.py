"""Triton kernel: the one-row GEMV of batch-1 decode, launched with PDL (specserve.ops.pdl).

This module imports triton at the top, so only `specserve.ops.gemv` (which checks that triton is
importable and the tensors are on CUDA) should import it.
"""

import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K] contiguous
    w_ptr,  # [N, K] row-major
    out_ptr,  # [N]
    part_ptr,  # [SPLIT_K, N] fp32 workspace (SPLIT_K > 1)
    count_ptr,  # [cdiv(N, BLOCK_N)] int32, zero between calls (SPLIT_K > 1)
    N: tl.constexpr,  # one compiled variant per weight shape: exact loop bounds
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_PER: tl.constexpr,  # the K slice of one program, whole BLOCK_K tiles
    GDC: tl.constexpr,
):
    # out[n] = sum_k w[n, k] x[k]. A program owns BLOCK_N outputs over one of SPLIT_K slices of
    # K. With SPLIT_K > 1 partial sums go to the workspace and the last program of each output
    # block to finish (an acq_rel counter) adds them in split order and resets the counter: one
    # launch, no zeroing pass, safe to replay in a CUDA graph, and the same sum every time.
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch (it waits for us)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    w_rows = w_ptr + rn[:, None].to(tl.int64) * K
    rk = pid_k * K_PER + tl.arange(0, BLOCK_K)
    k_ok = rk < K
    # The first weight tile does not depend on the previous kernel: under PDL it is loaded
    # while that kernel drains (weights are what a batch-1 step waits on).
    w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    if GDC:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
    x = tl.load(x_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)  # [BLOCK_N]
    for i in range(BLOCK_K, K_PER, BLOCK_K):
        rk = pid_k * K_PER + i + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if SPLIT_K == 1:
        tl.store(out_ptr + rn, acc.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(part_ptr + pid_k * N + rn, acc, mask=n_ok)
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N,), tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part_ptr + s * N + rn, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + rn, total.to(out_ptr.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(count_ptr + pid_n, 0)
