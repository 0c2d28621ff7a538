"""Fused sample-and-verify for CUDA: same semantics as `specserve.sample.verify.verify_reference`.

This module imports triton at the top: `specserve.sample.verify` imports it lazily, only once it
knows the tensors are on CUDA and triton is importable, so CPU-only installs never need it.

Covered (see `fusable`): drafts without a draft model's q (one-hot / model-free drafts, or no
drafts at all) and rows that are greedy or temperature-only. Rejection sampling against a
draft q and top-k / top-p / min-p rows stay on the torch reference.

Two launches, no host sync, graph-capturable (grids and scratch depend on shapes only):
  phase 1, grid (total_q, num_chunks): one program per (row, CHUNK columns of the vocabulary),
      so even one request with a few rows spreads a 128k vocabulary over hundreds of programs
      (one program per request scanning all of V left an H200 ~20x slower at batch 1). Each
      writes two partials of its chunk:
        greedy: max logit m_c and its lowest column;
        race (temperature > 0 rows only): the best score and its lowest column, where the
          reference's argmax_v p_v / e_v (p = softmax(l / T), e_v = -log(u_v), u the row's
          hashed_uniform(seed, counter, SAMPLE_SALT) stream, recomputed here bit for bit, see
          specserve.ops.random) is taken in log space: log p_v - log e_v = x_v - log e_v - const
          with x = l / T. A chunk scores x_v - x_c - log e_v, x_c = m_c / T its own max, so
          the terms stay small (as the reference's x - max) without knowing the row's max.
  phase 2, grid (R,): one program per request walks its rows in order and, per row, reduces
      the partials: greedy takes the max of m_c, ties -> the lowest column (chunks are in order
      and each partial is its chunk's lowest, so this is torch.argmax's choice, bit-identical);
      the race compares (x_c - x_max) + score_c, ties -> the lowest column. Then the golden
      token override, accept (target == draft on verify rows) and prefix acceptance, stopping
      at the first rejected row, as the reference.
Near ties: a race is exact math-wise, but the log-space scores round differently from the
reference's float32 p / e (and tl.log / tl.exp are not torch's), so a sampled token can differ
from the reference where two candidates' scores agree to within a few ulps. Greedy is exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.ops.random import _MUL1, _MUL2, GAMMA, salt_key
from specserve.ops.sampling import SAMPLE_SALT, SamplingTensors
from specserve.sample.layout import RowLayout
from specserve.sample.verify import VerifyResult

# splitmix64 constants as int64 bit patterns (triton reads globals only when constexpr).
_GAMMA = tl.constexpr(GAMMA)
_M1 = tl.constexpr(_MUL1)
_M2 = tl.constexpr(_MUL2)
_SAMPLE_KEY = tl.constexpr(salt_key(SAMPLE_SALT))
# `>>` on int64 sign-extends; masking the result to 64 - s bits makes it a logical shift.
_LOW34 = tl.constexpr((1 << 34) - 1)
_LOW37 = tl.constexpr((1 << 37) - 1)
_LOW33 = tl.constexpr((1 << 33) - 1)
_LOW23 = tl.constexpr((1 << 23) - 1)  # top 23 bits of the word after >> 41

# Vocabulary columns per phase-1 program (a power of two, held in registers as one tile):
# 4096 gives 32 chunks at V = 128256. Read per call, so tests can shrink it to get many chunks
# from a small vocabulary under the interpreter.
CHUNK = 4096
# Past MAX_CHUNKS * CHUNK columns the chunk grows instead, keeping phase 2's reduction small.
MAX_CHUNKS = 64


@triton.jit
def _mix64(z):
    """splitmix64 finaliser on int64 words (wrapping *, logical >>), as random.mix64."""
    z = z ^ ((z >> 30) & _LOW34)
    z = z * _M1
    z = z ^ ((z >> 27) & _LOW37)
    z = z * _M2
    return z ^ ((z >> 31) & _LOW33)


# `plane` (rows x chunks) changes with the step's rows: not specialised on, so a new row count
# never means a compile inside a step.
@triton.jit(do_not_specialize=["plane"])
def _chunk_kernel(
    logits_ptr,  # [total_q, V] float, last dim contiguous
    temp_ptr,  # [total_q] float32, <= 0 -> greedy row
    seed_ptr,  # [total_q] int64
    counter_ptr,  # [total_q] int64
    part_val_ptr,  # out [2, total_q, NC] float32: chunk max logit | chunk best race score
    part_idx_ptr,  # out [2, total_q, NC] int32: the lowest column holding it
    stride_row,
    plane,  # total_q * NC: offset of the race plane
    VOCAB: tl.constexpr,
    NC: tl.constexpr,  # number of chunks, cdiv(VOCAB, CHUNK)
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64, so row * stride_row cannot overflow
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK] int32
    logit = tl.load(
        logits_ptr + row * stride_row + cols, mask=cols < VOCAB, other=float("-inf")
    ).to(tl.float32)  # [CHUNK]
    m = tl.max(logit, axis=0)
    # Lanes past VOCAB hold -inf but columns >= VOCAB, so an all -inf chunk still answers its
    # first column (and an all -inf row column 0, as torch.argmax).
    out = row * NC + chunk
    tl.store(part_val_ptr + out, m)
    tl.store(part_idx_ptr + out, tl.min(tl.where(logit == m, cols, VOCAB), axis=0))
    temp = tl.load(temp_ptr + row)
    if temp > 0.0:
        # The reference's row key: mix64(mix64(seed ^ salt_key) + counter * GAMMA).
        seed = tl.load(seed_ptr + row)
        counter = tl.load(counter_ptr + row)
        key = _mix64(_mix64(seed ^ _SAMPLE_KEY) + counter * _GAMMA)
        bits = _mix64(key + (cols.to(tl.int64) + 1) * _GAMMA)  # [CHUNK] int64
        u = (((bits >> 41) & _LOW23) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08  # 2**-24
        # div_rn: IEEE division like torch's `logits / temp` (Triton's `/` is approximate).
        # max(l) / T == max(l / T): rounding a division by T > 0 is monotone.
        x = tl.math.div_rn(logit, temp) - tl.math.div_rn(m, temp)  # [CHUNK], <= 0
        # -inf logits (masks, lanes past VOCAB) never win; in an all -inf chunk x is NaN.
        score = tl.where(logit > float("-inf"), x - tl.log(-tl.log(u)), float("-inf"))
        best = tl.max(score, axis=0)
        tl.store(part_val_ptr + plane + out, best)
        tl.store(part_idx_ptr + plane + out, tl.min(tl.where(score == best, cols, VOCAB), axis=0))


@triton.jit(do_not_specialize=["plane"])
def _verify_kernel(
    part_val_ptr,  # [2, total_q, NC] float32, from _chunk_kernel
    part_idx_ptr,  # [2, total_q, NC] int32
    draft_ptr,  # [total_q] int64
    forced_ptr,  # [total_q] int64, -1 = none (unused unless HAS_FORCED)
    temp_ptr,  # [total_q] float32, <= 0 -> greedy row
    seqlens_ptr,  # [R] int64
    ftp_ptr,  # [R] int64
    verified_ptr,  # out [total_q] int32
    sampled_ptr,  # out [R] int64
    num_acc_ptr,  # out [R] int64
    final_ptr,  # out [R] int64
    plane,  # total_q * NC
    VOCAB: tl.constexpr,
    NC: tl.constexpr,
    NC_POW2: tl.constexpr,  # NC rounded up to a power of two (tl.arange needs one)
    HAS_FORCED: tl.constexpr,
):
    req = tl.program_id(0)
    first = tl.load(ftp_ptr + req)  # int64
    n = tl.load(seqlens_ptr + req)
    lanes = tl.arange(0, NC_POW2)  # [NC_POW2], one per chunk
    live = lanes < NC
    j = first * 0  # local step of the row being processed (int64 zero)
    tok = first * 0  # target token of the last processed row
    going = j < n  # true while every processed row was an accepted verify row
    while going:
        row = first + j
        part = row * NC + lanes  # [NC_POW2] int64
        m = tl.load(part_val_ptr + part, mask=live, other=float("-inf"))
        m_max = tl.max(m, axis=0)
        # Padding lanes say VOCAB, above any real column: the min picks the lowest real one.
        at = tl.load(part_idx_ptr + part, mask=live, other=VOCAB)
        tok = tl.min(tl.where(m == m_max, at, VOCAB), axis=0).to(tl.int64)
        temp = tl.load(temp_ptr + row)
        if temp > 0.0:
            score = tl.load(part_val_ptr + plane + part, mask=live, other=float("-inf"))
            at = tl.load(part_idx_ptr + plane + part, mask=live, other=VOCAB)
            # Each chunk's scores are relative to its own max x_c: shift them all to the row's.
            shift = tl.math.div_rn(m, temp) - tl.math.div_rn(m_max, temp)  # [NC_POW2], <= 0
            # A -inf score (all -inf chunk, padding) stays -inf, never NaN from -inf - -inf.
            score = tl.where(score > float("-inf"), shift + score, float("-inf"))
            best = tl.max(score, axis=0)
            tok = tl.min(tl.where(score == best, at, VOCAB), axis=0).to(tl.int64)
        if HAS_FORCED:
            gold = tl.load(forced_ptr + row)
            tok = tl.where(gold >= 0, gold, tok)
        draft = tl.load(draft_ptr + row)
        accepted = (j < n - 1) & (tok == draft)  # the last row verifies nothing
        tl.store(verified_ptr + row, tl.where(accepted, draft, -1).to(tl.int32))
        going = accepted
        j += 1
    # The loop ran up to and including the final row (a request with no rows, as a graph's
    # padding might have, accepts nothing and emits token 0).
    num_acc = tl.maximum(j - 1, 0)
    # Rows after the final row are never emitted.
    while j < n:  # a while loop: range() over loaded bounds trips up the interpreter
        tl.store(verified_ptr + first + j, -1)
        j += 1
    tl.store(sampled_ptr + req, tok)
    tl.store(num_acc_ptr + req, num_acc)
    tl.store(final_ptr + req, first + num_acc)


def fusable(t: SamplingTensors, draft_probs: torch.Tensor | None) -> bool:
    """True when the fused kernel implements this step: no draft-model q (one-hot drafts or
    none) or only greedy rows (their p is one-hot: a draft is accepted iff it is the argmax,
    whatever its q), and no top-k / top-p / min-p row. Reads only host flags: no sync."""
    return (draft_probs is None or t.all_greedy) and not (t.any_top_k or t.any_top_p or t.any_min_p)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def chunk_size(vocab: int) -> int:
    """Phase-1 columns per program: CHUNK, larger past MAX_CHUNKS chunks, smaller for tiny V."""
    return min(_pow2(vocab), max(CHUNK, _pow2(triton.cdiv(vocab, MAX_CHUNKS))))


def verify_triton(
    logits: torch.Tensor,  # [total_q, V] float (f32 normally), penalties and masks applied
    draft_token_ids: torch.Tensor,  # [total_q] int64, the draft each verify row checks
    t: SamplingTensors,  # per row; fusable(t, None) must hold
    layout: RowLayout,
    forced: torch.Tensor | None = None,  # [total_q] int64 golden token per row, -1 = none
) -> VerifyResult:
    """The fused pass; callers go through `specserve.sample.verify.verify`, which checks
    `fusable` and the device first."""
    assert fusable(t, None), "top-k / top-p / min-p rows need the torch reference"
    total_q = logits.shape[0]
    assert total_q == layout.total_q == draft_token_ids.shape[0], (logits.shape, layout.total_q)
    return _launch(
        logits, draft_token_ids, forced, t.temperature, t.seed, t.counter, layout.seqlens_q,
        layout.ftp,
    )  # fmt: skip


def verify_padded(
    logits: torch.Tensor,  # [Tb, V]
    draft_token_ids: torch.Tensor,  # [Tb] int64
    temperature: torch.Tensor,  # [Tb] float32
    seed: torch.Tensor,  # [Tb] int64
    counter: torch.Tensor,  # [Tb] int64
    seqlens_q: torch.Tensor,  # [Bb] int64, 0 = padding request
    ftp: torch.Tensor,  # [Bb] int64
    forced: torch.Tensor | None = None,  # [Tb] int64 golden token per row, -1 = none
) -> VerifyResult:
    """A CUDA graph bucket's verification (sample.verify.verify_padded): rows past the real ones
    belong to no request, padding requests have no rows (the kernel accepts nothing for them)."""
    return _launch(logits, draft_token_ids, forced, temperature, seed, counter, seqlens_q, ftp)


def _launch(
    logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    forced: torch.Tensor | None,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    counter: torch.Tensor,
    seqlens_q: torch.Tensor,
    ftp: torch.Tensor,
) -> VerifyResult:
    total_q, vocab = logits.shape
    num_reqs = seqlens_q.shape[0]
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    device = logits.device
    verified = torch.empty(total_q, dtype=torch.int32, device=device)
    sampled = torch.empty(num_reqs, dtype=torch.int64, device=device)
    num_accepted = torch.empty(num_reqs, dtype=seqlens_q.dtype, device=device)
    final_rows = torch.empty(num_reqs, dtype=torch.int64, device=device)
    if num_reqs == 0:
        return VerifyResult(verified, sampled, num_accepted, final_rows)
    chunk = chunk_size(vocab)
    nc = triton.cdiv(vocab, chunk)
    # Scratch partials; the race plane is written (and read) only for temperature > 0 rows.
    part_val = torch.empty((2, total_q, nc), dtype=torch.float32, device=device)
    part_idx = torch.empty((2, total_q, nc), dtype=torch.int32, device=device)
    temp = temperature.to(torch.float32).contiguous()

    def i64(x: torch.Tensor) -> torch.Tensor:  # a no-op for the int64 tensors callers pass
        return x.to(torch.int64).contiguous()

    if total_q > 0:  # a zero-sized grid is no launch at all
        _chunk_kernel[(total_q, nc)](
            logits, temp, i64(seed), i64(counter), part_val, part_idx,
            logits.stride(0), total_q * nc,
            VOCAB=vocab, NC=nc, CHUNK=chunk, num_warps=8 if chunk >= 2048 else 4,
        )  # fmt: skip
    nc_pow2 = _pow2(nc)
    _verify_kernel[(num_reqs,)](
        part_val, part_idx,
        i64(draft_token_ids), i64(forced) if forced is not None else draft_token_ids, temp,
        i64(seqlens_q), i64(ftp),
        verified, sampled, num_accepted, final_rows,
        total_q * nc,
        VOCAB=vocab, NC=nc, NC_POW2=nc_pow2, HAS_FORCED=forced is not None,
        num_warps=1 if nc_pow2 <= 128 else 4,
    )  # fmt: skip
    return VerifyResult(verified, sampled, num_accepted, final_rows)
