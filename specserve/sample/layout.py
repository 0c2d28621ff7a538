"""Flat row layout of one step: every request owns seqlens_q[i] consecutive rows.

Row ftp[i] + j of request i is local step j. Rows 0..seqlens_q[i]-2 are verify rows (each checks
the draft fed at the next row); the last row is a plain sample. seqlen_q = 1 means no drafts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class RowLayout(NamedTuple):
    seqlens_q: torch.Tensor  # [R] int64, 1 + drafts of each request
    ftp: torch.Tensor  # [R] int64, first_token_positions = exclusive prefix sum of seqlens_q
    row_to_req: torch.Tensor  # [total_q] int64
    local_step: torch.Tensor  # [total_q] int64
    is_verify: torch.Tensor  # [total_q] bool
    total_q: int
    max_drafts: int  # host-known max(seqlens_q) - 1, so no reader syncs to size per-position tables


def build_layout(seqlens_q: torch.Tensor, total_q: int, max_drafts: int) -> RowLayout:
    """total_q and max_drafts come from the host (the scheduler knows them) so the device never syncs."""
    num_reqs = seqlens_q.shape[0]
    ftp = torch.cumsum(seqlens_q, 0) - seqlens_q
    row_to_req = torch.repeat_interleave(
        torch.arange(num_reqs, device=seqlens_q.device), seqlens_q, output_size=total_q
    )
    local_step = torch.arange(total_q, device=seqlens_q.device) - ftp[row_to_req]
    is_verify = local_step != (seqlens_q[row_to_req] - 1)
    return RowLayout(seqlens_q, ftp, row_to_req, local_step, is_verify, total_q, max_drafts)


def check_layout(layout: RowLayout) -> None:
    """Invariant 1 of DESIGN.md (debug/test only: syncs)."""
    sq, ftp = layout.seqlens_q.tolist(), layout.ftp.tolist()
    assert not sq or ftp[0] == 0
    for i in range(len(sq) - 1):
        assert ftp[i + 1] - ftp[i] == sq[i]
    assert not sq or ftp[-1] + sq[-1] == layout.total_q
    assert all(s >= 1 for s in sq)
