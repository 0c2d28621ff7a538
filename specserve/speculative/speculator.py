"""Host drafting (overlap off, or SPECSERVE_DEVICE_DRAFTS=0): the verify budget's plan of each
request's drafts, drafting them into the slot pool after the ledger, and which steps may run
overlapped. With overlap the drafters draft on the device instead (device_drafting.py) and none
of this runs.

A host-side drafter needs each step's tokens on the host, so a step that verifies drafts runs
synchronously; a step without drafts (the budget planned none, or no request can draft) overlaps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from specserve.engine.ledger import HostStepResult
from specserve.engine.scheduler import StepBatch
from specserve.engine.sequence import Sequence
from specserve.speculative.acceptance import PlanCalibration
from specserve.speculative.verify_budget import survivals
from specserve.structured.drafts import truncate_drafts

if TYPE_CHECKING:
    from specserve.llm_engine import LLMEngine


class Speculator:
    def __init__(self, engine: LLMEngine) -> None:
        assert engine.drafter is not None and engine.slot_pool is not None
        self.engine = engine
        self.drafter = engine.drafter
        self.pool = engine.slot_pool
        # request id -> [k] confidences of its most recent drafts per position (model drafters)
        self._confidences: dict[str, np.ndarray] = {}
        # model drafters: request id -> [k] the confidences its drafts in the slots were planned
        # with, and how those compare with what verified
        self._planned: dict[str, np.ndarray] = {}
        self.calibration = PlanCalibration()

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
                planned = self._planned.pop(s.request_id, None)
                if planned is not None:
                    self.calibration.record(len(d), acc, planned)
        return host._replace(draft_confidences=confs)

    def draft_q(self, seqs: list[Sequence], drafts: list[list[int]]) -> torch.Tensor | None:
        """[total_q, V] draft distributions of the verify layout's rows (rows that verify
        nothing get q = 0; they never read it), or None for one-hot drafters."""
        if self.pool.q is None or not any(drafts) or all(s.params.greedy for s in seqs):
            return None  # greedy verification reads no q (verify.py), and greedy drafts write none
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
        prompt is fully computed draft (their next step is a decode/verify step). With the verify
        budget the plan comes first: each request drafts only the drafts the next step will
        verify, and a request planned at 0 is not drafted for at all, so a step whose plan is
        empty costs what a plain step costs (the curve prices each step with its drafting)."""
        eng, pool = self.engine, self.pool
        ready = []
        for s in eng.scheduler.running:
            pool.clear(s.slot)
            if s.num_uncomputed_tokens == 1:
                ready.append(s)
        if not ready:
            return
        limits = [self._room(s) for s in ready]
        self._planned.clear()  # drafts planned but never verified (a request ended) teach nothing
        if eng.budget is not None:
            conf, learned = self._plan_confidences(ready)
            for i in np.flatnonzero(learned):
                self._planned[ready[i].request_id] = conf[i].copy()
            conf[learned] = self.calibration.apply(conf[learned])
            limits = eng.budget.allot(survivals(conf), len(ready), limits)
        drafting = [(s, m) for s, m in zip(ready, limits) if m > 0]
        if not drafting:
            return
        seqs = [s for s, _ in drafting]
        proposals = self.drafter.propose(seqs, [m for _, m in drafting])
        for s, (_, conf) in zip(seqs, proposals):
            self._remember(s, conf)
        # structured outputs: drafts past the first one a grammar rejects are never verified
        proposals = truncate_drafts(seqs, proposals, keep_rejected=self.drafter.has_q)
        for s, (d, conf) in zip(seqs, proposals):
            pool.put(s.slot, d, conf)

    def _room(self, s: Sequence) -> int:
        """The most drafts a request may verify next step: k, max_model_len, max_tokens."""
        room = min(self.pool.k, self.engine.max_model_len - s.num_tokens)
        if s.params.max_tokens is not None:
            room = min(room, s.params.max_tokens - s.num_output_tokens - 1)
        return max(0, room)

    def _plan_confidences(self, ready: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
        """[n, k] the confidences each request's next drafts are planned with, before drafting
        them: the drafter's own where it knows them up front (n-gram: its acceptance estimate;
        golden: the dialled rate), else those its most recent drafts came with (a model
        drafter's, one round old, as device drafting plans from; [n] bool marks these rows,
        which PlanCalibration corrects), 1 where a position was never drafted (verify, to learn).

        How a request planned at 0 learns again, by construction: it is never drafted for (a
        probe of even one head step would make its step dearer than a plain one), so its
        confidences stay as they were until the budget's exploration (every EXPLORE_EVERY-th
        plan, one request in turn) drafts all its room and measures them anew; an estimate
        learned from outcomes also moves with the other requests' verifications."""
        k = self.pool.k
        conf = np.ones((len(ready), k))
        learned = np.zeros(len(ready), dtype=bool)
        for i, s in enumerate(ready):
            c = self.drafter.plan_confidences(s, k)
            if c is None:
                c = self._confidences.get(s.request_id)
                learned[i] = c is not None
            if c is not None:
                conf[i, : len(c)] = c[:k]
        return conf, learned

    def _remember(self, s: Sequence, conf: list[float]) -> None:
        """A model drafter's newest confidences for its next plan; positions it did not draft
        this round keep their older ones."""
        c = self._confidences.get(s.request_id)
        if c is None:
            c = self._confidences[s.request_id] = np.ones(self.pool.k)
        c[: len(conf)] = conf

    def release(self, seq: Sequence) -> None:
        self.drafter.release(seq)
        self._confidences.pop(seq.request_id, None)
        self._planned.pop(seq.request_id, None)
