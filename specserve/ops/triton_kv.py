"""Triton kernels over the paged KV cache: the KV write and paged attention (with split-KV).

This module imports triton at the top, so only `specserve.ops.triton_attention` (which checks
that triton is importable and the tensors are on CUDA) should import it. The launch logic and
the heuristics live there; here are the kernels alone.

Paged attention work decomposition (one launch for decode, verify and prefill rows alike):
  grid = (num_q_tiles * num_splits, num_requests, num_kv_heads)
  * a program owns BLOCK_Q consecutive rows of one request and ALL the query heads of one KV
    head (GQA): its BLOCK_M = BLOCK_Q * GROUP rows share every K/V tile it loads, so K/V is read
    once per KV head instead of once per query head;
  * a program walks the keys [0, last visible + 1) of its rows, unmasked up to the first row's
    own position (every row sees those) and masked after it (causal within the request);
  * with a sliding window W (SLIDING) the walk starts at the first row's oldest key
    (first position - W + 1): keys older than every row's window are never loaded, so their
    blocks may have been freed. Keys the last row's window has dropped are masked too;
  * with num_splits > 1 (few programs, long contexts: batch-1 decode) the key range is cut in
    up to num_splits chunks of whole BLOCK_N steps (flash-decoding). Only the chunks that hold
    keys run ("live" splits: the grid is sized for a static bound, the context is often far
    shorter); each writes a normalised partial output and its log-sum-exp, and the last live
    program of the tile to finish (an acq_rel counter) merges them and resets the counter. One
    launch: a separate combine kernel cost ~2 us per layer of a batch-1 step, mostly its
    launch gap. A tile whose keys fit one chunk writes its output directly.
Everything data-dependent (query/context lengths, block tables) is read from device tensors, so
the launch is graph-capturable; programs whose tile lies past their request's rows exit at once.
"""

import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    v_cache_ptr,
    slot_ptr,  # [T] int64, negative = padding row
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of two
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    PAGE: tl.constexpr,  # cache block size
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:  # padding row: nothing to write
        return
    page = slot // PAGE
    off = slot % PAGE
    hh = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    dd = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    mask = (hh < NUM_KV_HEADS) & (dd < HEAD_DIM)
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + hh * stride_kh + dd, mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + hh * stride_vh + dd, mask=mask)
    k_dst = k_cache_ptr + page * stride_kcb + off * stride_kcs + hh * stride_kch + dd
    v_dst = v_cache_ptr + page * stride_vcb + off * stride_vcs + hh * stride_vch + dd
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_keys(
    acc,  # [BLOCK_M, HEAD_DIM_P2] fp32, unnormalised output
    m_i,  # [BLOCK_M] fp32, running max of the scores (log2 domain)
    l_i,  # [BLOCK_M] fp32, running sum of exp2(score - m_i)
    q,  # [BLOCK_M, HEAD_DIM_P2] in the cache dtype
    q_pos,  # [BLOCK_M] context position of each row
    start,  # first key of this tile
    hi,  # keys >= hi are outside the range (only checked when MASKED)
    bt_row_ptr,  # this request's block table row
    k_head_ptr,  # k cache + kv_head * stride
    v_head_ptr,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    qk_scale,  # softmax scale * log2(e)
    window,  # keys each row sees (SLIDING only)
    d,  # [HEAD_DIM_P2] arange
    d_ok,  # [HEAD_DIM_P2] d < HEAD_DIM
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    if MASKED:
        n_ok = n < hi
        page = tl.load(bt_row_ptr + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
    else:
        page = tl.load(bt_row_ptr + n // PAGE).to(tl.int64)
        kv_mask = d_ok[None, :]
    off = n % PAGE
    k_offs = page[:, None] * stride_kb + off[:, None] * stride_ks + d[None, :]
    # Masked keys load as 0, so unwritten (possibly NaN) cache memory never enters the product.
    k = tl.load(k_head_ptr + k_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_P2]
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        visible = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    # m_i starts finite (-1e30), so a row with every key masked so far keeps p = 0, alpha = 1
    # instead of exp2(-inf - -inf) = NaN.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_offs = page[:, None] * stride_vb + off[:, None] * stride_vs + d[None, :]
    v = tl.load(v_head_ptr + v_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_P2]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# Arguments that change from step to step are not specialised on (Triton compiles a variant per
# "== 1" / "divisible by 16" class of each int, and per value of a constexpr): a new class
# mid-run meant a ~0.3 s compile inside a timed step (the 256-request H200 run lost ~2 s to
# them). The split count is one of them: it follows the context length in eager launches (a
# drafter's catch-up), so it is a runtime int and only whether to split is compiled in.
@triton.jit(do_not_specialize=["num_reqs", "num_rows", "stride_bt", "window", "num_splits"])
def _paged_attention_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    v_cache_ptr,
    out_ptr,  # [T, H, D]            (not SPLIT)
    o_part_ptr,  # [S, T, H, D] fp32 (SPLIT)
    lse_part_ptr,  # [S, T, H] fp32, log2 domain
    count_ptr,  # [num_q_tiles * B * Hkv] int32, zero between launches (SPLIT)
    query_lens_ptr,  # [B] int32
    cu_query_lens_ptr,  # [B + 1] int32
    context_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_blocks] int32
    num_reqs,
    num_rows,  # T
    num_heads,  # H
    qk_scale,
    window,  # sliding window (keys each row sees, itself included); read when SLIDING
    num_splits,  # key chunks per query tile (1 unless SPLIT)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,  # H // Hkv
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query positions per program
    BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP rounded up to a power of two (>= 16 for tl.dot)
    BLOCK_N: tl.constexpr,  # keys per step
    SPLIT: tl.constexpr,  # num_splits > 1
    SLIDING: tl.constexpr,  # window > 0
    DOT_PRECISION: tl.constexpr,
    GDC: tl.constexpr,  # launched with PDL (specserve.ops.pdl)
):
    if GDC:
        # The next kernel (o_proj's GEMV at one row) may launch and load its first weight tile
        # meanwhile; everything read below (q, the cache, the step's lengths) waits.
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    tile = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    b = tl.program_id(1)
    kvh = tl.program_id(2)

    r = tl.arange(0, BLOCK_M)
    qi = r // GROUP  # query position inside the tile
    head = kvh * GROUP + r % GROUP  # query head of each tile row
    d = tl.arange(0, HEAD_DIM_P2)
    d_ok = d < HEAD_DIM

    if split == 0:
        # The reference returns zeros for rows past the last request; the last request's
        # programs write them.
        if b == num_reqs - 1:
            num_tiles = tl.num_programs(0) // num_splits
            first_pad = tl.load(cu_query_lens_ptr + num_reqs)
            zeros = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=out_ptr.dtype.element_ty)
            for r0 in range(first_pad + tile * BLOCK_Q, num_rows, num_tiles * BLOCK_Q):
                pad_row = (r0 + qi).to(tl.int64)
                pad_ok = (qi < BLOCK_Q) & (pad_row < num_rows)
                offs = pad_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
                tl.store(out_ptr + offs, zeros, mask=pad_ok[:, None] & d_ok[None, :])

    q_len = tl.load(query_lens_ptr + b)
    if tile * BLOCK_Q >= q_len:  # tile past this request's rows (grid is sized for the max)
        return
    q_start = tl.load(cu_query_lens_ptr + b)
    ctx_len = tl.load(context_lens_ptr + b)

    row_in_req = tile * BLOCK_Q + qi  # [BLOCK_M]
    row_ok = (qi < BLOCK_Q) & (row_in_req < q_len)
    row = (q_start + row_in_req).to(tl.int64)
    q_pos = ctx_len - q_len + row_in_req  # [BLOCK_M] each row sees keys <= q_pos
    row_mask = row_ok[:, None] & d_ok[None, :]
    q_offs = row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_mask, other=0.0).to(k_cache_ptr.dtype.element_ty)

    first_pos = ctx_len - q_len + tile * BLOCK_Q  # keys <= first_pos are visible to every row
    kv_end = tl.minimum(ctx_len, first_pos + BLOCK_Q)  # past the tile's last visible key
    kv_start = 0  # the tile's oldest visible key
    win_full = 0  # keys >= win_full are inside every row's window
    if SLIDING:
        kv_start = tl.maximum(first_pos - window + 1, 0)
        win_full = tl.maximum(kv_end - window, 0)
    # This split's key chunk, in whole BLOCK_N steps; with one split it is [kv_start, kv_end).
    chunk = tl.cdiv(tl.cdiv(kv_end - kv_start, num_splits), BLOCK_N) * BLOCK_N
    live = tl.cdiv(kv_end - kv_start, chunk)  # splits that hold keys; the rest have none
    if split >= live:
        return
    lo = kv_start + split * chunk
    hi = tl.minimum(lo + chunk, kv_end)
    # [lo, head_end): keys some row's window has dropped (masked; empty without a window),
    # [head_end, full_end): whole steps every row sees, [full_end, hi): the causal edge.
    head_end = tl.minimum(lo + tl.cdiv(tl.maximum(win_full - lo, 0), BLOCK_N) * BLOCK_N, hi)
    full_end = head_end + (
        tl.maximum(tl.minimum(hi, first_pos + 1) - head_end, 0) // BLOCK_N * BLOCK_N
    )

    bt_row_ptr = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_head_ptr = k_cache_ptr + kvh * stride_kh
    v_head_ptr = v_cache_ptr + kvh * stride_vh
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SLIDING:
        for start in range(lo, head_end, BLOCK_N):
            acc, m_i, l_i = _attend_keys(
                acc, m_i, l_i, q, q_pos, start, hi, bt_row_ptr, k_head_ptr, v_head_ptr,
                stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, window, d, d_ok,
                PAGE, BLOCK_N, True, SLIDING, DOT_PRECISION,
            )  # fmt: skip
    for start in range(head_end, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_keys(
            acc, m_i, l_i, q, q_pos, start, hi, bt_row_ptr, k_head_ptr, v_head_ptr,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, window, d, d_ok,
            PAGE, BLOCK_N, False, SLIDING, DOT_PRECISION,
        )  # fmt: skip
    for start in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i = _attend_keys(
            acc, m_i, l_i, q, q_pos, start, hi, bt_row_ptr, k_head_ptr, v_head_ptr,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, window, d, d_ok,
            PAGE, BLOCK_N, True, SLIDING, DOT_PRECISION,
        )  # fmt: skip

    # l_i is 0 only for tile rows that are not real, or rows that see no key of this split.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offs = row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if not SPLIT:
        tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=row_mask)
    elif live == 1:
        tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        part_row = (split * num_rows + row) * num_heads + head  # [BLOCK_M] int64
        tl.store(o_part_ptr + part_row[:, None] * HEAD_DIM + d[None, :], o, mask=row_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
        tl.store(lse_part_ptr + part_row, lse, mask=row_ok)
        # Every thread's partial stores precede the release; the last live program acquires
        # them all, merges, and leaves the counter at zero for the next launch.
        tl.debug_barrier()
        counter = count_ptr + (tile * num_reqs + b) * tl.num_programs(2) + kvh
        if tl.atomic_add(counter, 1, sem="acq_rel") == live - 1:
            _merge_splits(
                o_part_ptr, lse_part_ptr, out_ptr, o_offs, row, head, row_ok, d, d_ok,
                live, num_rows, num_heads, BLOCK_M, HEAD_DIM, HEAD_DIM_P2,
            )  # fmt: skip
            tl.atomic_xchg(counter, 0)


@triton.jit
def _merge_splits(
    o_part_ptr, lse_part_ptr, out_ptr, o_offs, row, head, row_ok, d, d_ok,
    live, num_rows, num_heads,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
):  # fmt: skip
    # Weighted sum of the live splits' outputs, weights exp2(lse - max lse), in split order.
    m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: an all -inf row stays 0
    w_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)
    mask = row_ok[:, None] & d_ok[None, :]
    for s in range(0, live):
        part_row = (s * num_rows + row) * num_heads + head
        # .cg: read from L2, where the other programs' stores landed, never a stale L1 line
        lse = tl.load(
            lse_part_ptr + part_row, mask=row_ok, other=float("-inf"), cache_modifier=".cg"
        )  # [BLOCK_M]
        o_ptrs = o_part_ptr + part_row[:, None] * HEAD_DIM + d[None, :]
        o = tl.load(o_ptrs, mask=mask, other=0.0, cache_modifier=".cg")  # [BLOCK_M, HEAD_DIM_P2]
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + o * w[:, None]
        w_sum = w_sum * alpha + w
        m = m_new
    o = acc / tl.where(w_sum > 0, w_sum, 1.0)[:, None]
    tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=mask)
