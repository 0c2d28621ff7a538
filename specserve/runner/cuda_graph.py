"""CUDA graphs for decode/verify steps: one graph per total_q bucket.

A step is graph-eligible when it is pure decode/verify (every request feeds its anchor row plus
its drafts, so every row wants logits), each request has at most 1 + k rows and the total rows
T fit the largest bucket. It runs as the graph of the smallest bucket >= T: the rows are copied
into static buffers, padded up to the bucket with rows that write no KV slot (slot -1) and belong
to no request (padding requests have query_len 0), and the graph computes the model forward of
all the bucket's rows up to the final norm; the lm_head then runs eagerly on the first T rows
only (padding rows cost no vocab-wide GEMM, and no [Tmax, V] fp32 logits buffer stays
allocated). A step of the common shape samples in a second graph instead (graph_tail.py): its
lm_head covers the bucket's Tb rows (at most 15 padding rows past T: little beside T rows),
so the shared graph pool holds [Tmax, V] fp32 logits (263 MB at 512 rows of a 128k
vocabulary).

A step with a prompt chunk (mixed: some rows want no logits, a request may have any number of
rows) runs as the graph of a mixed bucket (bucket_layout.mixed_sizes): the same layout, its
attention launched for any rows per request (max_query_len = the bucket's rows); the lm_head
runs eagerly on the rows that want logits. Eager, such a step is ~30 x 10 kernel launches at
~50 us of host time each (Triton's launcher, cuBLAS): ~20 ms on the 135M shape, 15 x its
device time. Steps past the largest mixed bucket, and steps scoring prompt logprobs, run eager.

The graph key is the number of rows, not requests x k: the layout is flat (DESIGN.md), so a
bucket of 24 rows serves 24 decodes or 6 requests verifying 3 drafts alike.

Numbers. The launch parameters the Triton attention derives from host values are fixed per bucket
(B = the bucket's request bound, max_query_len = min(bucket, 1 + k), max_context_len = a fixed
bound), so a bucket's kernels do not depend on the batch. With enforce_eager the same bucket
layout runs without a graph ("eager twin"): the same kernels on the same shapes, hence logits
bit-identical to the replay. Only CUDA uses buckets; the CPU path never sees them.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from tqdm.auto import tqdm

from specserve.ops.forward_context import ForwardContext, KVCache
from specserve.ops.transfer import h2d
from specserve.runner.bucket_layout import (
    BucketLayout,
    capture_sizes,
    mixed_sizes,
    pack_rows,
    pack_tables,
)
from specserve.runner.device_feed import feed_ids, shift_context_lens, shift_rows
from specserve.runner.device_split import SplitRows, lay_out_split
from specserve.runner.graph_tail import GraphTail, SampledTail, TailDrafting, TailViews


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Record fn (after warming it up) and return what replays it."""
        ...


class CudaGraphBackend:
    """torch.cuda.CUDAGraph with one memory pool shared by every bucket's graph: a replay's
    intermediates are dead once it ends, so graphs captured largest-first reuse the same memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)  # capture cannot run on the default stream
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        # Warm-up outside the capture: Triton JIT, cuBLAS handles, lazily built tables.
        for _ in range(2):
            fn()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            fn()
        self.graphs.append(graph)
        return graph.replay


@dataclass
class _Bucket:
    layout: BucketLayout
    max_query_len: int
    ids: torch.Tensor  # [Tb] int64, device views into the static buffer
    positions: torch.Tensor  # [Tb] int64
    slots: torch.Tensor  # [Tb] int64, -1 on padding rows
    pending: torch.Tensor  # [Tb] int64, slot whose next token feeds the row; 0 = ids[r]
    draft_at: torch.Tensor  # [Tb] int64, flat draft pool index + 1 fed at the row; 0 = ids[r]
    shift: torch.Tensor  # [Tb] int64, slot whose rejected rows move the row back; 0 = none
    row_req: torch.Tensor  # [Tb] int64, request of each row (0 on padding rows)
    query_lens: torch.Tensor  # [Bb] int32, 0 for padding requests
    cu_query_lens: torch.Tensor  # [Bb + 1] int32, flat (= T) after the real requests
    context_lens: torch.Tensor  # [Bb] int32, 0 for padding requests
    tail_views: TailViews  # device views of the sampling tail's inputs (graph_tail.py)
    replay: Callable[[], None] | None = None
    tail: Callable[[], None] | None = None  # the sampling tail, run eagerly
    tail_replay: Callable[[], None] | None = None  # ... and its graph
    drafted_tail: Callable[[], None] | None = None  # the tail of device-drafted steps
    drafted_tail_replay: Callable[[], None] | None = None
    split: Callable[[], None] | None = None  # a device-split step's layout (device_split.py)
    split_replay: Callable[[], None] | None = None
    # With speculation (max_query_len > 1) a second graph for steps where no request verifies
    # drafts, captured with max_query_len 1: its attention uses the decode tiles (16 rows, 128
    # keys per step) instead of tiles sized for 1 + k rows per request, so plain decoding in a
    # speculative engine (the verify budget keeping no drafts at high load) costs what it costs
    # in an engine without a drafter. Only buckets a decode step can fill (<= max_num_seqs rows).
    decode_replay: Callable[[], None] | None = None
    mixed: bool = False  # a mixed bucket: any rows per request, logits of some rows

    @property
    def rows(self) -> int:
        return self.layout.rows


@dataclass
class BucketStep:
    """A graph-eligible step, laid out on the host for its bucket (no device work yet)."""

    bucket: _Bucket
    num_rows: int  # T: the first T logit rows are the step's
    num_reqs: int
    width: int  # w: block-table columns the real requests use
    packed: np.ndarray  # uint8, the bucket layout with [B, w] block tables
    tail: bool = False  # its sampling runs in the bucket's tail (packed's front filled)
    # a device-drafted step sampling in the tail: its rows per request (graph_tail.py); split:
    # the most, the device choosing within num_rows in all (device_split.py)
    seqlens_q: list[int] | None = None
    split: bool = False
    logit_rows: torch.Tensor | None = None  # a mixed step's: [N] int64 rows that want logits

    def tail_views(self) -> TailViews:
        """Numpy views of packed's tail section (sampler_inputs.pack_tail fills them)."""
        return self.bucket.layout.split_tail(self.packed, np.int64, np.float32)


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[KVCache],
        block_size: int,
        max_num_seqs: int,
        max_rows_per_seq: int,  # 1 + k
        max_model_len: int,
        device: torch.device,
        hidden_size: int,
        dtype: torch.dtype,  # of the model's hidden states
        next_tokens: torch.Tensor,  # [slots] int64, the runner's device-resident sampled tokens
        draft_ids: torch.Tensor,  # [(slots + 1) * k] int64, the draft slot pool's (flat)
        rejected: torch.Tensor,  # [slots + 1] int64, the draft slot pool's
        tail: bool = False,  # capture each bucket's sampling tail too (graph_tail.py)
        drafting: TailDrafting | None = None,  # ... and one for device-drafted steps
        max_mixed_rows: int = 0,  # the most rows of a mixed step (0: mixed steps run eager)
    ) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.next_tokens = next_tokens
        self.draft_ids, self.rejected = draft_ids, rejected
        self.block_size = block_size
        self.max_query_len = max_rows_per_seq
        # Rows may run up to k positions past max_model_len while verifying near the end.
        self.max_context_len = max_model_len + max_rows_per_seq
        self.width = -(-self.max_context_len // block_size) + 1  # W: block-table columns
        self.sizes = capture_sizes(max_num_seqs * max_rows_per_seq)
        self.max_num_seqs = max_num_seqs
        self.use_graphs = True  # False: run the bucket layout eagerly (benchmarks, tests)
        self.num_replays = 0
        self.num_verify_replays = 0  # replays with some request verifying drafts
        self.num_decode_variant_replays = 0  # plain decode steps through a decode-shaped graph
        self.num_eager_runs = 0
        self.mixed_sizes = mixed_sizes(max_mixed_rows)
        layouts = [BucketLayout(t, min(t, max_num_seqs), self.width) for t in self.sizes]
        mixed = [BucketLayout(t, min(t, max_num_seqs), self.width) for t in self.mixed_sizes]
        nbytes = max(lay.max_bytes for lay in layouts + mixed)
        pin = device.type == "cuda"
        # Plain (not inference-mode) tensors: writable inside and outside inference mode.
        self._dev = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        # two staging buffers used in turn: filling one never waits for the copy of the other
        self._host = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        reqs = max(lay.reqs for lay in layouts + mixed)
        self._bt = torch.zeros(reqs, self.width, dtype=torch.int32, device=device)
        # The graphs end at the final norm: the lm_head runs eagerly on the step's T rows.
        rows = max(self.sizes + self.mixed_sizes)
        self._hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        # set once the H2D copy that reads each pinned staging buffer has run
        self._copied = [torch.cuda.Event() for _ in range(2)] if pin else None
        self._buckets = []
        for lay, t in zip(layouts, self.sizes):
            views = lay.split(self._dev, torch.int64, torch.int32)
            tail_views = lay.split_tail(self._dev, torch.int64, torch.float32)
            self._buckets.append(_Bucket(lay, min(t, max_rows_per_seq), *views, tail_views))
        self._mixed = []
        for lay in mixed:
            views = lay.split(self._dev, torch.int64, torch.int32)
            tail_views = lay.split_tail(self._dev, torch.int64, torch.float32)
            self._mixed.append(_Bucket(lay, lay.rows, *views, tail_views, mixed=True))
        self.tail: GraphTail | None = None
        if tail:
            self.tail = GraphTail(
                model, self._hidden, next_tokens, self.sizes[-1], layouts[-1].reqs, drafting
            )
            for b in self._buckets:
                b.tail = self.tail.function(b.tail_views, b.rows, b.layout.reqs)
                if drafting is not None:
                    b.drafted_tail = self.tail.drafted_function(
                        b.tail_views, b.draft_at, b.shift, b.row_req,
                        self._bt[: b.layout.reqs], b.rows, b.layout.reqs,
                    )  # fmt: skip
                    b.split = functools.partial(self._split_bucket, b, drafting.pool)
        self.num_tail_runs = 0
        self.num_drafted_tail_runs = 0  # of those, device-drafted steps
        self.num_split_runs = 0  # of those, device-split steps
        self.num_mixed_runs = 0  # steps through a mixed bucket (replayed or eager)
        self._keepalive: list[torch.Tensor] = []

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    # -- capture ------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, backend: GraphBackend, progress: bool = True) -> None:
        """One graph per bucket (two for buckets that also serve plain decode steps of a
        speculative engine), its tails', and with device drafting the device split's; the mixed
        buckets' first, largest first (the shared pool is sized by the first)."""
        buckets = self._mixed[::-1] + self._buckets[::-1]
        for b in tqdm(buckets, desc="Capturing CUDA graphs", unit="graph", disable=not progress):
            self._fill_padding(b)

            def run(b: _Bucket = b, decode: bool = False) -> None:
                self._hidden[: b.rows].copy_(self._forward_bucket(b, decode))

            b.replay = backend.capture(run)
            if self._has_decode_variant(b):
                b.decode_replay = backend.capture(functools.partial(run, b, True))
            if b.tail is not None:
                b.tail_replay = backend.capture(b.tail)
            if b.drafted_tail is not None:
                b.drafted_tail_replay = backend.capture(b.drafted_tail)
            if b.split is not None:
                b.split_replay = backend.capture(b.split)
                self._fill_padding(b)  # its warm-up laid rows out: captures stay padding
        # The graphs read the model's lazily built rotary table: if it were ever rebuilt (larger),
        # keeping the old one alive keeps their reads valid (same values at these positions).
        table = getattr(getattr(self.model, "rotary", None), "_table", None)
        if table is not None:
            self._keepalive.append(table)

    def _fill_padding(self, b: _Bucket) -> None:
        """Every row padding: warm-up and capture write no KV slot."""
        b.ids.zero_()
        b.positions.zero_()
        b.slots.fill_(-1)
        b.pending.zero_()
        b.draft_at.zero_()
        b.shift.zero_()
        b.row_req.zero_()
        b.query_lens.zero_()
        b.cu_query_lens.zero_()
        b.context_lens.zero_()
        for x in b.tail_views:
            x.zero_()

    def _has_decode_variant(self, b: _Bucket) -> bool:
        return not b.mixed and b.max_query_len > 1 and b.rows <= self.max_num_seqs

    def _forward_bucket(self, b: _Bucket, decode: bool = False) -> torch.Tensor:  # [Tb, hidden]
        bt = self._bt[: b.layout.reqs]
        ids = feed_ids(b.ids, b.pending, b.draft_at, self.next_tokens, self.draft_ids)
        pos, slots, corr = shift_rows(
            b.positions, b.slots, b.shift, b.row_req, bt, self.block_size, self.rejected
        )
        ctx = ForwardContext(
            query_lens=b.query_lens,
            cu_query_lens=b.cu_query_lens,
            context_lens=shift_context_lens(b.context_lens, b.cu_query_lens, b.query_lens, corr),
            block_tables=bt,
            slot_mapping=slots,
            max_query_len=1 if decode else b.max_query_len,
            max_context_len=self.max_context_len,
        )
        return self.model(ids, pos, self.kv_caches, ctx)

    def _split_bucket(self, b: _Bucket, pool) -> None:
        """A device-split step's layout, ahead of its forward (device_split.py)."""
        rows = SplitRows(
            b.ids, b.positions, b.slots, b.pending, b.draft_at, b.shift, b.row_req,
            b.query_lens, b.cu_query_lens, b.context_lens,
        )  # fmt: skip
        bt = self._bt[: b.layout.reqs]
        lay_out_split(rows, b.tail_views, bt, self.block_size, pool.draft_ids, pool.draft_conf)

    # -- one step -----------------------------------------------------------------------------
    def prepare(
        self,
        rows: Sequence[list[int]],
        starts: Sequence[int],
        tables: Sequence[list[int]],
        pending: np.ndarray | None = None,  # [T] int64, see BucketLayout
        draft_at: np.ndarray | None = None,  # [T] int64, see BucketLayout
        shift: np.ndarray | None = None,  # [T] int64, see BucketLayout
        num_logits: Sequence[int] | None = None,  # [n] last rows of each that want logits (all)
    ) -> BucketStep | None:
        """Host layout of a step, or None if no bucket takes it: a decode bucket's if every
        row wants logits and no request has more than 1 + k rows, else a mixed bucket's."""
        nreq = len(rows)
        qlens = np.fromiter(map(len, rows), dtype=np.int64, count=nreq)
        t = int(qlens.sum()) if nreq else 0
        if t == 0:
            return None
        every = num_logits is None or all(n == q for n, q in zip(num_logits, qlens.tolist()))
        if every and t <= self.max_rows and int(qlens.max()) <= self.max_query_len:
            b = self._buckets[bisect.bisect_left(self.sizes, t)]
        elif self.mixed_sizes and t <= self.mixed_sizes[-1]:
            b = self._mixed[bisect.bisect_left(self.mixed_sizes, t)]
        else:
            return None
        w = max(map(len, tables))
        if nreq > b.layout.reqs or w > self.width:
            return None
        packed, req, cum = pack_rows(
            b.layout, rows, qlens, starts, tables, w, self.block_size, pending, draft_at, shift
        )
        step = BucketStep(b, t, nreq, w, packed)
        if b.mixed:
            nl = np.asarray(num_logits, dtype=np.int64)
            keep = np.arange(t) >= (cum[1:] - nl)[req]  # the last num_logits[i] rows of each
            step.logit_rows = h2d(np.flatnonzero(keep), torch.int64, self.device)
        return step

    def prepare_split(
        self,
        anchors: Sequence[int],  # [n] each request's anchor token (0: read on the device)
        pending: Sequence[int],  # [n] the slot whose next token is its anchor, 0
        tables: Sequence[list[int]],
        total: int,  # the step's rows as the host chose them (its bucket)
    ) -> BucketStep | None:
        """A device-split step's forward inputs, per request (device_split.py lays its rows
        out on the device), or None if it is not eligible. Its tail section is packed by
        sampler_inputs.pack_tail(split=...)."""
        nreq = len(anchors)
        if not nreq or total > self.max_rows:
            return None
        b = self._buckets[bisect.bisect_left(self.sizes, total)]
        w = max(map(len, tables))
        if nreq > b.layout.reqs or w > self.width:
            return None
        lay = b.layout
        packed = np.zeros(lay.bt_at + 4 * nreq * w, dtype=np.uint8)
        ids, _, _, pend, *_ = lay.split(packed, np.int64, np.int32)
        ids[:nreq], pend[:nreq] = anchors, pending
        pack_tables(packed[lay.bt_at :].view(np.int32).reshape(nreq, w), tables)
        return BucketStep(b, total, nreq, w, packed, split=True)

    @torch.inference_mode()
    def run(self, step: BucketStep) -> torch.Tensor | SampledTail:
        """Copy the step into the static buffers, replay its bucket's graph (or run the bucket
        eagerly) and return the logits of its T rows [T, V] fp32, or with step.tail its sampled
        results on their way (the tail replayed behind the forward)."""
        b = step.bucket
        n = step.packed.nbytes
        at = 0 if step.tail else b.layout.fwd_at  # the tail's inputs travel only when it runs
        host = self._host[self._turn]
        if self._copied is not None:
            # the copy of two steps ago read this buffer; it ran before the previous step did
            self._copied[self._turn].synchronize()
        host.numpy()[at:n] = step.packed[at:]
        self._dev[at:n].copy_(host[at:n], non_blocking=True)
        if self._copied is not None:
            self._copied[self._turn].record()
        self._turn ^= 1
        nreq, w = step.num_reqs, step.width
        stage = self._dev[b.layout.bt_at : b.layout.bt_at + 4 * nreq * w].view(torch.int32)
        self._bt[:nreq, :w].copy_(stage.view(nreq, w))
        if step.split:
            (b.split_replay if self.use_graphs and b.split_replay is not None else b.split)()
            self.num_split_runs += 1
        # one row per request: a plain decode step (the eager twin takes the same variant)
        decode = step.num_rows == step.num_reqs and self._has_decode_variant(b)
        graph = self.use_graphs and b.replay is not None
        if graph:
            (b.decode_replay if decode else b.replay)()
            hidden = self._hidden[: step.num_rows]
        else:
            hidden = self._forward_bucket(b, decode)
            if step.tail:  # the tail reads the graph's static output
                self._hidden[: b.rows].copy_(hidden)
            hidden = hidden[: step.num_rows]
        if b.mixed:  # counted apart from the decode buckets'
            self.num_mixed_runs += 1
            if step.logit_rows.numel() == 0:  # as the eager path: no row samples
                return hidden.new_zeros((0, 0), dtype=torch.float32)
            return self.model.compute_logits(hidden[step.logit_rows])
        self.num_replays += graph
        self.num_eager_runs += not graph
        self.num_decode_variant_replays += graph and decode
        self.num_verify_replays += graph and step.num_rows > step.num_reqs
        if not step.tail:
            return self.model.compute_logits(hidden)
        self.num_tail_runs += 1
        if step.seqlens_q is None:
            (b.tail_replay if self.use_graphs and b.tail_replay is not None else b.tail)()
        else:
            self.num_drafted_tail_runs += 1
            graph = self.use_graphs and b.drafted_tail_replay is not None
            (b.drafted_tail_replay if graph else b.drafted_tail)()
            self.tail.after_drafted(b.tail_views, b.rows, step.num_reqs)
        return self.tail.readback(
            b.rows, b.layout.reqs, step.num_rows, step.num_reqs, step.seqlens_q, step.split
        )
