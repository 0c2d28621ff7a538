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
"""

from __future__ import annotations

import torch


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
