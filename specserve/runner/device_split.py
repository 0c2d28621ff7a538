"""The device split: a step whose total rows the host fixed, shared among its requests on the
device by the newest confidences (DESIGN.md's verify budget under overlap, DeepInfer's scheme).

Under overlap the host lays out step N+1 while step N, which drafts for N+1, is still in flight:
the newest confidences it has are one step old. For a device-drafted step that samples in its
graph tail the host fixes only the bucket (its total rows, from the verify budget's choice) and
each request's room (the most drafts it may verify, all counted as in flight); this stage, the
first thing the step's device work does, reads the confidences step N wrote into the draft slot
pool and lays the rows out:

    survival a[i][j] = prod_{m<=j} c[i][m]     (0 past a request's room or its real drafts)
    drafts of request i = its rows among the Tb - n largest survivals (split_rows: a prefix)
    every per-row input of the forward and the tail from the per-request ones the host sent

so the rows go where the drafts just written are the most likely to be accepted, at the price
of the bucket the host chose (rows past the chosen total and inside the bucket are free). The
host reads the rows each request got back with the step's results (graph_tail.SampledTail).

Tensor ops only, no host sync: captured in a CUDA graph per bucket, and the same on the eager
path (CPU tests through a fake graph backend).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def split_rows(surv: torch.Tensor, total: int | torch.Tensor) -> torch.Tensor:
    """[n] int64: how many of each request's drafts the `total` largest survivals [n, k] take
    (ties: the earlier position, then the earlier request; zero survival never), by tensor ops
    with no host sync: the verify budget's choose() split of a given total."""
    n, k = surv.shape
    flat = surv.t().reshape(-1)  # [k * n] position-major
    order = torch.sort(-flat, stable=True).indices
    ranks = torch.arange(n * k, device=surv.device)
    rank = torch.empty_like(order).scatter_(0, order, ranks)  # rank[r]: place of r in the order
    taken = (rank < total) & (flat > 0)
    return taken.view(k, n).sum(0)


class SplitRows(NamedTuple):
    """A bucket's per-row forward inputs, which the stage writes ([Tb]; the int32 ones [Bb])."""

    ids: torch.Tensor  # [Tb] int64; in: [:Bb] each request's anchor token (0: pending)
    positions: torch.Tensor  # [Tb] int64
    slots: torch.Tensor  # [Tb] int64, -1 on padding rows
    pending: torch.Tensor  # [Tb] int64; in: [:Bb] the slot whose next token is the anchor, 0
    draft_at: torch.Tensor  # [Tb] int64
    shift: torch.Tensor  # [Tb] int64
    row_req: torch.Tensor  # [Tb] int64
    query_lens: torch.Tensor  # [Bb] int32
    cu_query_lens: torch.Tensor  # [Bb + 1] int32
    context_lens: torch.Tensor  # [Bb] int32


def lay_out_split(
    fwd: SplitRows,
    tail,  # graph_tail.TailViews on the device; in: slots, room, req_shift, anchor_pos and,
    # in [:Bb], each request's seed, output index (counter) and temperature
    block_tables: torch.Tensor,  # [Bb, W] int32
    block_size: int,
    draft_ids: torch.Tensor,  # [slots + 1, k] int64, the pool's (-1: no draft)
    draft_conf: torch.Tensor,  # [slots + 1, k] float32, the pool's
) -> torch.Tensor:
    """Lay a split step's rows out in the bucket's buffers; returns the drafts each request
    verifies [Bb]. Padding requests (slot 0) get no row; rows past the requests' are padding
    (no KV slot, request 0), as graphs.prepare leaves them."""
    tb, bb = fwd.ids.shape[0], tail.slots.shape[0]
    k = draft_ids.shape[1]
    dev = fwd.ids.device
    slots = tail.slots
    real = slots > 0  # [Bb]
    # per-request inputs, read before the per-row writes below overwrite their buffers
    anchor, pend = fwd.ids[:bb].clone(), fwd.pending[:bb].clone()
    seed, n_out = tail.seed[:bb].clone(), tail.counter[:bb].clone()
    temp = tail.temperature[:bb].clone()
    start = tail.anchor_pos

    j = torch.arange(k, device=dev)
    ok = (draft_ids[slots] >= 0) & (j[None, :] < tail.room[:, None]) & real[:, None]  # [Bb, k]
    conf = torch.where(ok, draft_conf[slots].clamp(0.0, 1.0).nan_to_num(0.0), 0.0)
    num_verify = split_rows(torch.cumprod(conf, dim=1), tb - real.sum())  # [Bb]

    sq = torch.where(real, 1 + num_verify, 0)  # [Bb]
    cu = torch.cumsum(sq, 0)
    ftp = cu - sq  # padding requests: the total, as graphs.prepare writes them
    r = torch.arange(tb, device=dev)
    valid = r < cu[-1]  # [Tb]
    req = torch.where(valid, torch.searchsorted(cu, r, right=True).clamp_max(bb - 1), 0)
    local = torch.where(valid, r - ftp[req], 0)
    anchor_row = valid & (local == 0)
    pos = torch.where(valid, start[req] + local, 0)
    block = block_tables[req, pos // block_size].to(torch.int64)

    fwd.ids.copy_(torch.where(anchor_row, anchor[req], 0))
    fwd.pending.copy_(torch.where(anchor_row, pend[req], 0))
    fwd.positions.copy_(pos)
    fwd.slots.copy_(torch.where(valid, block * block_size + pos % block_size, -1))
    fwd.draft_at.copy_(torch.where(valid & (local > 0), slots[req] * k + local, 0))
    fwd.shift.copy_(torch.where(valid, tail.req_shift[req], 0))
    fwd.row_req.copy_(req)
    fwd.query_lens.copy_(sq)
    fwd.cu_query_lens[1:].copy_(cu)  # [0] is the host's 0
    fwd.context_lens.copy_(torch.where(real, start + sq, 0))

    tail.seqlens_q.copy_(sq)
    tail.ftp.copy_(ftp)
    tail.seed.copy_(torch.where(valid, seed[req], 0))
    tail.counter.copy_(torch.where(valid, n_out[req] + local, 0))
    tail.temperature.copy_(torch.where(valid, temp[req], 0.0))
    tail.draft.zero_()  # every verify row's draft is read from the pool (draft_at)
    return num_verify
