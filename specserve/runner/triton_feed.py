"""Triton kernels for the bookkeeping around a device-drafted step's verification (CUDA).

Each replaces a chain of small torch ops in device_feed.py (their reference, which CPU runs):
at a small model's step those ops cost more host time (one dispatch each, ~10 us on an H200
host) than the device spends on the whole forward. One launch each, no host sync, and the
results are bit-identical to the torch reference (integer work and copies only).

This module imports triton at the top: device_feed.py imports it only for CUDA tensors with
triton importable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 128


# T (rows) changes every step: not specialised on (== 1, divisible by 16), or a new variant
# would compile inside a step
@triton.jit(do_not_specialize=["T", "S", "W"])
def _feed_kernel(
    counter_ptr,  # [T] int64, host output index of each row (upper bound)
    row_shift_ptr,  # [T] int64, slot whose rejected rows correct the row, 0 = none
    rejected_ptr,  # [slots + 1] int64
    draft_at_ptr,  # [T] int64, flat pool index + 1 of the draft the row checks, 0 = none
    pool_draft_ptr,  # [(slots + 1) * k] int64
    draft_in_ptr,  # [T] int64, host drafts
    row_to_req_ptr,  # [T] int64 (GOLDEN)
    slots_ptr,  # [R] int64 (GOLDEN)
    gold_ptr,  # [(slots + 1) * W] int64 (GOLDEN)
    out_ptr,  # [2 or 3, S] int64: counter, draft ids, golden token (rows of S >= T)
    T,
    S,
    W,
    GOLDEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = r < T
    counter = tl.load(counter_ptr + r, mask=m, other=0)
    shift = tl.load(row_shift_ptr + r, mask=m, other=0)
    counter -= tl.load(rejected_ptr + shift, mask=m, other=0)
    at = tl.load(draft_at_ptr + r, mask=m, other=0)
    pooled = tl.load(pool_draft_ptr + tl.maximum(at - 1, 0), mask=m & (at > 0), other=0)
    draft = tl.where(at > 0, pooled, tl.load(draft_in_ptr + r, mask=m, other=0))
    tl.store(out_ptr + r, counter, mask=m)
    tl.store(out_ptr + S + r, draft, mask=m)
    if GOLDEN:
        slot = tl.load(slots_ptr + tl.load(row_to_req_ptr + r, mask=m, other=0), mask=m, other=0)
        col = tl.minimum(tl.maximum(counter, 0), W - 1)
        tok = tl.load(gold_ptr + slot * W + col, mask=m, other=-1)
        tl.store(out_ptr + 2 * S + r, tl.where(counter < W, tok, -1), mask=m)


@triton.jit
def _advance_kernel(
    seqlens_ptr,  # [R] int64
    ftp_ptr,  # [R] int64
    draft_ids_ptr,  # [T] int64, the draft each row checked (-1: none)
    is_verify_ptr,  # [T] bool
    draft_at_ptr,  # [T] int64
    pool_conf_ptr,  # [(slots + 1) * k] float32
    anchor_ptr,  # [R] int64
    req_shift_ptr,  # [R] int64
    accepted_ptr,  # [R] int64
    slots_ptr,  # [R] int64
    rejected_ptr,  # [slots + 1] int64 (read, then written)
    seq_len_ptr,  # [slots + 1] int64 (written)
    count_out_ptr,  # [R] int64
    conf_out_ptr,  # [T] float32
    len_out_ptr,  # [R] int64
    room_ptr,  # [R] int64, a device-split step's drafts counted in flight (ROOM)
    ROOM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    # One program per request: it reads and writes only its own slot (or slot 0, which every
    # reader sees as 0 and a slotless or padding request, verifying nothing, rewrites as 0),
    # so no race.
    i = tl.program_id(0)
    sq = tl.load(seqlens_ptr + i)
    rows = tl.load(ftp_ptr + i) + tl.arange(0, BLOCK_Q)
    m = tl.arange(0, BLOCK_Q) < sq
    draft = tl.load(draft_ids_ptr + rows, mask=m, other=-1)
    verify = tl.load(is_verify_ptr + rows, mask=m, other=0).to(tl.int1)
    at = tl.load(draft_at_ptr + rows, mask=m, other=0)
    real = m & (draft >= 0) & verify & (at > 0)
    conf = tl.load(pool_conf_ptr + tl.maximum(at - 1, 0), mask=real, other=0.0)
    tl.store(conf_out_ptr + rows, tl.where(real, conf, 0.0), mask=m)
    tl.store(count_out_ptr + i, tl.sum(real.to(tl.int64), axis=0))
    accepted = tl.load(accepted_ptr + i)
    anchor = tl.load(anchor_ptr + i) - tl.load(rejected_ptr + tl.load(req_shift_ptr + i))
    new_len = anchor + accepted + 2
    slot = tl.load(slots_ptr + i)
    assumed = sq - 1
    if ROOM:
        assumed = tl.maximum(assumed, tl.load(room_ptr + i))
    tl.store(rejected_ptr + slot, tl.maximum(assumed - accepted, 0))  # padding: sq = 0
    tl.store(seq_len_ptr + slot, new_len)
    tl.store(len_out_ptr + i, new_len)


@triton.jit(do_not_specialize=["W", "V"])
def _golden_kernel(
    slots_ptr,  # [R] int64
    seq_len_ptr,  # [R] int64, each request's length after this step
    prompt_len_ptr,  # [slots + 1] int64
    gold_ptr,  # [(slots + 1) * W] int64, -1 past the end
    coins_ptr,  # [(slots + 1) * W] bool
    draft_ptr,  # [(slots + 1) * K] int64 (written)
    conf_ptr,  # [(slots + 1) * K] float32 (written)
    W,
    V,
    rate,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i)
    j = tl.arange(0, BLOCK_K)
    m = j < K
    at = tl.load(seq_len_ptr + i) - tl.load(prompt_len_ptr + slot) + j
    col = tl.minimum(tl.maximum(at, 0), W - 1)
    gold = tl.load(gold_ptr + slot * W + col, mask=m, other=-1)
    heads = tl.load(coins_ptr + slot * W + col, mask=m, other=0).to(tl.int1)
    draft = tl.where(heads, gold, (gold + 1) % V)
    draft = tl.where((at < W) & (gold >= 0), draft, -1)
    tl.store(draft_ptr + slot * K + j, draft, mask=m)
    tl.store(conf_ptr + slot * K + j, tl.where(draft >= 0, rate, 0.0), mask=m)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def feed_rows(
    counter: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_at: torch.Tensor,
    row_shift: torch.Tensor,
    rejected: torch.Tensor,
    pool_draft_ids: torch.Tensor,  # flat
    golden: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,  # row_to_req, slots, gold
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    t = counter.shape[0]
    # rows of an even length: out[1] and out[2] start 16-byte aligned whatever T is (the kernels
    # reading them are specialised on their pointers' alignment)
    out = torch.empty((3 if golden else 2, t + t % 2), dtype=torch.int64, device=counter.device)
    row_to_req, slots, gold = golden if golden else (counter, counter, counter)
    width = gold.shape[1] if golden else 1
    grid = (max(1, triton.cdiv(t, _BLOCK)),)
    _feed_kernel[grid](
        counter, row_shift, rejected, draft_at, pool_draft_ids, draft_ids,
        row_to_req, slots, gold, out, t, out.stride(0), width, GOLDEN=golden is not None,
        BLOCK=_BLOCK,
    )  # fmt: skip
    return out[0, :t], out[1, :t], out[2, :t] if golden else None


def drafted_and_advance(
    seqlens_q: torch.Tensor,
    ftp: torch.Tensor,
    draft_ids: torch.Tensor,
    is_verify: torch.Tensor,
    draft_at: torch.Tensor,
    pool_conf: torch.Tensor,  # flat
    anchor_pos: torch.Tensor,
    req_shift: torch.Tensor,
    num_accepted: torch.Tensor,
    slots: torch.Tensor,
    rejected: torch.Tensor,
    seq_len: torch.Tensor,
    max_rows: int,  # the most rows a request may have (k + 1: fixed, one compiled variant)
    room: torch.Tensor | None = None,  # [R] int64 (device_feed.DraftFeed.room)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r, t = seqlens_q.shape[0], draft_ids.shape[0]
    half = r + r % 2  # the lengths start 16-byte aligned whatever R is
    count = torch.empty(2 * half, dtype=torch.int64, device=seqlens_q.device)
    conf = torch.empty(t, dtype=torch.float32, device=seqlens_q.device)
    if r:
        _advance_kernel[(r,)](
            seqlens_q, ftp, draft_ids, is_verify, draft_at, pool_conf, anchor_pos, req_shift,
            num_accepted, slots, rejected, seq_len, count, conf, count[half:],
            slots if room is None else room, ROOM=room is not None, BLOCK_Q=_pow2(max_rows),
        )  # fmt: skip
    return count[:r], conf, count[half : half + r]


def golden_drafts(
    slots: torch.Tensor,
    seq_len: torch.Tensor,
    prompt_len: torch.Tensor,
    gold: torch.Tensor,  # [slots + 1, W]
    coins: torch.Tensor,  # [slots + 1, W] bool
    draft_ids: torch.Tensor,  # [slots + 1, K]
    draft_conf: torch.Tensor,  # [slots + 1, K]
    vocab_size: int,
    rate: float,
) -> None:
    r, k = slots.shape[0], draft_ids.shape[1]
    if r:
        _golden_kernel[(r,)](
            slots, seq_len, prompt_len, gold, coins, draft_ids, draft_conf,
            gold.shape[1], vocab_size, float(rate), K=k, BLOCK_K=_pow2(k),
        )  # fmt: skip
