"""CUDA graphs of a model drafter's work inside the step (EAGLE-3 head: eagle3_chain.py; draft
model: draft_model_chain.py): the static buffers a step copies its inputs into, one graph per
requests bucket and sampling shape, and the steady catch-up rows they share.

Run eagerly, drafting is hundreds of small launches a step (a head or draft-model forward per
draft, the draft-vocabulary map, sampling, pool writes), which on an H200 cost more than the
target's whole decode step of a small model. Captured once per requests bucket (powers of two up
to max_num_seqs) and sampling shape, a step copies its inputs into the static buffers and
replays.

Sampling shapes: "greedy" (every row greedy), "temperature" (no top-k / top-p / min-p) and
"filtered" (all filters on: a filter whose parameter is off keeps every token, so this shape
gives the very probabilities of any narrower one). Padding requests are greedy, feed slot 0 (the
draft slot pool's padding slot) and write their KV into the trash block.

The steady state: no request has prompt rows to catch up (each drafted in an earlier step), so a
request's catch-up rows are its verify rows, which the graphs pad to k + 1 (rows past a
request's verify rows write the trash block and feed nothing; causal attention keeps them out of
the real rows). Their positions come from the device (the lengths the step just wrote, less the
accepted drafts), so the host uploads only block tables (SteadyRows).

Without CUDA (or with enforce_eager) the same bodies run eagerly on the same buffers, unpadded on
CPU, so the numbers a test checks are those the graphs compute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from specserve.engine.sequence import Sequence
from specserve.engine.slots import DraftSlotPool
from specserve.ops.forward_context import ForwardContext
from specserve.ops.sampling import SamplingTensors
from specserve.ops.transfer import h2d
from specserve.runner.graph_tail import TailStep
from specserve.runner.step_sampler import SamplerPlan
from specserve.sample.verify import VerifyResult
from specserve.speculative.catch_up import emitted_tokens, kv_slots, table_rows

_SHAPES = {
    "greedy": dict(
        all_greedy=True, any_greedy=True, any_top_k=False, any_top_p=False, any_min_p=False
    ),
    "temperature": dict(
        all_greedy=False, any_greedy=True, any_top_k=False, any_top_p=False, any_min_p=False
    ),
    "filtered": dict(
        all_greedy=False, any_greedy=True, any_top_k=True, any_top_p=True, any_min_p=True
    ),
}


def sampling_shape(t: SamplingTensors) -> str:
    if t.all_greedy:
        return "greedy"
    return "filtered" if (t.any_top_k or t.any_top_p or t.any_min_p) else "temperature"


def chain_buckets(max_reqs: int) -> list[int]:
    sizes, b = [], 1
    while b < max_reqs:
        sizes.append(b)
        b *= 2
    return [*sizes, max_reqs]


class SteadyRows(NamedTuple):
    """The host layout of a steady step's drafting (no prompt rows): only block tables."""

    block_tables: torch.Tensor  # [R, W] int32


class CatchUpRows(NamedTuple):
    """The steady catch-up rows of n requests, k + 1 each (m = n * (k + 1))."""

    req: torch.Tensor  # [m] int64, the request of each row
    tokens: torch.Tensor  # [m] int64, row j feeds the token verify row j emitted (padding: 0)
    pos: torch.Tensor  # [m] int64
    ctx: ForwardContext
    final: torch.Tensor  # [n] int64, the row of each request's last accepted position


class DraftGraphs:
    """Per-request static buffers, capture and replay; subclasses give the bodies (`_bodies`)."""

    def __init__(
        self,
        pool: DraftSlotPool,
        width: int,  # block-table columns (the last one is the trash block past a request's)
        block_size: int,
        trash: int,
        padded: bool,  # CUDA: pad the requests to a bucket (graphs, or their eager twin)
    ) -> None:
        self.pool, self.k, self.block_size, self.trash = pool, pool.k, block_size, trash
        self.max_context_len = width * block_size  # one bound for every step (split-KV)
        self.buckets = chain_buckets(pool.num_slots) if padded else []
        n, dev, k1 = pool.num_slots, pool.device, pool.k + 1
        i64 = dict(dtype=torch.int64, device=dev)
        f32 = dict(dtype=torch.float32, device=dev)
        # static inputs, [n] per request unless said
        self.seq_len = torch.ones(n, **i64)  # lengths after this step
        self.num_output = torch.zeros(n, **i64)  # output tokens after this step
        self.slots = torch.zeros(n, **i64)
        self.block_tables = torch.full((n, width), trash, dtype=torch.int32, device=dev)
        self.temperature = torch.zeros(n, **f32)
        self.top_k = torch.zeros(n, dtype=torch.int32, device=dev)
        self.top_p = torch.ones(n, **f32)
        self.min_p = torch.zeros(n, **f32)
        self.seed = torch.zeros(n, **i64)
        self.reqs = torch.arange(n, **i64)
        self.cols = torch.arange(width, **i64)
        self.ones = torch.ones(n, dtype=torch.int32, device=dev)
        self.cu1 = torch.arange(n + 1, dtype=torch.int32, device=dev)
        # steady catch-up: k + 1 rows per request
        self.num_rows = torch.zeros(n, **i64)  # its verify rows (0: padding request)
        self.first_row = torch.zeros(n, **i64)  # its first row in the verify layout
        self.accepted = torch.zeros(n, **i64)
        self.emitted = torch.zeros(n * k1, **i64)  # the token each verify-layout row emitted
        rows = torch.arange(n * k1, **i64)
        self.row_req, self.row_j = rows // k1, rows % k1  # [n * (k + 1)]
        self.cu_k1 = torch.arange(n + 1, dtype=torch.int32, device=dev) * k1
        self.k1s = torch.full((n,), k1, dtype=torch.int32, device=dev)
        # the chain after a catch-up that was not steady: draft 1 and its confidence
        self.tok = torch.zeros(n, **i64)
        self.conf = torch.zeros(n, **f32)
        self._replays: dict[tuple, Callable[[], None]] = {}
        self._keepalive: list[torch.Tensor] = []
        self.num_replays = 0
        self.num_steady = 0  # steps whose catch-up ran in a graph (or its eager twin)

    def steady_rows(self, seqs: list[Sequence], behind: list[bool]) -> SteadyRows | None:
        """A step's host layout when it is steady (no request catching up from further back
        than its previous step) and graphs are on."""
        if not self.buckets or any(behind):
            return None
        width = self.block_tables.shape[1]
        tables = table_rows([s.block_table.blocks for s in seqs], width, self.trash)
        return SteadyRows(h2d(tables, torch.int32, self.pool.device))

    def _bodies(self) -> dict[str, Callable[[int, str, int], None]]:
        """What is captured per (bucket, shape): name -> body(n, shape, max_top_k)."""
        raise NotImplementedError

    @torch.inference_mode()
    def capture(self, backend, keep: torch.Tensor | None = None) -> None:
        """Every body per (bucket, sampling shape), largest first; inputs all padding. `keep`:
        a table the graphs read (a rotary table), kept alive should it ever be rebuilt."""
        self._pad(0, self.pool.num_slots)
        for n in self.buckets[::-1]:
            for shape in _SHAPES:
                for name, body in self._bodies().items():
                    self._replays[(n, shape, name)] = backend.capture(
                        lambda n=n, shape=shape, body=body: body(n, shape, 0)
                    )
        if keep is not None:
            self._keepalive.append(keep)

    def _pad(self, lo: int, hi: int) -> None:
        """Requests [lo, hi) padding: slot 0, greedy, no rows, KV into the trash block."""
        self.slots[lo:hi].zero_()
        self.temperature[lo:hi].zero_()
        self.block_tables[lo:hi].fill_(self.trash)
        self.num_rows[lo:hi].zero_()
        self.accepted[lo:hi].zero_()
        self.seq_len[lo:hi].fill_(2)  # the steady catch-up of a padding request sits at 0

    def _load(self, extra, seq_len, num_output, slots, block_tables, t: SamplingTensors) -> None:
        """Copy a step's inputs into the static buffers; pad to the bucket."""
        r = seq_len.shape[0]
        for dst, src in (
            *extra,
            (self.seq_len, seq_len),
            (self.num_output, num_output),
            (self.slots, slots),
            (self.block_tables, block_tables),
            (self.temperature, t.temperature),
            (self.top_k, t.top_k),
            (self.top_p, t.top_p),
            (self.min_p, t.min_p),
            (self.seed, t.seed),
        ):
            dst[: src.shape[0]].copy_(src)
        n = next((b for b in self.buckets if b >= r), r)
        if n > r:
            self._pad(r, n)

    @torch.inference_mode()
    def run(
        self,
        tok: torch.Tensor,  # [R] int64, draft 1
        conf: torch.Tensor,  # [R] float32
        seq_len: torch.Tensor,  # [R] int64
        num_output: torch.Tensor,  # [R] int64
        slots: torch.Tensor,  # [R] int64
        block_tables: torch.Tensor,  # [R, width] int32
        t: SamplingTensors,  # per request
        extra: tuple = (),  # (static buffer, value) pairs of a drafter's own chain inputs
    ) -> None:
        """Drafts 2..k of every request after a catch-up that was not steady (catch_up_graphs.py);
        all k drafts and confidences into the pool."""
        self._load(
            [(self.tok, tok), (self.conf, conf), *extra], seq_len, num_output, slots,
            block_tables, t,
        )  # fmt: skip
        self._replay(tok.shape[0], t, "chain")

    def _replay(self, r: int, t: SamplingTensors, name: str) -> None:
        self._replay_shape(r, sampling_shape(t), name, t.max_top_k)

    def _replay_shape(self, r: int, shape: str, name: str, max_top_k: int = 0) -> None:
        n = self._bucket(r)
        replay = self._replays.get((n, shape, name))
        if replay is not None:
            replay()
            self.num_replays += 1
        else:
            self._bodies()[name](n, shape, max_top_k)

    def _bucket(self, r: int) -> int:
        return next((b for b in self.buckets if b >= r), r)

    # -- inside the target's graph tail (runner/graph_tail.py) ---------------------------------
    def tail_inputs(self, st: TailStep, num_output: torch.Tensor) -> None:
        """A greedy steady step's inputs, written by the target's tail (its bucket's Bb
        requests, padding ones included, then padding up to the chain's bucket for Bb); the
        chain's graph for the step's real requests runs behind it (replay_tail)."""
        v, res = st.views, st.result
        reqs, rows = v.slots.shape[0], v.seed.shape[0]
        self.emitted[:rows].copy_(emitted_tokens(res, st.row_req))  # [Tb]
        for dst, src in (
            (self.accepted, res.num_accepted),
            (self.num_rows, v.seqlens_q),
            (self.first_row, v.ftp),
            (self.seq_len, st.seq_len),
            (self.num_output, num_output),
            (self.slots, v.slots),
        ):
            dst[:reqs].copy_(src)
        self.temperature[:reqs].zero_()
        # the forward's tables hold stale blocks past a request's own: the trash block there
        w = min(st.block_tables.shape[1], self.block_tables.shape[1])
        own = self.cols[:w] < v.num_blocks.unsqueeze(1)  # [Bb, w]
        tables = torch.where(own, st.block_tables[:, :w], self.trash)
        self.block_tables[:reqs, :w].copy_(tables)
        self.block_tables[:reqs, w:].fill_(self.trash)
        n = self._bucket(reqs)
        if n > reqs:
            self._pad(reqs, n)

    def replay_tail(self, r: int) -> None:
        """Behind the tail that wrote its inputs: the steady catch-up and chain of r requests."""
        self._replay_shape(r, "greedy", "steady")
        self.num_steady += 1

    @torch.inference_mode()
    def run_steady(
        self,
        lay: SteadyRows,
        plan: SamplerPlan,
        result: VerifyResult,
        emitted: torch.Tensor,  # [T] int64, the token each verify-layout row emitted
        seq_len: torch.Tensor,  # [R] int64, lengths after this step
        num_output: torch.Tensor,  # [R] int64
        t: SamplingTensors,  # per request
    ) -> None:
        """The catch-up over each request's verify rows, then the chain: all k drafts."""
        layout = plan.layout
        self._load(
            [(self.emitted[: emitted.shape[0]], emitted), (self.accepted, result.num_accepted),
             (self.num_rows, layout.seqlens_q), (self.first_row, layout.ftp)],
            seq_len, num_output, plan.slots, lay.block_tables, t,
        )  # fmt: skip
        self._replay(seq_len.shape[0], t, "steady")
        self.num_steady += 1

    def _sampling(self, n: int, shape: str, max_top_k: int) -> SamplingTensors:
        return SamplingTensors(
            self.temperature[:n], self.top_k[:n], self.top_p[:n], self.min_p[:n], self.seed[:n],
            self.num_output[:n], max_top_k=max_top_k, **_SHAPES[shape],
        )  # fmt: skip

    def _catch_up_rows(self, n: int, first_pos: torch.Tensor) -> CatchUpRows:
        """The steady catch-up rows of the first n requests; row j of request i at position
        first_pos[i] + j ([n] int64: where its first verify row's token goes)."""
        k1, bs, m = self.k + 1, self.block_size, n * (self.k + 1)
        req, j = self.row_req[:m], self.row_j[:m]
        real = j < self.num_rows[:n][req]
        vrow = (self.first_row[:n][req] + j).clamp_max(self.emitted.shape[0] - 1)
        tokens = torch.where(real, self.emitted[vrow], 0)
        pos = first_pos[req].add_(j).clamp_min_(0)  # [m]
        bt = self.block_tables[:n]
        kv = torch.where(real, kv_slots(bt, req, pos, bs), self.trash * bs)
        ctx = ForwardContext(
            self.k1s[:n], self.cu_k1[: n + 1], (pos.view(n, k1)[:, 0] + k1).to(torch.int32),
            bt, kv, k1, self.max_context_len,
        )  # fmt: skip
        final = self.cu_k1[:n].to(torch.int64) + self.accepted[:n]
        return CatchUpRows(req, tokens, pos, ctx, final)

    def _chain_contexts(
        self, n: int, first: torch.Tensor
    ) -> list[tuple[torch.Tensor, ForwardContext]]:
        """(positions [n], context) of each of the k - 1 chained steps: one row per request,
        at first + i ([n] int64) in step i. All steps' slots at once: a few launches in all
        rather than a few per step (a small head's step is launch-bound)."""
        steps = self.k - 1
        pos = first.unsqueeze(0) + self.row_j[:steps].unsqueeze(1)  # [k - 1, n]
        bt = self.block_tables[:n]
        kv = kv_slots(bt, self.reqs[:n].expand(steps, n), pos, self.block_size)  # [k - 1, n]
        lens = (pos + 1).to(torch.int32)
        return [
            (pos[i], ForwardContext(
                self.ones[:n], self.cu1[: n + 1], lens[i], bt, kv[i], 1, self.max_context_len
            ))
            for i in range(steps)
        ]  # fmt: skip
