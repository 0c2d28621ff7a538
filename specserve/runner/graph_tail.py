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
seqlens_q, ftp, slots) travel in the front of the bucket's one upload (cuda_graph._Layout), laid
out by sampler_inputs.pack_tail; no SamplerPlan is built.

Common shape (pack_tail): every request greedy or temperature-only, with no logits processing,
penalties, min_tokens, golden tokens or logprobs, its drafts known to the host or none (no device
drafter, no draft-model q), its sampling not deferred. Every other step runs the eager sampler
(step_sampler.py) after the forward graph, as before.

Padding: rows T..Tb-1 belong to no request and requests R..Bb-1 own no row (seqlens_q 0: nothing
accepted, a token nobody reads) with slot 0, whose next_tokens entry no row reads.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from specserve.engine.ledger import HostStepResult
from specserve.ops.transfer import designed_sync
from specserve.sample.verify import verify_padded


class TailViews(NamedTuple):
    """A bucket's tail inputs (device: static views the graph reads; host: where pack_tail
    writes), each padded to the bucket's Tb rows / Bb requests."""

    seed: torch.Tensor | np.ndarray  # [Tb] int64
    counter: torch.Tensor | np.ndarray  # [Tb] int64, output index each row would produce
    draft: torch.Tensor | np.ndarray  # [Tb] int64, the draft each verify row checks
    seqlens_q: torch.Tensor | np.ndarray  # [Bb] int64, 0 for padding requests
    ftp: torch.Tensor | np.ndarray  # [Bb] int64
    slots: torch.Tensor | np.ndarray  # [Bb] int64, 0 for padding requests
    temperature: torch.Tensor | np.ndarray  # [Tb] float32, 0 = greedy


class SampledTail:
    """A tail's results on their way to the host (the interface of step_sampler.SampledStep)."""

    def __init__(self, host: torch.Tensor, event, rows: int, reqs: int, t: int, r: int) -> None:
        self._buf, self._event = host, event
        self._at = (rows, reqs, t, r)
        self._host: HostStepResult | None = None

    def wait(self) -> HostStepResult:
        if self._host is None:
            if self._event is not None:
                with designed_sync():
                    self._event.synchronize()
            rows, reqs, t, r = self._at
            ints = self._buf[: rows + 2 * reqs].tolist()
            self._host = HostStepResult(
                ints[:t],
                ints[rows : rows + r],
                ints[rows + reqs : rows + reqs + r],
                None,
                None,
                None,
                None,
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
    ) -> None:
        self.model, self.hidden, self.next_tokens = model, hidden, next_tokens
        device = hidden.device
        n = max_rows + 2 * max_reqs
        self.out = torch.zeros(n, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        # two pinned buffers in turn: a step's readback lands in one while the host still reads
        # the other (overlap keeps one step in flight); a buffer's previous owner is read first
        self._host = [torch.zeros(n, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
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

    def readback(self, rows: int, reqs: int, t: int, r: int) -> SampledTail:
        """Queue the copy of the tail just replayed for a step of t rows and r requests."""
        i = self._turn
        self._turn ^= 1
        owner = self._owner[i]
        if owner is not None:
            owner.wait()  # read before its buffer is reused (already done in a normal loop)
        host = self._host[i]
        n = rows + 2 * reqs
        event = None
        if self.out.is_cuda:
            host[:n].copy_(self.out[:n], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host[:n].copy_(self.out[:n])
        sampled = SampledTail(host, event, rows, reqs, t, r)
        self._owner[i] = sampled
        return sampled
