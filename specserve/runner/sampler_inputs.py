"""The per-row inputs of a step's verification, built on the host and uploaded as one buffer.

Each step the sampler needs, per row of the verify layout, the request's sampling parameters,
its RNG seed and counter and the draft the row checks, plus the layout itself (ftp,
row_to_req, local_step, is_verify). Built tensor by tensor that was ~10 host-to-device copies
and a handful of layout kernels per step, each a fixed host cost (on CUDA a pinned staging
copy and a launch): the largest share of the host's work per step at batch 1. Here the host,
which knows seqlens_q anyway, lays everything out with numpy in one byte buffer; one upload,
then typed views of it (the same dtypes and values as StepSampler built before:
SamplingTensors.build and sample.layout.build_layout).

A request's sampling parameters do not change while it runs: their row is packed once
(Sequence.sampling_row) and a step joins the rows of its requests.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence as Seq
from typing import NamedTuple

import numpy as np
import torch

from specserve.engine.sequence import Sequence
from specserve.ops.random import to_int64_bits
from specserve.ops.sampling import SamplingTensors
from specserve.ops.transfer import h2d
from specserve.sample.layout import RowLayout

# one request's sampling row: temperature, top_p, min_p (float32), top_k (int32), seed (int64),
# flags (int32: what SamplingTensors' any_*/all_* flags are made of, and what else the request
# needs of the sampler's slower paths: a step none of whose requests needs one skips its scan)
_ROW = struct.Struct("<fffiqi4x")
_ROW_DTYPE = np.dtype(
    {
        "names": ["temperature", "top_p", "min_p", "top_k", "seed", "flags"],
        "formats": ["<f4", "<f4", "<f4", "<i4", "<i8", "<i4"],
        "offsets": [0, 4, 8, 12, 16, 24],
        "itemsize": 32,
    }
)
assert _ROW.size == _ROW_DTYPE.itemsize
_GREEDY, _TOP_K, _TOP_P, _MIN_P = 1, 2, 4, 8
PENALTIES, PROCESSING, MIN_TOKENS, GOLDEN, LOGPROBS = 16, 32, 64, 128, 256


def _needs(p) -> int:
    return (
        PENALTIES * p.has_penalties
        | PROCESSING * p.has_logits_processing
        | MIN_TOKENS * (p.min_tokens > 0)
        | GOLDEN * (p.golden_token_ids is not None)
        | LOGPROBS * (p.logprobs is not None)
    )


def sampling_row(seq: Sequence) -> bytes:
    """The request's packed sampling row, made at its first step (its params are fixed once
    it is added). Greedy requests drop their filters, so SamplingTensors' any_* flags only
    wake up for requests that sample."""
    row = seq.sampling_row
    if row is None:
        p = seq.params
        seed = to_int64_bits(seq.seed)
        try:
            if p.greedy:
                row = _ROW.pack(0.0, 1.0, 0.0, 0, seed, _GREEDY | _needs(p))
            else:
                t, top_p, min_p, k = float(p.temperature), float(p.top_p), float(p.min_p), p.top_k
                flags = _TOP_K * (k > 0) | _TOP_P * (top_p < 1.0) | _MIN_P * (min_p > 0.0)
                flags |= _needs(p)
                row = _ROW.pack(t, top_p, min_p, int(k), seed, flags)
        except struct.error as e:  # what torch's int32 table raised before: an overflow
            raise OverflowError(
                f"request {seq.request_id}: sampling parameters overflow the sampler's table ({e})"
            ) from e
        seq.sampling_row = row
    return row


def _sampling_rows(seqs: Seq[Sequence]) -> np.ndarray:
    """Each request's packed sampling row."""
    return np.frombuffer(b"".join([sampling_row(s) for s in seqs]), dtype=_ROW_DTYPE)


def _output_index(seqs: Seq[Sequence]) -> np.ndarray:
    """Each request's output index: its output tokens, pending ones included (overlap), and
    its drafts in flight."""
    return np.fromiter(
        (
            len(s.token_ids) - len(s.prompt_token_ids) + s.num_pending + s.num_pending_drafts
            for s in seqs
        ),
        dtype=np.int64,
        count=len(seqs),
    )


def _draft_layout(drafts: Seq[list[int]], seqlens_q: list[int], t: int) -> tuple[np.ndarray, ...]:
    """seqlens_q, ftp [R], row_to_req, local_step, draft ids [T] (each request's drafts, then
    0 at its last row, which verifies nothing) of a step with drafts."""
    sq = np.array(seqlens_q, dtype=np.int64)
    ftp = np.cumsum(sq) - sq
    req = np.repeat(np.arange(len(sq)), sq)
    local = np.arange(t) - ftp[req]
    draft_ids = np.fromiter((x for d in drafts for x in (*d, 0)), np.int64, count=t)
    return sq, ftp, req, local, draft_ids


class _Sections(NamedTuple):
    seqlens_q: torch.Tensor  # [R] int64
    ftp: torch.Tensor  # [R] int64
    slots: torch.Tensor  # [R] int64
    seed: torch.Tensor  # [T] int64
    counter: torch.Tensor  # [T] int64
    row_to_req: torch.Tensor  # [T] int64
    local_step: torch.Tensor  # [T] int64
    draft_ids: torch.Tensor  # [T] int64
    top_k: torch.Tensor  # [T] int32
    temperature: torch.Tensor  # [T] float32
    top_p: torch.Tensor  # [T] float32
    min_p: torch.Tensor  # [T] float32
    is_verify: torch.Tensor  # [T] bool


class PackedInputs:
    """One step's upload, by dtype, every array 16-byte aligned: int64 seqlens_q, ftp,
    slots [R] and seed, counter, row_to_req, local_step, draft_ids [T]; int32 top_k [T];
    float32 temperature, top_p, min_p [T]; bool is_verify [T]. Each dtype's arrays are one run
    of (array, padding) pieces: one split call views them all (each view costs host time).

    Why aligned: Triton specialises a kernel on each pointer argument's 16-byte alignment and
    compiles a new variant (hundreds of milliseconds) the first time one comes up; packed
    back to back, the arrays' alignments followed the parities of R and T, and steps compiled
    the verification's kernels anew mid-run."""

    def __init__(self, num_reqs: int, total_q: int) -> None:
        r, t = num_reqs, total_q
        pr, pt, p4 = r & 1, t & 1, -t & 3  # int64 / float32 items up to a 16-byte boundary
        self.t = t
        self.i64 = [r, pr, r, pr, r, pr, t, pt, t, pt, t, pt, t, pt, t, pt]
        self.f32 = [t, p4, t, p4, t, p4]
        self.i32_at = 8 * (3 * (r + pr) + 5 * (t + pt))
        self.f32_at = self.i32_at + 4 * (t + p4)
        self.bool_at = self.f32_at + 12 * (t + p4)
        self.nbytes = self.bool_at + t

    def host(self) -> tuple[np.ndarray, _Sections]:
        """(buffer, numpy views of its arrays) to fill."""
        buf = np.empty(self.nbytes, dtype=np.uint8)
        a, f = buf[: self.i32_at].view(np.int64), buf[self.f32_at : self.bool_at].view(np.float32)
        k = buf[self.i32_at : self.i32_at + 4 * self.t].view(np.int32)
        return buf, _Sections(*_pieces(a, self.i64), k, *_pieces(f, self.f32),
                              buf[self.bool_at :].view(np.bool_))  # fmt: skip

    def device(self, buf: torch.Tensor) -> _Sections:
        """The uploaded buffer's arrays (views: one split call per dtype)."""
        a = buf[: self.i32_at].view(torch.int64).split_with_sizes(self.i64)
        f = buf[self.f32_at : self.bool_at].view(torch.float32).split_with_sizes(self.f32)
        k = buf[self.i32_at : self.i32_at + 4 * self.t].view(torch.int32)
        return _Sections(*a[::2], k, *f[::2], buf[self.bool_at :].view(torch.bool))


def _pieces(x: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """The arrays of a run of (array, padding) pieces."""
    out, at = [], 0
    for i in range(0, len(sizes), 2):
        out.append(x[at : at + sizes[i]])
        at += sizes[i] + sizes[i + 1]
    return out


class SamplerInputs(NamedTuple):
    layout: RowLayout
    t: SamplingTensors  # per row
    draft_ids: torch.Tensor  # [total_q] int64, 0 on rows that check no draft
    slots: torch.Tensor  # [R] int64
    seqlens_q: list[int]
    needs: int  # PENALTIES | PROCESSING | ...: what some request of the step needs


def build_inputs(
    seqs: Seq[Sequence], drafts: Seq[list[int]], device: torch.device
) -> SamplerInputs:
    """The per-row inputs of a step's sampling requests, in one upload. A row's counter is the
    index of the output token it would produce: the request's output tokens, pending ones
    included (overlap), plus its local step."""
    r = len(seqs)
    seqlens_q = [1 + len(d) for d in drafts]
    t = sum(seqlens_q)
    lay = PackedInputs(r, t)
    buf, v = lay.host()
    rows, n_out = _sampling_rows(seqs), _output_index(seqs)
    v.slots[:] = np.fromiter((s.slot for s in seqs), dtype=np.int64, count=r)
    if t == r:  # no drafts: a row per request
        v.seqlens_q[:] = 1
        v.ftp[:] = v.row_to_req[:] = np.arange(r)
        v.local_step[:] = v.draft_ids[:] = 0
        v.is_verify[:] = False
        per_row = rows
        v.counter[:] = n_out
    else:
        sq, ftp, req, local, draft_ids = _draft_layout(drafts, seqlens_q, t)
        v.seqlens_q[:], v.ftp[:], v.row_to_req[:], v.local_step[:] = sq, ftp, req, local
        v.is_verify[:] = local != sq[req] - 1
        v.draft_ids[:] = draft_ids
        per_row = rows[req]
        v.counter[:] = n_out[req] + local
    v.seed[:] = per_row["seed"]
    v.top_k[:] = per_row["top_k"]
    v.temperature[:], v.top_p[:], v.min_p[:] = (
        per_row["temperature"], per_row["top_p"], per_row["min_p"]
    )  # fmt: skip
    d = lay.device(h2d(buf, torch.uint8, device))
    flags = rows["flags"]
    any_flags, all_flags = int(np.bitwise_or.reduce(flags)), int(np.bitwise_and.reduce(flags))
    st = SamplingTensors(
        temperature=d.temperature,
        top_k=d.top_k,
        top_p=d.top_p,
        min_p=d.min_p,
        seed=d.seed,
        counter=d.counter,
        all_greedy=bool(all_flags & _GREEDY),
        any_greedy=bool(any_flags & _GREEDY),
        any_top_k=bool(any_flags & _TOP_K),
        any_top_p=bool(any_flags & _TOP_P),
        any_min_p=bool(any_flags & _MIN_P),
        max_top_k=int(rows["top_k"].max()),
    )
    layout = RowLayout(
        d.seqlens_q, d.ftp, d.row_to_req, d.local_step, d.is_verify, t, max(seqlens_q) - 1
    )
    return SamplerInputs(layout, st, d.draft_ids, d.slots, seqlens_q, any_flags & ~(PENALTIES - 1))


# what only the eager sampler does: a request needing one of these keeps a step out of the tail
_EAGER_ONLY = _TOP_K | _TOP_P | _MIN_P | PENALTIES | PROCESSING | MIN_TOKENS | GOLDEN | LOGPROBS


def tail_compatible(seqs: Seq[Sequence]) -> bool:
    """May a device-drafted step of these requests sample in the graph tail (pack_tail)?"""
    flags = int(np.bitwise_or.reduce(_sampling_rows(seqs)["flags"])) if seqs else 0
    return not flags & _EAGER_ONLY & ~GOLDEN


def pack_tail(
    seqs: Seq[Sequence],
    drafts: Seq[list[int]],
    views,
    feed: tuple[Seq[bool], Seq[int]] | None = None,
    split: Seq[int] | None = None,
) -> bool:
    """Lay out a step's sampling inputs for its bucket's captured tail (runner/graph_tail.py:
    views are numpy views of the bucket's host upload, padded to Tb rows / Bb requests). False,
    with nothing of use written, when some request needs the eager sampler.

    feed (device-drafted steps: each request's shift flag and anchor KV position): drafts are
    placeholders for the slot pool's, golden tokens come from the pool's table; each request's
    block count goes along (a model drafter's chain maps its positions past them to its trash
    block). split (with feed: a device-split step, each request's room): the per-row inputs go
    per request, in the first entries of their arrays; the device lays the rows out
    (runner/device_split.py)."""
    rows = _sampling_rows(seqs)
    eager_only = _EAGER_ONLY & ~GOLDEN if feed is not None else _EAGER_ONLY
    if int(np.bitwise_or.reduce(rows["flags"])) & eager_only:
        return False
    n_out = _output_index(seqs)
    r = len(seqs)
    seqlens_q = [1 + len(d) for d in drafts]
    t = sum(seqlens_q) if split is None else r
    v = views
    v.slots[:r] = np.fromiter((s.slot for s in seqs), dtype=np.int64, count=r)
    if t == r:  # no drafts: a row per request (split: one entry per request)
        v.seqlens_q[:r] = 1
        v.ftp[:r] = np.arange(r)
        per_row = rows
        v.counter[:t] = n_out
        v.draft[:t] = 0
    else:
        sq, ftp, req, local, draft_ids = _draft_layout(drafts, seqlens_q, t)
        v.seqlens_q[:r], v.ftp[:r] = sq, ftp
        per_row = rows[req]
        v.counter[:t] = n_out[req] + local
        v.draft[:t] = draft_ids
    v.seed[:t] = per_row["seed"]
    v.temperature[:t] = per_row["temperature"]
    v.slots[r:], v.seqlens_q[r:], v.ftp[r:] = 0, 0, t
    v.seed[t:], v.counter[t:], v.draft[t:], v.temperature[t:] = 0, 0, 0, 0.0
    if feed is not None:
        shifts, anchors = feed
        v.req_shift[:r] = np.fromiter(
            (s.slot if sh else 0 for s, sh in zip(seqs, shifts)), dtype=np.int64, count=r
        )
        v.anchor_pos[:r] = anchors
        v.num_blocks[:r] = np.fromiter(
            (len(s.block_table.blocks) for s in seqs), dtype=np.int64, count=r
        )
        v.room[:r] = 0 if split is None else split
        v.req_shift[r:], v.anchor_pos[r:], v.num_blocks[r:], v.room[r:] = 0, 0, 0, 0
    return True
