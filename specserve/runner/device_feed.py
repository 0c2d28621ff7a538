"""The parts of a step's inputs only the device knows under overlap: tensor ops, no host sync,
the same inside a CUDA graph and on the eager path.

The host lays the step out (rows per request, block tables, positions) from what it knows: the
step in flight is counted as if every draft it verifies were accepted. Three per-row indices
fix the rest on the device:
- pending[r] > 0: row r is a request's anchor row; its token is the one that request sampled
  last, next_tokens[pending[r]].
- draft_at[r] > 0: row r feeds draft draft_at[r] - 1 of the flat draft slot pool (a device
  drafter's, written by the step in flight). An absent draft (-1) feeds token 0: its verify
  row checks -1, which nothing accepts, so the row is discarded with the rest of the step's
  rejected rows.
- shift[r] > 0: row r belongs to a request whose in-flight step verified drafts; that step
  rejected rejected[shift[r]] of them, so the row's KV position (its slot mapping, and its
  request's context length) moves back by that many. Slot 0 of `rejected` is 0.

The verification's side (DraftFeed: the same indices over the verify layout) reads the drafts
and corrects the output indices (feed_verify_rows), and advance_slots writes the per-slot state
the next step reads: each request's length and the rows this step rejected. On CUDA both run as
one Triton launch each (triton_feed.py); the torch ops here are their reference and the CPU's.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch

from specserve.engine.slots import DraftSlotPool
from specserve.sample.layout import RowLayout


def feed_ids(
    ids: torch.Tensor,  # [T] int64, host tokens (placeholders where an index below is set)
    pending: torch.Tensor | None,  # [T] int64
    draft_at: torch.Tensor | None,  # [T] int64
    next_tokens: torch.Tensor,  # [slots + 1] int64
    draft_ids: torch.Tensor | None,  # [(slots + 1) * k] int64, -1 = no draft
) -> torch.Tensor:
    if pending is not None:
        ids = torch.where(pending > 0, next_tokens[pending], ids)
    if draft_at is not None and draft_ids is not None:
        drafted = draft_ids[(draft_at - 1).clamp_min(0)].clamp_min(0)
        ids = torch.where(draft_at > 0, drafted, ids)
    return ids


def shift_rows(
    positions: torch.Tensor,  # [T] int64, host positions (upper bounds)
    slot_mapping: torch.Tensor,  # [T] int64, negative = padding row
    shift: torch.Tensor,  # [T] int64, slot whose rejected count moves the row back, 0 = none
    row_req: torch.Tensor,  # [T] int64, request of each row (0 for padding rows)
    block_tables: torch.Tensor,  # [B, W] int32
    block_size: int,
    rejected: torch.Tensor,  # [slots + 1] int64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions, slot_mapping, correction [T]) with the in-flight step's rejections taken off."""
    corr = rejected[shift]
    pos = positions - corr
    block = block_tables[row_req, pos // block_size].to(torch.int64)
    slots = torch.where(corr > 0, block * block_size + pos % block_size, slot_mapping)
    return pos, slots, corr


def shift_context_lens(
    context_lens: torch.Tensor,  # [B] int32
    cu_query_lens: torch.Tensor,  # [B + 1] int32
    query_lens: torch.Tensor,  # [B] int32, 0 = padding request
    corr: torch.Tensor,  # [T] int64, from shift_rows
) -> torch.Tensor:
    """[B] int32: each request's context length less its last row's correction."""
    last = (cu_query_lens[1:].to(torch.int64) - 1).clamp_min(0)
    c = torch.where(query_lens > 0, corr[last], torch.zeros_like(corr[last]))
    return context_lens - c.to(context_lens.dtype)


class DraftFeed(NamedTuple):
    """A step whose drafts or positions only the device knows (device drafters, overlap):
    verify-layout indices into the draft slot pool (runner/device_feed.py for the rows)."""

    draft_at: torch.Tensor  # [total_q] int64, flat pool index + 1 of the draft row r checks; 0
    row_shift: torch.Tensor  # [total_q] int64, slot whose rejected rows correct row r; 0
    req_shift: torch.Tensor  # [R] int64, the same per request
    anchor_pos: torch.Tensor  # [R] int64, KV position of each anchor row as the host laid it
    # [R] int64, a device-split step's most drafts per request, all counted as in flight by
    # the host (device_split.py); 0 or None: its rows are the host's
    room: torch.Tensor | None = None


def feed_kernels(x: torch.Tensor) -> ModuleType | None:
    """triton_feed for CUDA tensors when triton is importable, else None (the torch path)."""
    if not x.is_cuda:
        return None
    from specserve.ops.triton_attention import use_triton

    if not use_triton(x.device):
        return None
    from specserve.runner import triton_feed

    return triton_feed


def feed_verify_rows(
    counter: torch.Tensor,  # [total_q] int64, output index of each row (host upper bound)
    draft_ids: torch.Tensor,  # [total_q] int64, host drafts (placeholders where draft_at > 0)
    feed: DraftFeed,
    pool: DraftSlotPool,
    golden: tuple[torch.Tensor, torch.Tensor] | None,  # (row_to_req [total_q], slots [R])
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(counter, draft_ids, golden token per row or None) as the verification reads them: the
    in-flight step's rejections taken off each row's output index, each row's draft read from
    the slot pool, and (golden) the golden token at the corrected index, -1 past the end."""
    kernels = feed_kernels(counter)
    if kernels is not None and (golden is None or pool.gold is not None):
        gold = None if golden is None else (*golden, pool.gold)
        return kernels.feed_rows(
            counter, draft_ids, feed.draft_at, feed.row_shift, pool.rejected,
            pool.flat_draft_ids, gold,
        )  # fmt: skip
    counter = counter - pool.rejected[feed.row_shift]
    gather = (feed.draft_at - 1).clamp_min(0)
    draft_ids = torch.where(feed.draft_at > 0, pool.flat_draft_ids[gather], draft_ids)
    forced = None
    if golden is not None:
        row_to_req, slots = golden
        forced = pool.golden_rows(slots[row_to_req], counter)
    return counter, draft_ids, forced


def drafted_and_advance(
    layout: RowLayout,
    slots: torch.Tensor,  # [R] int64
    num_accepted: torch.Tensor,  # [R] int64
    draft_ids: torch.Tensor,  # [total_q] int64, the draft each verify row checked (-1: none)
    feed: DraftFeed,
    pool: DraftSlotPool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """drafted_rows then advance_slots: (drafts verified [R], their confidences [total_q], the
    requests' new lengths [R])."""
    kernels = feed_kernels(slots)
    if kernels is not None:
        return kernels.drafted_and_advance(
            layout.seqlens_q, layout.ftp, draft_ids, layout.is_verify, feed.draft_at,
            pool.draft_conf.view(-1), feed.anchor_pos, feed.req_shift, num_accepted, slots,
            pool.rejected, pool.seq_len, pool.k + 1, feed.room,
        )  # fmt: skip
    count, conf = drafted_rows(layout, draft_ids, feed, pool.draft_conf)
    return count, conf, advance_slots(layout, slots, num_accepted, feed, pool)


def drafted_rows(
    layout: RowLayout,
    draft_ids: torch.Tensor,  # [total_q] int64, the draft each verify row checked (-1: none)
    feed: DraftFeed,
    draft_conf: torch.Tensor,  # [slots + 1, k] float32, the pool's
) -> tuple[torch.Tensor, torch.Tensor]:
    """([R] drafts each request really verified, [total_q] their confidences), read before
    the drafter overwrites the pool."""
    real = (draft_ids >= 0) & layout.is_verify & (feed.draft_at > 0)
    count = torch.zeros_like(layout.seqlens_q).scatter_add_(
        0, layout.row_to_req, real.to(layout.seqlens_q.dtype)
    )
    conf = draft_conf.view(-1)[(feed.draft_at - 1).clamp_min(0)]
    return count, torch.where(real, conf, torch.zeros_like(conf))


def advance_slots(
    layout: RowLayout,
    slots: torch.Tensor,  # [R] int64
    num_accepted: torch.Tensor,  # [R] int64
    feed: DraftFeed,
    pool: DraftSlotPool,
) -> torch.Tensor:
    """The pool's per-slot state after a step, on the device: each request's length (its
    anchor row's true position + accepted drafts + the sampled token) and the verify rows it
    rejected (the next step, laid out as if all were accepted, moves back by them; a split
    step's host counted its room). Returns the new lengths [R] int64."""
    anchor = feed.anchor_pos - pool.rejected[feed.req_shift]
    seq_len = anchor + num_accepted + 2
    assumed = layout.seqlens_q - 1
    if feed.room is not None:
        assumed = torch.maximum(assumed, feed.room)
    # a padding request of a graph's tail (no rows, slot 0) leaves slot 0's 0 as it is
    pool.rejected.index_copy_(0, slots, (assumed - num_accepted).clamp_min(0))
    pool.seq_len.index_copy_(0, slots, seq_len)
    return seq_len
