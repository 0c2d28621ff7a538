"""Host drafting (overlap off, or SPECSERVE_DEVICE_DRAFTS=0): drafting the next step into the
slot pool after the ledger, the verify budget's trim, and pausing speculation while plain
overlapped decoding wins. With overlap the drafters draft on the device instead
(device_drafting.py) and none of this runs.

A host-side drafter needs each step's tokens on the host, so steps that verify drafts run
synchronously. When the verify budget keeps no drafts at all at the current load, speculation
pauses: the next PAUSE_STEPS steps draft nothing and run overlapped (host work hidden). At the
end of a pause the budget is first asked with the last drafting round's confidences (no
synchronous step needed); after MAX_STALE_PAUSES such extensions in a row the engine drafts for
real, so the confidences priced are a bounded number of pauses old (1 + MAX_STALE_PAUSES_CAP at
most, below).

A real drafting round drains the pipeline: the step in flight is read back and processed before
the next one is launched, so one step's host work is exposed (2-12 ms on the H200 host at 64-256
requests), once every 64 steps: ~1 % of plain decoding there, about what paused auto ran below
off in the sweeps. So each forced round that confirms the pause doubles the extensions allowed
before the next one (64, 128, 256, then every 512 steps), and a round whose verdict keeps drafts
starts over from MAX_STALE_PAUSES. The load is still re-priced every PAUSE_STEPS steps.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from specserve.engine.ledger import HostStepResult
from specserve.engine.scheduler import StepBatch
from specserve.engine.sequence import Sequence
from specserve.structured.drafts import truncate_drafts

if TYPE_CHECKING:
    from specserve.llm_engine import LLMEngine

# Long enough that the one synchronous step which re-drafts costs little, short enough to notice
# the load falling.
PAUSE_STEPS = 8
MAX_STALE_PAUSES = 7
MAX_STALE_PAUSES_CAP = 63  # real drafting rounds at least every 512 steps


class Speculator:
    def __init__(self, engine: LLMEngine) -> None:
        assert engine.drafter is not None and engine.slot_pool is not None
        self.engine = engine
        self.drafter = engine.drafter
        self.pool = engine.slot_pool
        self._paused_until = 0  # steps before this id run without drafts, overlapped
        self._stale_pauses = 0  # pauses extended in a row without drafting (keeps_pausing)
        self._stale_limit = MAX_STALE_PAUSES  # extensions allowed before drafting for real

    def paused(self, next_step: int) -> bool:
        """Does step `next_step` run with speculation paused (overlapped, no drafts)?"""
        if not self.engine.overlap_when_paused or not self._paused_until:
            return False
        if next_step < self._paused_until:
            return True
        # the pause is over: if the budget still wants plain decoding at this load (asked with
        # the last drafting round's confidences), extend it without a synchronous step
        budget = self.engine.budget
        if self._stale_pauses < self._stale_limit and budget.keeps_pausing():
            self._stale_pauses += 1
            self._paused_until = next_step + PAUSE_STEPS
            return True
        self._paused_until = 0
        return False

    def may_overlap(self, next_step: int, in_flight: bool) -> bool:
        """Can step `next_step` run overlapped? Only a step that verifies drafts needs the
        synchronous path: steps run overlapped while speculation is paused, and so does any step
        that cannot carry drafts (no request decoding yet, e.g. the prefill chunks ahead of the
        first decode step). in_flight: the previous step is still unprocessed."""
        if not self.engine.overlap_when_paused:
            return False
        if self.paused(next_step):
            return True
        if not in_flight:
            # the last step was processed with drafting: its drafts are in the slots
            return not self.has_drafts()
        # a request whose prompt completes in the step in flight would draft once it is read
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
        request's draft confidences (acceptance metrics). A step without drafts (speculation
        paused: every step at high load) has nothing to learn or report."""
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
        t0 = time.perf_counter()
        proposals = self.drafter.propose(ready, limits)
        # structured outputs: drafts past the first one a grammar rejects are never verified
        proposals = truncate_drafts(ready, proposals, keep_rejected=self.drafter.has_q)
        budget = eng.budget
        if budget is not None:
            budget.record_draft_time(time.perf_counter() - t0)
            # Confidences are this round's: the drafter ran just now on the step the ledger has
            # just processed. Speculative steps are synchronous, so no older round is involved;
            # while speculation is paused (overlapped steps) nothing is drafted at all.
            keep = budget.trim(ready, [d for d, _ in proposals], [c for _, c in proposals])
            proposals = [(d[:m], c[:m]) for (d, c), m in zip(proposals, keep)]
            if eng.overlap_when_paused:
                # Any draft kept ends the pause: drafts need the synchronous path. Only a verdict
                # on the load pauses, not a step where no request had room to draft (requests
                # at their last token). Prompt chunks in the step do not sway the verdict: the
                # budget prices drafts as in a decode-only step (VerifyBudgetPolicy._choose).
                pause = any(limits) and not any(keep)
                if budget.verdict_speculates:
                    self._stale_limit = MAX_STALE_PAUSES
                elif pause and self._stale_pauses >= self._stale_limit:
                    # a round forced by staleness confirmed the pause: the next comes later
                    self._stale_limit = min(2 * self._stale_limit + 1, MAX_STALE_PAUSES_CAP)
                self._paused_until = eng.scheduler.step_id + 1 + PAUSE_STEPS if pause else 0
                self._stale_pauses = 0
        for s, (d, conf) in zip(ready, proposals):
            pool.put(s.slot, d, conf)
