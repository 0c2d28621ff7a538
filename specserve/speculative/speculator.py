"""Host drafting (overlap off, or SPECSERVE_DEVICE_DRAFTS=0): drafting the next step into the
slot pool after the ledger, the verify budget's trim, and which steps may run overlapped. With
overlap the drafters draft on the device instead (device_drafting.py) and none of this runs.

A host-side drafter needs each step's tokens on the host, so a step that verifies drafts runs
synchronously; a step without drafts (the budget kept none, or no request can draft) overlaps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specserve.engine.ledger import HostStepResult
from specserve.engine.scheduler import StepBatch
from specserve.engine.sequence import Sequence
from specserve.structured.drafts import truncate_drafts

if TYPE_CHECKING:
    from specserve.llm_engine import LLMEngine


class Speculator:
    def __init__(self, engine: LLMEngine) -> None:
        assert engine.drafter is not None and engine.slot_pool is not None
        self.engine = engine
        self.drafter = engine.drafter
        self.pool = engine.slot_pool

    def may_overlap(self, in_flight: bool) -> bool:
        """Can the next step run overlapped? Only a step that verifies drafts needs the
        synchronous path. in_flight: the previous step is still unprocessed."""
        if not self.engine.overlap_when_paused:
            return False
        if not in_flight:
            # the last step was processed with drafting: its drafts are in the slots
            return not self.has_drafts()
        # a request decoding would draft once the step in flight is read: read it first
        return not any(s.num_uncomputed_tokens == 1 for s in self.engine.scheduler.running)

    def has_drafts(self) -> bool:
        """Do the slots hold drafts for the next step (drafted after the last processed step)?"""
        return any(
            self.pool.token_ids[s.slot]
            for s in self.engine.scheduler.running
            if s.num_uncomputed_tokens == 1
        )

    def observe(
        self, batch: StepBatch, seqs: list[Sequence], host: HostStepResult
    ) -> HostStepResult:
        """A verified step's outcome: the drafter learns from it; the ledger gets each
        request's draft confidences (acceptance metrics). A step without drafts has nothing to
        learn or report."""
        if not any(batch.num_drafts):
            return host
        drafts = [d for d, sm in zip(batch.drafts, batch.samples) if sm]
        confs = [self.pool.confidence[s.slot][: len(d)] for s, d in zip(seqs, drafts)]
        for s, d, acc in zip(seqs, drafts, host.num_accepted):
            if d:
                self.drafter.observe(s, len(d), acc)
        return host._replace(draft_confidences=confs)

    def draft_q(self, seqs: list[Sequence], drafts: list[list[int]]) -> torch.Tensor | None:
        """[total_q, V] draft distributions of the verify layout's rows (rows that verify
        nothing get q = 0; they never read it), or None for one-hot drafters."""
        if self.pool.q is None or not any(drafts):
            return None
        eng = self.engine
        v = eng.model_config.vocab_size
        parts = []
        for s, d in zip(seqs, drafts):
            if d:
                parts.append(self.pool.q_rows(s.slot, len(d)))
            parts.append(torch.zeros(1, v, device=eng.device))
        return torch.cat(parts)

    def propose(self) -> None:
        """Drafts for the next step, into each running request's slot. Only requests whose
        prompt is fully computed draft (their next step is a decode/verify step)."""
        eng, pool = self.engine, self.pool
        ready = []
        for s in eng.scheduler.running:
            pool.clear(s.slot)
            if s.num_uncomputed_tokens == 1:
                ready.append(s)
        if not ready:
            return
        limits = []
        for s in ready:
            room = min(pool.k, eng.max_model_len - s.num_tokens)
            if s.params.max_tokens is not None:
                room = min(room, s.params.max_tokens - s.num_output_tokens - 1)
            limits.append(max(0, room))
        proposals = self.drafter.propose(ready, limits)
        # structured outputs: drafts past the first one a grammar rejects are never verified
        proposals = truncate_drafts(ready, proposals, keep_rejected=self.drafter.has_q)
        if eng.budget is not None:
            # this round's confidences: the drafter ran just now on the step just processed
            keep = eng.budget.trim(ready, [d for d, _ in proposals], [c for _, c in proposals])
            proposals = [(d[:m], c[:m]) for (d, c), m in zip(proposals, keep)]
        for s, (d, conf) in zip(ready, proposals):
            pool.put(s.slot, d, conf)
