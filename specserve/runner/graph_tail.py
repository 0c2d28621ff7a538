"""The sampling tail of a decode/verify step inside the bucket's CUDA graph.

A bucket step's forward is one graph replay, a few microseconds of host time. What follows it
eagerly (the lm_head, the sampler's upload, the verification's launches from Python, the
next_tokens write, packing the results for the readback) costs the host several times that per
step, and at a small model's batch 1 the host can be what the step waits for. For a step of the
common shape the tail is captured too, one graph per bucket replayed right after the forward's:

    logits [Tb, V] = lm_head(hidden [Tb])        (at most 15 padding rows past the step's T)
    verification of every row (sample/verify.py: verify_padded)
    next_tokens[slots] = sampled                 (the next overlapped step reads them there)
    out = verified [Tb] | sampled [Bb] | num_accepted [Bb]     (int64, one static buffer)

then one copy of `out` to pinned host memory. Its inputs (seeds, counters, drafts, temperatures,
seqlens_q, ftp, slots) travel in the front of the bucket's one upload (bucket_layout.BucketLayout), laid
out by sampler_inputs.pack_tail; no SamplerPlan is built.

Common shape (pack_tail): every request greedy or temperature-only, with no logits processing,
penalties, min_tokens, golden tokens or logprobs, its drafts known to the host or none (no device
drafter, no draft-model q), its sampling not deferred. Every other step runs the eager sampler
(step_sampler.py) after the forward graph, as before.

Padding: rows T..Tb-1 belong to no request and requests R..Bb-1 own no row (seqlens_q 0: nothing
accepted, a token nobody reads) with slot 0, whose next_tokens entry no row reads.

Device-drafted steps (a drafter that gives a `TailDrafting`) take a second tail per bucket, the
eager sampler's device-feed path captured whole (device_feed.py):

    drafts and golden tokens read from the slot pool, output indices corrected by the
        rejections of the step in flight                      (feed_verify_rows)
    logits, verification, next_tokens                        (as above, golden tokens forced)
    drafts verified, their confidences; the pool's lengths and rejections advanced
                                                              (drafted_and_advance)
    the drafter's drafts for the next step into the pool      (TailDrafting.draft)
    out += drafts verified [Bb]; fout = their confidences [Tb] | the next drafts' [Bb, k]

so a step with speculation on costs the host what a plain step does: a zero-draft step of a
speculative engine no longer pays the eager sampler. The feed's per-row indices are the
forward's (a verify row checks the draft fed at the row after it); its per-request ones travel
in the tail section (req_shift, anchor_pos; num_blocks for a model drafter).

Golden drafts inside it. A model drafter (EAGLE-3 head, draft model) in a steady greedy step
(speculative/device_drafting.py: tail_ready) has the tail write its chain's static inputs
instead (draft_graphs.py: tail_inputs), then replays its chain's own graph right behind it
(TailDrafting.after), bucketed by the step's real requests: a forward bucket of Tb rows pads to
Bb = min(Tb, max_num_seqs) requests, k + 1 times the real ones at k + 1 rows a request, and a
head or draft-model forward over that padding would cost its share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from specserve.engine.ledger import HostStepResult
from specserve.engine.slots import DraftSlotPool
from specserve.ops.transfer import designed_sync
from specserve.runner.device_feed import DraftFeed, drafted_and_advance, feed_verify_rows
from specserve.sample.layout import RowLayout
from specserve.sample.verify import VerifyResult, verify_padded


class TailViews(NamedTuple):
    """A bucket's tail inputs (device: static views the graph reads; host: where pack_tail
    writes), each padded to the bucket's Tb rows / Bb requests."""

    seed: torch.Tensor | np.ndarray  # [Tb] int64
    counter: torch.Tensor | np.ndarray  # [Tb] int64, output index each row would produce
    draft: torch.Tensor | np.ndarray  # [Tb] int64, the draft each verify row checks
    seqlens_q: torch.Tensor | np.ndarray  # [Bb] int64, 0 for padding requests
    ftp: torch.Tensor | np.ndarray  # [Bb] int64
    slots: torch.Tensor | np.ndarray  # [Bb] int64, 0 for padding requests
    # device-drafted steps (DraftFeed's per-request half; the per-row half is the forward's)
    req_shift: torch.Tensor | np.ndarray  # [Bb] int64
    anchor_pos: torch.Tensor | np.ndarray  # [Bb] int64
    num_blocks: torch.Tensor | np.ndarray  # [Bb] int64, the request's blocks (0: padding)
    # a device-split step (device_split.py): the most drafts each request may verify, all
    # counted as in flight by the host; 0 in any other step
    room: torch.Tensor | np.ndarray  # [Bb] int64
    temperature: torch.Tensor | np.ndarray  # [Tb] float32, 0 = greedy


class TailStep(NamedTuple):
    """What a device-drafted tail hands its drafter, on the device, padded to the bucket."""

    views: TailViews
    row_req: torch.Tensor  # [Tb] int64
    result: VerifyResult
    seq_len: torch.Tensor  # [Bb] int64, lengths after the step
    # [Bb, W] int32, the forward's: columns past a request's num_blocks hold stale blocks
    block_tables: torch.Tensor


class TailDrafting(NamedTuple):
    """A device drafter whose work fits the tail: fixed shapes, no host input per step."""

    pool: DraftSlotPool
    # inside the tail: the next step's drafts and their confidences into the pool (padding
    # requests: slot 0), or (with `after`) the inputs of the drafter's own graph
    draft: Callable[[TailStep], None]
    # behind the tail's replay, given the step's requests r: the drafter's own graph (a model
    # drafter's chain, bucketed by r rather than by the forward's Bb), writing the pool
    after: Callable[[int], None] | None = None


class SampledTail:
    """A tail's results on their way to the host (the interface of step_sampler.SampledStep).
    seqlens_q: a device-drafted step's rows per request (its results carry the drafts); split:
    the device chose them, at most these (device_split.py), and its results are handed on in
    the host's layout, each request's rows past the device's checking -1 (no draft there)."""

    def __init__(
        self,
        host: tuple[torch.Tensor, torch.Tensor],  # int64 and float32 pinned buffers
        event,
        rows: int,
        reqs: int,
        t: int,
        r: int,
        seqlens_q: list[int] | None = None,
        k: int = 0,
        split: bool = False,
    ) -> None:
        self._buf, self._event = host, event
        self._at = (rows, reqs, t, r)
        self._drafted = (seqlens_q, k, split)
        self._host: HostStepResult | None = None

    def wait(self) -> HostStepResult:
        if self._host is None:
            if self._event is not None:
                with designed_sync():
                    self._event.synchronize()
            rows, reqs, t, r = self._at
            seqlens_q, k, split = self._drafted
            ints = self._buf[0][: rows + (4 if split else 3 if seqlens_q else 2) * reqs].tolist()
            verified = ints[:t]
            confs = real = nxt = None
            if seqlens_q is not None:
                real = ints[rows + 2 * reqs : rows + 2 * reqs + r]
                dev_sq = ints[rows + 3 * reqs : rows + 3 * reqs + r] if split else seqlens_q
                floats = self._buf[1][: rows + reqs * k].tolist()
                nxt = [floats[rows + i * k : rows + (i + 1) * k] for i in range(r)]
                confs, at = [], 0
                for n, sq in zip(real, dev_sq):  # a request's real drafts come first
                    confs.append(floats[at : at + n])
                    at += sq
                if split:
                    verified, at = [], 0
                    for sq, room in zip(dev_sq, seqlens_q):
                        verified += ints[at : at + sq]
                        verified += [-1] * (room - sq)
                        at += sq
            self._host = HostStepResult(
                verified,
                ints[rows : rows + r],
                ints[rows + reqs : rows + reqs + r],
                None,
                None,
                None,
                None,
                confs,
                real,
                nxt,
            )
            self._buf = None  # the ring may hand the buffer on
        return self._host


class GraphTail:
    """The tails' static output, the readback ring and the function each bucket captures."""

    def __init__(
        self,
        model: torch.nn.Module,
        hidden: torch.Tensor,  # [Tmax, H] the forward graphs' static output
        next_tokens: torch.Tensor,  # [slots] int64
        max_rows: int,
        max_reqs: int,
        drafting: TailDrafting | None = None,
    ) -> None:
        self.model, self.hidden, self.next_tokens = model, hidden, next_tokens
        self.drafting = drafting
        device = hidden.device
        k = drafting.pool.k if drafting is not None else 0
        n, nf = max_rows + 4 * max_reqs, max_rows + max_reqs * k
        self.out = torch.zeros(n, dtype=torch.int64, device=device)
        self.fout = torch.zeros(nf, dtype=torch.float32, device=device)
        self._rows = torch.arange(max_rows, dtype=torch.int64, device=device)
        self._zero = torch.zeros(1, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        # two pinned buffers in turn: a step's readback lands in one while the host still reads
        # the other (overlap keeps one step in flight); a buffer's previous owner is read first
        self._host = [
            (
                torch.zeros(n, dtype=torch.int64, pin_memory=pin),
                torch.zeros(nf, dtype=torch.float32, pin_memory=pin),
            )
            for _ in range(2)
        ]
        self._owner: list[SampledTail | None] = [None, None]
        self._turn = 0

    def function(self, views: TailViews, rows: int, reqs: int):
        """What a bucket of Tb = rows rows and Bb = reqs requests captures."""

        def tail() -> None:
            logits = self.model.compute_logits(self.hidden[:rows])  # [Tb, V] float32
            res = verify_padded(
                logits, views.draft, views.temperature, views.seed, views.counter,
                views.seqlens_q, views.ftp,
            )  # fmt: skip
            self.next_tokens.index_copy_(0, views.slots, res.sampled_token_ids)
            self.out[:rows].copy_(res.verified_token_ids)
            self.out[rows : rows + reqs].copy_(res.sampled_token_ids)
            self.out[rows + reqs : rows + 2 * reqs].copy_(res.num_accepted)

        return tail

    def drafted_function(
        self,
        views: TailViews,
        fwd_draft_at: torch.Tensor,  # [Tb] int64, the forward's: pool index + 1 fed at the row
        fwd_shift: torch.Tensor,  # [Tb] int64, the forward's
        row_req: torch.Tensor,  # [Tb] int64, the forward's (0 on padding rows)
        block_tables: torch.Tensor,  # [Bb, W] int32, the forward's
        rows: int,
        reqs: int,
    ):
        """What a bucket captures for device-drafted steps (module docstring)."""
        drafting = self.drafting
        pool, k, v = drafting.pool, drafting.pool.k, views
        at_rows = self._rows[:rows]

        def tail() -> None:
            # verify row r checks the draft fed at row r + 1 (a request's last row checks none:
            # the next row is another request's anchor, or padding, both fed no draft)
            at = torch.cat([fwd_draft_at[1:], self._zero])  # [Tb]
            feed = DraftFeed(at, fwd_shift, v.req_shift, v.anchor_pos, v.room)
            # golden tokens from the pool's table (allocated before capture: tail_drafting)
            gold = (row_req, v.slots)
            counter, draft, forced = feed_verify_rows(v.counter, v.draft, feed, pool, gold)
            logits = self.model.compute_logits(self.hidden[:rows])  # [Tb, V] float32
            res = verify_padded(
                logits, draft, v.temperature, v.seed, counter, v.seqlens_q, v.ftp, forced
            )
            self.next_tokens.index_copy_(0, v.slots, res.sampled_token_ids)
            local = at_rows - v.ftp[row_req]  # padding rows: past request 0's rows
            layout = RowLayout(
                v.seqlens_q, v.ftp, row_req, local, local < v.seqlens_q[row_req] - 1, rows, k
            )
            count, conf, seq_len = drafted_and_advance(
                layout, v.slots, res.num_accepted, draft, feed, pool
            )
            drafting.draft(TailStep(v, row_req, res, seq_len, block_tables))
            out = self.out
            out[:rows].copy_(res.verified_token_ids)
            out[rows : rows + reqs].copy_(res.sampled_token_ids)
            out[rows + reqs : rows + 2 * reqs].copy_(res.num_accepted)
            out[rows + 2 * reqs : rows + 3 * reqs].copy_(count)
            out[rows + 3 * reqs : rows + 4 * reqs].copy_(v.seqlens_q)  # a split step's rows
            self.fout[:rows].copy_(conf)
            if drafting.after is None:  # else the drafts are yet to come (after_drafted)
                self.fout[rows : rows + reqs * k].copy_(pool.draft_conf[v.slots].view(-1))

        return tail

    def after_drafted(self, views: TailViews, rows: int, r: int) -> None:
        """Behind a device-drafted tail of r requests: the drafter's own graph, if it has one,
        and the confidences of the drafts it wrote into the readback."""
        drafting = self.drafting
        if drafting.after is None:
            return
        drafting.after(r)
        pool, k = drafting.pool, drafting.pool.k
        out = self.fout[rows : rows + r * k].view(r, k)
        torch.index_select(pool.draft_conf, 0, views.slots[:r], out=out)

    def readback(
        self,
        rows: int,
        reqs: int,
        t: int,
        r: int,
        seqlens_q: list[int] | None = None,
        split: bool = False,
    ) -> SampledTail:
        """Queue the copy of the tail just replayed for a step of t rows and r requests
        (seqlens_q: a device-drafted step's rows per request; split: the most, the device's
        read back with the results)."""
        i = self._turn
        self._turn ^= 1
        owner = self._owner[i]
        if owner is not None:
            owner.wait()  # read before its buffer is reused (already done in a normal loop)
        host = self._host[i]
        k = self.drafting.pool.k if seqlens_q is not None else 0
        n = rows + (4 if split else 3 if seqlens_q is not None else 2) * reqs
        nf = rows + reqs * k if seqlens_q is not None else 0
        event = None
        if self.out.is_cuda:
            host[0][:n].copy_(self.out[:n], non_blocking=True)
            if nf:
                host[1][:nf].copy_(self.fout[:nf], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host[0][:n].copy_(self.out[:n])
            host[1][:nf].copy_(self.fout[:nf])
        sampled = SampledTail(host, event, rows, reqs, t, r, seqlens_q, k, split)
        self._owner[i] = sampled
        return sampled
