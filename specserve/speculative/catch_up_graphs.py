"""CUDA graphs of a model drafter's catch-up forward over any rows: a prompt's catch-up in the
step that samples its last chunk, and a gap catch-up when drafting resumes after plain steps.

Their rows change from step to step (a prompt's length, a gap's), so run eagerly each is a
forward's worth of launches on shapes the host has rarely seen; a small head's step is then
bound by the host. Captured per rows bucket, a catch-up copies its rows into static buffers and
replays, as the target's mixed steps do (runner/cuda_graph.py): the layout is flat, any rows per
request, the attention launched for max_query_len = the bucket's rows and Rb = min(rows,
requests) requests. Padding rows write no KV slot and belong to no request; padding requests have
no rows. Only the rows the caller names come out (one per request), copied into static outputs.

Buckets: 8, 16, 32 rows, then the mixed steps' (bucket_layout.mixed_sizes); a catch-up past the
largest runs eagerly. Without CUDA (or before capture) every catch-up runs eagerly, unpadded.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from specserve.ops.forward_context import ForwardContext
from specserve.runner.bucket_layout import MAX_MIXED_ROWS, mixed_sizes

# (tokens [C], positions [C], ctx, rows [R] int64) -> the forward's outputs at rows, each
# [R, ...] (None: an output this drafter lacks, e.g. a head without a confidence head)
Outputs = tuple[torch.Tensor | None, ...]
RowsForward = Callable[[torch.Tensor, torch.Tensor, ForwardContext, torch.Tensor], Outputs]


def catch_up_sizes(max_rows: int = MAX_MIXED_ROWS) -> list[int]:
    """Small buckets for short gaps, then the mixed steps' buckets."""
    return [b for b in (8, 16, 32) if b < max_rows] + mixed_sizes(max_rows)


class CatchUpGraphs:
    def __init__(
        self,
        forward: RowsForward,
        max_reqs: int,
        width: int,  # block-table columns
        max_context_len: int,  # the bound every replay attends with (the chain's)
        device: torch.device,
        max_rows: int = MAX_MIXED_ROWS,
        padded: bool | None = None,  # buckets (None: on CUDA); a CPU test's fake graphs: True
    ) -> None:
        self.forward = forward
        self.max_reqs, self.max_context_len = max_reqs, max_context_len
        padded = device.type == "cuda" if padded is None else padded
        self.sizes = catch_up_sizes(max_rows) if padded else []
        c, r = max(self.sizes, default=0), max_reqs
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.tokens = torch.zeros(c, **i64)
        self.positions = torch.zeros(c, **i64)
        self.slots = torch.full((c,), -1, **i64)
        self.query_lens = torch.zeros(r, **i32)
        self.cu_query_lens = torch.zeros(r + 1, **i32)
        self.context_lens = torch.zeros(r, **i32)
        self.block_tables = torch.zeros(r, width, **i32)
        self.rows = torch.zeros(r, **i64)
        self.out: list[torch.Tensor | None] = []  # [max_reqs, ...] each, the captured outputs
        self._replays: dict[int, Callable[[], None]] = {}
        self.num_replays = 0

    def _reqs(self, rows: int) -> int:
        return min(rows, self.max_reqs)

    def _body(self, c: int) -> None:
        r = self._reqs(c)
        ctx = ForwardContext(
            self.query_lens[:r], self.cu_query_lens[: r + 1], self.context_lens[:r],
            self.block_tables[:r], self.slots[:c], c, self.max_context_len,
        )  # fmt: skip
        outs = self.forward(self.tokens[:c], self.positions[:c], ctx, self.rows[:r])
        for dst, o in zip(self.out, outs):
            if dst is not None and o is not None:
                dst[:r].copy_(o)

    @torch.inference_mode()
    def capture(self, backend) -> None:
        """One graph per bucket, largest first, every row padding (the static outputs sized
        from one eager run of the smallest bucket)."""
        if not self.sizes:
            return
        r = self._reqs(self.sizes[0])
        outs = self.forward(self.tokens[:1], self.positions[:1], self._padding_ctx(), self.rows[:r])
        self.out = [None if o is None else o.new_empty((self.max_reqs, *o.shape[1:])) for o in outs]
        for c in self.sizes[::-1]:
            self._replays[c] = backend.capture(lambda c=c: self._body(c))

    def _padding_ctx(self) -> ForwardContext:
        return ForwardContext(
            self.query_lens[:1], self.cu_query_lens[:2], self.context_lens[:1],
            self.block_tables[:1], self.slots[:1], 1, self.max_context_len,
        )  # fmt: skip

    @torch.inference_mode()
    def run(
        self,
        tokens: torch.Tensor,  # [C] int64
        positions: torch.Tensor,  # [C] int64
        ctx: ForwardContext,  # R requests over the C rows
        rows: torch.Tensor,  # [R] int64, the rows whose outputs come back
        eager: bool = False,
    ) -> Outputs:
        """The forward's outputs at `rows`, each [R, ...]: replayed in the smallest bucket that
        holds the C rows, else (or when asked) eagerly."""
        c, r = tokens.shape[0], rows.shape[0]
        w = ctx.block_tables.shape[1]
        i = bisect.bisect_left(self.sizes, c)
        if eager or not self._replays or i == len(self.sizes) or w > self.block_tables.shape[1]:
            return self.forward(tokens, positions, ctx, rows)
        b = self.sizes[i]
        rb = self._reqs(b)
        self.tokens[:c].copy_(tokens)
        self.positions[:c].copy_(positions)
        self.slots[:c].copy_(ctx.slot_mapping)
        self.slots[c:b].fill_(-1)
        self.query_lens[:r].copy_(ctx.query_lens)
        self.query_lens[r:rb].zero_()
        self.cu_query_lens[: r + 1].copy_(ctx.cu_query_lens)
        self.cu_query_lens[r + 1 : rb + 1].fill_(c)
        self.context_lens[:r].copy_(ctx.context_lens)
        self.context_lens[r:rb].zero_()
        self.block_tables[:r, :w].copy_(ctx.block_tables)
        self.rows[:r].copy_(rows)
        self.rows[r:rb].zero_()  # a padding request's row: any row in the bucket
        self._replays[b]()
        self.num_replays += 1
        return tuple(None if o is None else o[:r] for o in self.out)
