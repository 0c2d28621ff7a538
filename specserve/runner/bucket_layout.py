"""A bucket's upload: the bucket sizes (total_q) CUDA graphs are captured for, the byte layout
of one bucket's inputs, in the pinned staging buffer and on the device alike, so one copy moves
a step's inputs (runner/cuda_graph.py replays them, graph_tail.py and device_split.py read
them), and a step's rows packed into it."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from specserve.runner.graph_tail import TailViews

# Past this many rows a step is long enough (the 8B's GEMMs turn compute-bound around 256 rows on
# an H200) that launch overhead is a small share of it, and more graphs only cost start-up time.
MAX_CAPTURE_ROWS = 512
_I64_ARRAYS = 7  # ids, positions, slots, pending, draft_at, shift, row_req
# The largest mixed bucket (a prompt chunk beside decodes, cuda_graph.py): an eager step of
# the 135M shape costs ~20 ms of host launches against ~1.4 ms of device time (H100, 64
# decodes + a 150-token prompt); past 2048 rows even the 135M's prefill is long enough to hide
# them, and the 8B's is compute-bound well before.
MAX_MIXED_ROWS = 2048


def capture_sizes(max_rows: int, cap: int = MAX_CAPTURE_ROWS) -> list[int]:
    """Buckets 1, 2, 4, 8, then every 8 rows up to 256, every 16 above, ending at min(max_rows,
    cap). Decode is weight-bandwidth-bound: a few padding rows cost almost nothing (the GEMMs'
    row tiles are 64+ rows anyway), so step 8 keeps waste under 8 rows with ~40 graphs; the
    powers of two below 8 spare batch-1..4 decode the padded attention rows."""
    top = max(1, min(max_rows, cap))
    sizes, b = [], 1
    while b < top:
        sizes.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 256 else 16)
    sizes.append(top)
    return sizes


def mixed_sizes(max_rows: int, cap: int = MAX_MIXED_ROWS) -> list[int]:
    """Mixed buckets: every 64 rows up to 512, every 128 above, ending at min(max_rows, cap).
    Padding rows cost compute where a step is compute-bound, so the steps stay a small share
    of the bucket (<= 64 rows, <= 128 past 512: under 13 %)."""
    top = min(max_rows, cap)
    if top < 1:
        return []
    sizes = [b for b in range(64, min(top, 512) + 1, 64)]
    sizes += range(640, top + 1, 128)
    if not sizes or sizes[-1] < top:
        sizes.append(top)
    return sizes


class BucketLayout:
    """Byte layout of one bucket's inputs, the same in the pinned staging buffer and on the
    device, so one copy moves them all. First the sampling tail's (graph_tail.py; uploaded only
    for a step that samples in the graph): int64 seed | counter | draft [Tb] | seqlens_q | ftp |
    slots | req_shift | anchor_pos | num_blocks | room [Bb] (the last four: device-drafted steps),
    float32 temperature [Tb] (8-byte padded). Then the forward's: int64 ids |
    positions | slots | pending | draft_at | shift | row_req [Tb], int32 query_lens [Bb] |
    cu_query_lens [Bb + 1] | context_lens [Bb], then the int32 block tables of the step's real
    requests, compact [B, w] (scattered into the [Bb, W] table on the device). pending,
    draft_at and shift are the device-side inputs of overlap scheduling (device_feed.py),
    applied inside the graph."""

    def __init__(self, rows: int, reqs: int, width: int) -> None:
        self.rows, self.reqs = rows, reqs
        self.tail_f32_at = 8 * (3 * rows + 7 * reqs)
        self.fwd_at = self.tail_f32_at + 8 * -(-rows // 2)  # float32 [Tb], 8-byte padded
        self.i32_at = self.fwd_at + 8 * _I64_ARRAYS * rows
        self.bt_at = self.i32_at + 4 * (3 * reqs + 1)
        self.max_bytes = self.bt_at + 4 * reqs * width

    def split(self, buf, i64, i32):  # buf: uint8 np.ndarray or torch.Tensor -> typed views
        t, b = self.rows, self.reqs
        a = buf[self.fwd_at : self.i32_at].view(i64)
        c = buf[self.i32_at : self.bt_at].view(i32)
        return (
            *(a[i * t : (i + 1) * t] for i in range(_I64_ARRAYS)),
            c[:b],
            c[b : 2 * b + 1],
            c[2 * b + 1 :],
        )

    def split_tail(self, buf, i64, f32) -> TailViews:
        t, b = self.rows, self.reqs
        a = buf[: self.tail_f32_at].view(i64)
        temp = buf[self.tail_f32_at : self.tail_f32_at + 4 * t].view(f32)
        per_req = (a[3 * t + i * b : 3 * t + (i + 1) * b] for i in range(7))
        return TailViews(a[:t], a[t : 2 * t], a[2 * t : 3 * t], *per_req, temp)


def pack_tables(bt: np.ndarray, tables: Sequence[list[int]]) -> None:
    """The requests' block tables into bt [B, w] (zero past each), all at once: a numpy
    assignment per request cost ~1 us each at 256 requests."""
    nreq, w = bt.shape
    lens = list(map(len, tables))
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=sum(lens))
    if flat.shape[0] == nreq * w:  # all of one width (always at batch 1)
        bt[:] = flat.reshape(nreq, w)
    else:
        used = np.arange(w) < np.array(lens)[:, None]  # [B, w]
        bt[~used] = 0
        bt[used] = flat


def pack_rows(
    lay: BucketLayout,
    rows: Sequence[list[int]],  # [n] each request's tokens
    qlens: np.ndarray,  # [n] int64, their lengths
    starts: Sequence[int],  # [n] KV position of each request's first row
    tables: Sequence[list[int]],
    width: int,  # w: block-table columns of the widest request
    block_size: int,
    pending: np.ndarray | None,  # [T] int64 (see BucketLayout), None: zeros
    draft_at: np.ndarray | None,
    shift: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The forward's section of a step in `lay` (rows past T padding: no KV slot, request
    0; padding requests: no rows, context 0), with the [n, w] block tables; returns it (uint8),
    each row's request [T] and the requests' row offsets [n + 1]."""
    nreq, t = len(rows), int(qlens.sum())
    packed = np.empty(lay.bt_at + 4 * nreq * width, dtype=np.uint8)
    ids, pos, slots, pend, at, sh, rr, q, cu, ctx = lay.split(packed, np.int64, np.int32)
    bt = packed[lay.bt_at :].view(np.int32).reshape(nreq, width)
    pack_tables(bt, tables)
    cum = np.zeros(nreq + 1, dtype=np.int64)
    np.cumsum(qlens, out=cum[1:])
    req = np.repeat(np.arange(nreq), qlens)  # [T] request of each row
    start = np.asarray(starts, dtype=np.int64)
    p = start[req] + (np.arange(t) - cum[req])  # [T] KV position of each row
    ids[:t] = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=t)
    pos[:t] = p
    slots[:t] = bt[req, p // block_size].astype(np.int64) * block_size + p % block_size
    ids[t:], pos[t:], slots[t:] = 0, 0, -1
    for dst, src in ((pend, pending), (at, draft_at), (sh, shift)):
        dst[:t] = 0 if src is None else src
        dst[t:] = 0
    rr[:t], rr[t:] = req, 0
    q[:nreq], q[nreq:] = qlens, 0
    cu[: nreq + 1], cu[nreq + 1 :] = cum, t
    ctx[:nreq], ctx[nreq:] = start + qlens, 0
    return packed, req, cum
