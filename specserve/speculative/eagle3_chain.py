"""The chained steps of EAGLE-3 drafting inside the step (drafts 2..k), as CUDA graphs.

After the catch-up forward gives each request its first draft, the k - 1 chained head steps
have fixed shapes: one row per request. Run eagerly they are ~40 small launches each (head
layer, draft-vocabulary map, sampling, pool writes), which on an H200 cost more than the
target's whole decode step of a small model. So they are captured once per requests bucket
(powers of two up to max_num_seqs) and sampling shape, and a step copies its inputs into the
static buffers and replays.

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

import torch

from specserve.engine.slots import DraftSlotPool
from specserve.ops.forward_context import ForwardContext
from specserve.ops.sampling import DRAFT_SALT, SamplingTensors, sample, target_probs
from specserve.speculative.catch_up import kv_slots

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
    ) -> None:
        self.step, self.confidence, self.pool = step, confidence, pool
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
        self._replays: dict[tuple[int, str], Callable[[], None]] = {}
        self._keepalive: list[torch.Tensor] = []
        self.num_replays = 0

    @torch.inference_mode()
    def capture(self, backend, rotary_table: Callable[[], torch.Tensor | None]) -> None:
        """One graph per (bucket, sampling shape), largest first. Inputs are all padding."""
        self._pad(0, self.pool.num_slots)
        for n in self.buckets[::-1]:
            for shape in _SHAPES:
                self._replays[(n, shape)] = backend.capture(
                    lambda n=n, shape=shape: self._body(n, shape)
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
        r = tok.shape[0]
        n = next((b for b in self.buckets if b >= r), r)
        for dst, src in (
            (self.tok, tok),
            (self.conf, conf),
            (self.hidden, hidden),
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
            dst[:r].copy_(src)
        if n > r:
            self._pad(r, n)
        shape = sampling_shape(t)
        replay = self._replays.get((n, shape))
        if replay is not None:
            replay()
            self.num_replays += 1
        else:
            self._body(n, shape, t.max_top_k)

    def _body(self, n: int, shape: str, max_top_k: int = 0) -> None:
        pool, k = self.pool, self.k
        slots, seq_len, bt, reqs = (
            self.slots[:n],
            self.seq_len[:n],
            self.block_tables[:n],
            self.reqs[:n],
        )
        t = SamplingTensors(
            self.temperature[:n], self.top_k[:n], self.top_p[:n], self.min_p[:n], self.seed[:n],
            self.num_output[:n], max_top_k=max_top_k, **_SHAPES[shape],
        )  # fmt: skip
        tok, hidden = self.tok[:n], self.hidden[:n]
        drafts, confs = [tok], [self.conf[:n]]
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
