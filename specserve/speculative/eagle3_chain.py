"""EAGLE-3 drafting inside the step as CUDA graphs: the chained steps (drafts 2..k), and in the
steady state the catch-up step before them too.

After the catch-up forward gives each request its first draft, the k - 1 chained head steps
have fixed shapes: one row per request. Run eagerly they are ~40 small launches each (head
layer, draft-vocabulary map, sampling, pool writes), which on an H200 cost more than the
target's whole decode step of a small model. So they are captured once per requests bucket
(powers of two up to max_num_seqs) and sampling shape, and a step copies its inputs into the
static buffers and replays.

The catch-up step has fixed shapes too once no request has prompt rows to catch up (every
request drafted before: the steady state): each request's rows are its verify rows, which the
steady graphs pad to k + 1 (rows past a request's verify rows write the trash block and feed
nothing, and causal attention keeps them out of the real rows). Their positions come from the
device (the lengths the step just wrote, less the accepted drafts), so the host uploads only
block tables. A step that admits a request catches up eagerly (eagle3_device.py) and replays
the chain alone.

Sampling shapes: "greedy" (every row greedy), "temperature" (no top-k / top-p / min-p) and
"filtered" (all filters on: a filter whose parameter is off keeps every token, so this shape
gives the very probabilities of any narrower one). Padding rows are greedy, feed slot 0 (the
draft slot pool's padding slot) and write their head KV into the trash block.

Without CUDA (or with enforce_eager) the same body runs eagerly on the same buffers, unpadded on
CPU, so the numbers a test checks are those the graphs compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch

from specserve.engine.slots import DraftSlotPool
from specserve.ops.forward_context import ForwardContext
from specserve.ops.sampling import DRAFT_SALT, SamplingTensors, sample, target_probs
from specserve.speculative.catch_up import kv_slots


class SteadyRows(NamedTuple):
    """The host layout of a steady step's drafting (no prompt rows): only block tables."""

    block_tables: torch.Tensor  # [R, W] int32


# (prenorm, logits, confidence logit) of one head step over (tokens, hidden, positions, ctx, rows)
HeadStep = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
# the confidence of draft j: (confidence logit or None, q, drafted token, j) -> [R] float32
Confidence = Callable[[torch.Tensor | None, torch.Tensor, torch.Tensor, int], torch.Tensor]

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


class Eagle3Chain:
    def __init__(
        self,
        step: HeadStep,
        confidence: Confidence,
        pool: DraftSlotPool,
        hidden_size: int,
        dtype: torch.dtype,
        width: int,  # block-table columns (the last one is the trash block past a request's)
        block_size: int,
        trash: int,
        padded: bool,  # CUDA: pad the requests to a bucket (graphs, or their eager twin)
        store: torch.Tensor,  # [slots + 1, H] the target's fused g per KV slot (last: trash)
    ) -> None:
        self.step, self.confidence, self.pool, self.store = step, confidence, pool, store
        self.k, self.block_size, self.trash = pool.k, block_size, trash
        self.max_context_len = width * block_size  # one bound for every chain step (split-KV)
        self.buckets = chain_buckets(pool.num_slots) if padded else []
        n, dev = pool.num_slots, pool.device
        i64 = dict(dtype=torch.int64, device=dev)
        f32 = dict(dtype=torch.float32, device=dev)
        # static inputs, [n] per request unless said
        self.tok = torch.zeros(n, **i64)  # draft 1
        self.conf = torch.zeros(n, **f32)  # its confidence
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=dev)  # its step's prenorm
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
        self.ones = torch.ones(n, dtype=torch.int32, device=dev)
        self.cu1 = torch.arange(n + 1, dtype=torch.int32, device=dev)
        # steady catch-up: k + 1 rows per request; [n] per request, [n * (k + 1)] per row
        k1 = self.k + 1
        self.num_rows = torch.zeros(n, **i64)  # its verify rows (0: padding request)
        self.first_row = torch.zeros(n, **i64)  # its first row in the verify layout
        self.accepted = torch.zeros(n, **i64)
        self.emitted = torch.zeros(n * k1, **i64)  # the token each verify-layout row emitted
        rows = torch.arange(n * k1, **i64)
        self.row_req, self.row_j = rows // k1, rows % k1
        self.cu_k1 = torch.arange(n + 1, dtype=torch.int32, device=dev) * k1
        self.k1s = torch.full((n,), k1, dtype=torch.int32, device=dev)
        self._replays: dict[tuple[int, str], Callable[[], None]] = {}
        self._keepalive: list[torch.Tensor] = []
        self.num_replays = 0
        self.num_steady = 0  # steps whose catch-up ran in the chain's graph (or its twin)

    @torch.inference_mode()
    def capture(self, backend, rotary_table: Callable[[], torch.Tensor | None]) -> None:
        """Graphs per (bucket, sampling shape), largest first: the chain alone, and the steady
        catch-up with it. Inputs are all padding."""
        self._pad(0, self.pool.num_slots)
        for n in self.buckets[::-1]:
            for shape in _SHAPES:
                self._replays[(n, shape)] = backend.capture(
                    lambda n=n, shape=shape: self._body(n, shape)
                )
                self._replays[(n, shape, "steady")] = backend.capture(
                    lambda n=n, shape=shape: self._steady_body(n, shape)
                )
        # the graphs read the head's rotary table: keep it alive should it ever be rebuilt
        table = rotary_table()
        if table is not None:
            self._keepalive.append(table)

    def _pad(self, lo: int, hi: int) -> None:
        """Rows [lo, hi) padding: slot 0, greedy, KV into the trash block."""
        self.slots[lo:hi].zero_()
        self.temperature[lo:hi].zero_()
        self.block_tables[lo:hi].fill_(self.trash)
        self.num_rows[lo:hi].zero_()
        self.accepted[lo:hi].zero_()
        self.seq_len[lo:hi].fill_(2)  # the steady catch-up of a padding request sits at 0

    @torch.inference_mode()
    def run(
        self,
        tok: torch.Tensor,  # [R] int64, draft 1
        conf: torch.Tensor,  # [R] float32
        hidden: torch.Tensor,  # [R, H] draft 1's prenorm
        seq_len: torch.Tensor,  # [R] int64
        num_output: torch.Tensor,  # [R] int64
        slots: torch.Tensor,  # [R] int64
        block_tables: torch.Tensor,  # [R, width] int32
        t: SamplingTensors,  # per request
    ) -> None:
        """Drafts 2..k of every request; all k drafts and confidences into the pool."""
        self._load(
            [(self.tok, tok), (self.conf, conf), (self.hidden, hidden)],
            seq_len, num_output, slots, block_tables, t,
        )  # fmt: skip
        self._replay(tok.shape[0], t, steady=False)

    @torch.inference_mode()
    def run_steady(
        self,
        lay: SteadyRows,
        emitted: torch.Tensor,  # [T] int64, the token each verify-layout row emitted
        accepted: torch.Tensor,  # [R] int64, drafts accepted
        num_rows: torch.Tensor,  # [R] verify rows of each request (1 + its drafts)
        first_row: torch.Tensor,  # [R] int64, its first verify-layout row
        seq_len: torch.Tensor,  # [R] int64, lengths after this step
        num_output: torch.Tensor,  # [R] int64
        slots: torch.Tensor,  # [R] int64
        t: SamplingTensors,  # per request
    ) -> None:
        """The catch-up over each request's verify rows, then the chain: all k drafts."""
        rows = emitted.shape[0]
        self._load(
            [(self.emitted[:rows], emitted), (self.accepted, accepted),
             (self.num_rows, num_rows), (self.first_row, first_row)],
            seq_len, num_output, slots, lay.block_tables, t,
        )  # fmt: skip
        self._replay(seq_len.shape[0], t, steady=True)
        self.num_steady += 1

    def _load(self, extra, seq_len, num_output, slots, block_tables, t: SamplingTensors) -> None:
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

    def _replay(self, r: int, t: SamplingTensors, steady: bool) -> None:
        n = next((b for b in self.buckets if b >= r), r)
        shape = sampling_shape(t)
        replay = self._replays.get((n, shape, "steady") if steady else (n, shape))
        if replay is not None:
            replay()
            self.num_replays += 1
        elif steady:
            self._steady_body(n, shape, t.max_top_k)
        else:
            self._body(n, shape, t.max_top_k)

    def _sampling(self, n: int, shape: str, max_top_k: int) -> SamplingTensors:
        return SamplingTensors(
            self.temperature[:n], self.top_k[:n], self.top_p[:n], self.min_p[:n], self.seed[:n],
            self.num_output[:n], max_top_k=max_top_k, **_SHAPES[shape],
        )  # fmt: skip

    def _body(self, n: int, shape: str, max_top_k: int = 0) -> None:
        t = self._sampling(n, shape, max_top_k)
        self._chain(n, t, self.tok[:n], self.conf[:n], self.hidden[:n])

    def _steady_body(self, n: int, shape: str, max_top_k: int = 0) -> None:
        """The catch-up step over k + 1 rows per request, then the chain."""
        k1, bs, m = self.k + 1, self.block_size, n * (self.k + 1)
        req, j = self.row_req[:m], self.row_j[:m]  # [m]
        real = j < self.num_rows[:n][req]
        vrow = (self.first_row[:n][req] + j).clamp_max(self.emitted.shape[0] - 1)
        tokens = torch.where(real, self.emitted[vrow], 0)  # row j feeds the token row j emitted
        acc = self.accepted[:n]
        # the anchor's true position: the length the step wrote, less what it accepted
        pos = (self.seq_len[:n] - acc - 2)[req].add_(j).clamp_min_(0)  # [m]
        bt = self.block_tables[:n]
        kv = torch.where(real, kv_slots(bt, req, pos, bs), self.trash * bs)
        ctx = ForwardContext(
            self.k1s[:n], self.cu_k1[: n + 1], (pos.view(n, k1)[:, 0] + k1).to(torch.int32),
            bt, kv, k1, self.max_context_len,
        )  # fmt: skip
        final = self.cu_k1[:n].to(torch.int64) + acc  # [n] the last accepted row
        hidden, logits, conf_logit = self.step(tokens, self.store[kv], pos, ctx, final)
        t = self._sampling(n, shape, max_top_k)
        q = target_probs(logits, t)  # [n, V]
        tok = sample(q, t, DRAFT_SALT)
        self.pool.q.index_copy_(0, self.slots[:n] * self.k, q)
        self._chain(n, t, tok, self.confidence(conf_logit, q, tok, 0), hidden)

    def _chain(
        self,
        n: int,
        t: SamplingTensors,
        tok: torch.Tensor,  # [n] draft 1
        conf: torch.Tensor,  # [n] its confidence
        hidden: torch.Tensor,  # [n, H] its step's prenorm
    ) -> None:
        pool, k = self.pool, self.k
        slots, seq_len, bt, reqs = (
            self.slots[:n],
            self.seq_len[:n],
            self.block_tables[:n],
            self.reqs[:n],
        )
        drafts, confs = [tok], [conf]
        for j in range(1, k):
            pos = seq_len - 2 + j  # [n] the previous draft's position
            ctx = ForwardContext(
                self.ones[:n], self.cu1[: n + 1], (pos + 1).to(torch.int32), bt,
                kv_slots(bt, reqs, pos, self.block_size), 1, self.max_context_len,
            )  # fmt: skip
            hidden, logits, conf_logit = self.step(tok, hidden, pos, ctx, reqs)
            tj = dataclasses.replace(t, counter=t.counter + j)
            q = target_probs(logits, tj)  # [n, V]
            tok = sample(q, tj, DRAFT_SALT)
            pool.q.index_copy_(0, slots * k + j, q)
            drafts.append(tok)
            confs.append(self.confidence(conf_logit, q, tok, j))
        pool.draft_ids.index_copy_(0, slots, torch.stack(drafts, 1))
        pool.draft_conf.index_copy_(0, slots, torch.stack(confs, 1))
