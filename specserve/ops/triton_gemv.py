"""Triton kernel for the decoder's matmuls at a handful of rows (batch-1 decode): y = x @ W^T.

Why not cuBLAS there: at 1-4 rows a linear layer only streams its weight, and cuBLAS picks
split-K for the 4096-wide outputs of o_proj and down_proj (a second reduce kernel each) and
reaches ~3.2 TB/s on the 4096-row projections; a kernel that gives every program a slab of
output features over the whole K streams the weight in one pass with nothing to reduce after.
The gated form also folds silu(gate) * up into the load of x, so the MLP's activation kernel
disappears at these sizes.

Only `specserve.ops.linear` imports this module (it checks that triton is importable and the
tensors are on CUDA).
"""

import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] (GATED: [M, 2K], gate columns then up columns); last dim contiguous
    w_ptr,  # [N, K], last dim contiguous
    out_ptr,  # [M, N] contiguous
    M,
    N,
    stride_x,
    stride_w,
    K: tl.constexpr,  # a model constant: one compile per layer shape, and a pipelined loop
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,  # M rounded up to a power of two (M <= 4)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides K (checked by the launcher): no masks along K
):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + rows[:, None] * stride_x + ks[None, :]  # [BLOCK_M, BLOCK_K]
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0).to(tl.float32)
        if GATED:
            gate = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
            up = tl.load(x_ptrs + K, mask=row_ok[:, None], other=0.0).to(tl.float32)
            # rounded where silu_and_mul rounds: silu(gate), then the product
            act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
            x = (act * up).to(dt).to(tl.float32)
        else:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)  # [BLOCK_M, BLOCK_N]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = out_ptr + rows[:, None] * N + cols[None, :]
    tl.store(out, acc.to(dt), mask=row_ok[:, None] & col_ok[None, :])
