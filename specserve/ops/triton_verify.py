"""Fused sample-and-verify for CUDA: same semantics as `specserve.spec.verify.verify_reference`.

This module imports triton at the top: `specserve.spec.verify` imports it lazily, only once it
knows the tensors are on CUDA and triton is importable, so CPU-only installs never need it.

Covered (see `fusable`): drafts without a draft model's q (one-hot / model-free drafts, or no
drafts at all) and rows that are greedy or temperature-only. Rejection sampling against a
draft q and top-k / top-p / min-p rows stay on the torch reference.

Work decomposition: grid = (R,), one program per request. A program walks its request's rows
in order (1 + drafts of them) and stops computing at the first rejected row, since nothing
after it is ever emitted. Per row:
  pass 1 (every row): running max / argmax of the logits over V in BLOCK-sized chunks, per lane,
      then one cross-lane reduction (ties -> lowest index, torch.argmax's rule, so greedy is
      bit-identical to the reference);
  pass 2 (sampling rows only): the reference's exponential race argmax_v p_v / e_v with
      p_v = exp(l_v / T - max_v(l_v / T)) (softmax without the 1/sum: the argmax does not need
      it) and e_v = -log(u_v), u = hashed_uniform(seed, counter, SAMPLE_SALT, V) recomputed in
      the kernel bit for bit (see specserve.ops.random). Only the missing normalisation and
      exp/log rounding differ from the reference, so a sampled token can differ only where two
      candidates' scores tie to within a few ulps.
Then the golden-token override, the accept test (target == draft on verify rows) and prefix
acceptance, all in registers: no extra launch, no host sync, graph-capturable (the launch
depends on shapes only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.ops.random import _MUL1, _MUL2, GAMMA, salt_key
from specserve.ops.sampling import SAMPLE_SALT, SamplingTensors
from specserve.spec.layout import RowLayout
from specserve.spec.verify import VerifyResult

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

MAX_BLOCK = 2048  # vocab columns per chunk; larger chunks only add register pressure


@triton.jit
def _mix64(z):
    """splitmix64 finaliser on int64 words (wrapping *, logical >>), as random.mix64."""
    z = z ^ ((z >> 30) & _LOW34)
    z = z * _M1
    z = z ^ ((z >> 27) & _LOW37)
    z = z * _M2
    return z ^ ((z >> 31) & _LOW33)


@triton.jit
def _row_max_argmax(row_ptr, V: tl.constexpr, BLOCK: tl.constexpr):
    """(max, argmax) of one row of logits; ties go to the lowest index."""
    lanes = tl.arange(0, BLOCK)  # [BLOCK]
    best = tl.full([BLOCK], float("-inf"), tl.float32)  # per-lane running max
    best_i = tl.zeros([BLOCK], tl.int32)  # its column; 0 if the lane never beats -inf
    for start in range(0, V, BLOCK):
        cols = start + lanes
        x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        # strict >: a lane keeps the earliest column holding its maximum
        take = x > best
        best = tl.where(take, x, best)
        best_i = tl.where(take, cols, best_i)
    m = tl.max(best, axis=0)
    # An all -inf row matches every lane, all still at column 0: argmax 0, as torch.
    return m, tl.min(tl.where(best == m, best_i, V), axis=0)


@triton.jit
def _row_race(row_ptr, temp, x_max, key, V: tl.constexpr, BLOCK: tl.constexpr):
    """argmax_v exp(x_v - x_max) / e_v with x = logits / temp, e_v = -log(u_v); ties -> lowest."""
    lanes = tl.arange(0, BLOCK)  # [BLOCK]
    best = tl.full([BLOCK], -1.0, tl.float32)  # scores are >= 0; -1 loses to any column
    best_i = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + lanes
        valid = cols < V
        logit = tl.load(row_ptr + cols, mask=valid, other=float("-inf")).to(tl.float32)
        # div_rn: IEEE division like torch's `logits / temp` (Triton's `/` is approximate)
        p = tl.exp(tl.math.div_rn(logit, temp) - x_max)  # [BLOCK], unnormalised probs
        bits = _mix64(key + (cols.to(tl.int64) + 1) * _GAMMA)  # [BLOCK] int64
        u = (((bits >> 41) & _LOW23) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08  # 2**-24
        score = tl.math.div_rn(p, -tl.log(u))
        score = tl.where(valid, score, -1.0)
        take = score > best
        best = tl.where(take, score, best)
        best_i = tl.where(take, cols, best_i)
    m = tl.max(best, axis=0)
    return tl.min(tl.where(best == m, best_i, V), axis=0)


@triton.jit
def _verify_kernel(
    logits_ptr,  # [total_q, V] float, last dim contiguous
    draft_ptr,  # [total_q] int64
    forced_ptr,  # [total_q] int64, -1 = none (unused unless HAS_FORCED)
    temp_ptr,  # [total_q] float32, <= 0 -> greedy row
    seed_ptr,  # [total_q] int64
    counter_ptr,  # [total_q] int64
    seqlens_ptr,  # [R] int64
    ftp_ptr,  # [R] int64
    verified_ptr,  # out [total_q] int32
    sampled_ptr,  # out [R] int64
    num_acc_ptr,  # out [R] int64
    final_ptr,  # out [R] int64
    stride_row,
    VOCAB: tl.constexpr,  # vocabulary size: fixed per model, so one compile
    HAS_FORCED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    req = tl.program_id(0)
    first = tl.load(ftp_ptr + req)  # int64, so row * stride_row cannot overflow
    n = tl.load(seqlens_ptr + req)
    j = first * 0  # local step of the row being processed (int64 zero)
    tok = first * 0  # target token of the last processed row
    going = j < n  # true while every processed row was an accepted verify row
    while going:
        row = first + j
        row_ptr = logits_ptr + row * stride_row
        x_max, amax = _row_max_argmax(row_ptr, VOCAB, BLOCK)
        temp = tl.load(temp_ptr + row)
        if temp > 0.0:
            # The reference's row key: mix64(mix64(seed ^ salt_key) + counter * GAMMA).
            seed = tl.load(seed_ptr + row)
            counter = tl.load(counter_ptr + row)
            key = _mix64(_mix64(seed ^ _SAMPLE_KEY) + counter * _GAMMA)
            # max(l) / T == max(l / T): rounding a division by T > 0 is monotone.
            race = _row_race(row_ptr, temp, tl.math.div_rn(x_max, temp), key, VOCAB, BLOCK)
            tok = race.to(tl.int64)
        else:
            tok = amax.to(tl.int64)
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
    # Rows after the final row were never computed: nothing of them is emitted.
    while j < n:  # a while loop: range() over loaded bounds trips up the interpreter
        tl.store(verified_ptr + first + j, -1)
        j += 1
    tl.store(sampled_ptr + req, tok)
    tl.store(num_acc_ptr + req, num_acc)
    tl.store(final_ptr + req, first + num_acc)


def fusable(t: SamplingTensors, draft_probs: torch.Tensor | None) -> bool:
    """True when the fused kernel implements this step: no draft-model q (one-hot drafts or
    none) and no top-k / top-p / min-p row. Reads only host flags: no sync."""
    return draft_probs is None and not (t.any_top_k or t.any_top_p or t.any_min_p)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def verify_triton(
    logits: torch.Tensor,  # [total_q, V] float (f32 normally), penalties and masks applied
    draft_token_ids: torch.Tensor,  # [total_q] int64, the draft each verify row checks
    t: SamplingTensors,  # per row; fusable(t, None) must hold
    layout: RowLayout,
    forced: torch.Tensor | None = None,  # [total_q] int64 golden token per row, -1 = none
) -> VerifyResult:
    """The fused pass; callers go through `specserve.spec.verify.verify`, which checks
    `fusable` and the device first."""
    assert fusable(t, None), "top-k / top-p / min-p rows need the torch reference"
    total_q, vocab = logits.shape
    num_reqs = layout.seqlens_q.shape[0]
    assert total_q == layout.total_q == draft_token_ids.shape[0], (logits.shape, layout.total_q)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    device = logits.device
    verified = torch.empty(total_q, dtype=torch.int32, device=device)
    sampled = torch.empty(num_reqs, dtype=torch.int64, device=device)
    num_accepted = torch.empty(num_reqs, dtype=layout.seqlens_q.dtype, device=device)
    final_rows = torch.empty(num_reqs, dtype=torch.int64, device=device)
    if num_reqs == 0:
        return VerifyResult(verified, sampled, num_accepted, final_rows)
    block = min(MAX_BLOCK, _pow2(vocab))

    def i64(x: torch.Tensor) -> torch.Tensor:  # a no-op for the int64 tensors callers pass
        return x.to(torch.int64).contiguous()

    _verify_kernel[(num_reqs,)](
        logits, i64(draft_token_ids), i64(forced) if forced is not None else draft_token_ids,
        t.temperature.to(torch.float32).contiguous(), i64(t.seed), i64(t.counter),
        i64(layout.seqlens_q), i64(layout.ftp),
        verified, sampled, num_accepted, final_rows,
        logits.stride(0),
        VOCAB=vocab, HAS_FORCED=forced is not None, BLOCK=block, num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip
    return VerifyResult(verified, sampled, num_accepted, final_rows)
