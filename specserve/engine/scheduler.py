"""Continuous batching: admit and chunk prefills, grow KV, preempt by recompute, build a step."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from specserve.engine.block_manager import BlockManager
from specserve.engine.draft_rows import draft_rows
from specserve.engine.sequence import FinishReason, SeqStatus, Sequence
from specserve.engine.slots import DraftSlotPool


@dataclass
class StepBatch:
    """What one step computes. Request i feeds query_lens[i] rows: prompt chunk tokens, or the
    last token (the anchor row) followed by its drafts. Requests with samples[i] produce logits for
    their last 1 + num_drafts[i] rows (the verify layout); the others are mid-prefill."""

    step: int
    seqs: list[Sequence]
    query_lens: list[int]
    num_drafts: list[int]
    samples: list[bool]
    drafts: list[list[int]]
    starts: list[int] = field(default_factory=list)  # KV position of each request's first row
    epochs: list[int] = field(default_factory=list)  # seq.epoch when scheduled
    preempted: list[Sequence] = field(default_factory=list)
    # device drafters: the drafts of each request are read from the slot pool on the device
    # (drafts[i] holds -1 placeholders), and shifts[i] says its rows start after drafts still in
    # flight (the device moves them back by the rows that step rejected)
    device_drafts: bool = False
    shifts: list[bool] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # given a slot in this step
    # a device-split step: its rows in all (the verify budget's choice); each request's drafts
    # above are its most, the device choosing within this total (runner/device_split.py)
    split_total: int | None = None

    @property
    def num_rows(self) -> int:
        return sum(self.query_lens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def is_decode_shaped(self) -> bool:
        """Every request feeds its anchor row and drafts, all wanting logits (no prompt chunk):
        the steps the verify budget prices. A request completing its prompt samples too, but
        its chunk's rows cost far less per row than decode rows."""
        # every request has q >= 1 + d (drafts only ride on a decode row), so the sums are equal
        # exactly when each q is; sums and all() over lists run in C (the engine asks this every
        # step: a generator over 256 requests cost ~20 us of host time)
        return all(self.samples) and sum(self.query_lens) == len(self.query_lens) + sum(
            self.num_drafts
        )


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        slot_pool: DraftSlotPool | None = None,
        device_drafts: bool = False,
        lookahead: int = 0,
    ) -> None:
        self.bm = block_manager
        self.slots = slot_pool
        self.device_drafts = device_drafts
        # positions past a decode request's rows a device drafter writes its own KV at (blocks
        # grown for them when free; a request short of them drafts into padding, lossless)
        self.lookahead = lookahead
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.step_id = 0

    # -- queue management ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a request, or finish it at once (prompt_length_exceeded) when its prompt can
        never run; the engine reports that and keeps no reference here."""
        too_long = seq.num_prompt_tokens > self.max_model_len
        never_fits = self.bm.blocks_needed(seq.num_prompt_tokens + 1) > self.bm.num_usable_blocks
        if too_long or never_fits:
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = FinishReason.PROMPT_LENGTH_EXCEEDED
            seq.finished_time = time.perf_counter()
            return
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Stop a request now: free its KV blocks and slot.

        Under overlap its next step may still be in flight, writing KV into these blocks and its
        sampled token into next_tokens[slot]. Reusing them at once is safe because every step
        runs on one device stream: a later step that reuses the block or slot is queued after
        the in-flight one, so its own writes land last; the host never reads either. (The race
        SGLang hit came from reading such buffers on another stream or on the host.)"""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._release_slot(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.perf_counter()
        self.bm.free(seq.block_table)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: drop its KV; prompt + emitted tokens are prefilled again."""
        self.running.remove(seq)
        self._release_slot(seq)  # its drafts are gone; it recomputes and drafts afresh
        self.bm.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        # a step in flight for it pushes nothing: its pending token is sampled again after the
        # recompute (same RNG counter, so the same token)
        seq.num_pending = 0
        seq.num_pending_drafts = 0
        seq.epoch += 1
        self.waiting.appendleft(seq)

    # -- one step -----------------------------------------------------------------------------
    def decode_ready(self) -> list[Sequence]:
        """The running requests whose next rows are a decode/verify step's (an anchor row and
        drafts), in scheduling order."""
        return [
            s
            for s in self.running
            if s.num_uncomputed_tokens == 1 and not (s.num_pending and self._ends_with_pending(s))
        ]

    def schedule(
        self, only: set[str] | None = None, draft_caps: dict[int, int] | None = None
    ) -> StepBatch:
        """Running requests first (decode/verify rows, then their remaining prefill chunks), then
        new prefills while the token budget, max_num_seqs and free blocks allow.
        only: request ids; a step of just these (the engine's fault isolation), the others
        wait (they may still be preempted to make room). draft_caps: device drafters, the most
        draft rows of each request by slot (the verify budget's choice; absent: none); None:
        k each."""
        self.step_id += 1
        batch = StepBatch(self.step_id, [], [], [], [], [], device_drafts=self.device_drafts)
        budget = self.max_num_batched_tokens

        idx = 0
        bs = self.bm.block_size
        host_drafts = (
            self.slots.token_ids if self.slots is not None and not self.device_drafts else None
        )
        while idx < len(self.running) and budget > 0:
            seq = self.running[idx]
            if only is not None and seq.request_id not in only:
                idx += 1
                continue
            if seq.num_pending and self._ends_with_pending(seq):
                idx += 1  # finishes when the ledger reads its step in flight: nothing to run
                continue
            remaining = seq.num_uncomputed_tokens
            if self.device_drafts:
                cap = self.slots.k if draft_caps is None else draft_caps.get(seq.slot, 0)
                nd = draft_rows(seq, cap, budget, self.max_model_len)
                d: list[int] = [-1] * nd if remaining == 1 else []
            else:
                d = host_drafts[seq.slot] if host_drafts is not None and remaining == 1 else []
            if d and not self.device_drafts:
                # drafts never push the sequence past max_model_len, max_tokens or the budget
                room = min(budget - 1, self.max_model_len - seq.num_tokens)
                if seq.params.max_tokens is not None:
                    room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
                d = d[: max(0, room)]
            rows = min(remaining, budget) if not d else 1 + len(d)
            # the rows fit the blocks it holds (most decode steps): nothing to allocate
            if seq.num_computed_tokens + rows > len(seq.block_table.blocks) * bs:
                while not self.bm.can_allocate(seq.block_table, seq.num_computed_tokens + rows):
                    victim = self.running[-1]
                    self._preempt(victim)
                    batch.preempted.append(victim)
                    if victim is seq:
                        break
                if seq.status is not SeqStatus.RUNNING:
                    break  # it preempted itself: nothing later in the list is left either
            self._add_to_batch(batch, seq, rows, d)
            budget -= rows
            idx += 1

        if not batch.preempted:
            while budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self._next_waiting(only)
                if seq is None:
                    break
                if seq.num_computed_tokens == 0 and not seq.block_table.blocks:
                    # prompt_logprobs score every prompt row: no prefix-cache hit (as vLLM)
                    scores = seq.params.prompt_logprobs is not None and not seq.num_output_tokens
                    blocks, hashes = ([], []) if scores else self.bm.match_prefix(seq.token_ids)
                    rows = min(seq.num_tokens - len(blocks) * self.bm.block_size, budget)
                    if not self._fits(seq, blocks, rows):
                        break
                    self.bm.take_cached(seq.block_table, blocks, hashes)
                    seq.num_computed_tokens = seq.num_cached_tokens = (
                        len(blocks) * self.bm.block_size
                    )
                else:
                    rows = min(seq.num_uncomputed_tokens, budget)
                    if not self.bm.can_allocate(seq.block_table, seq.num_computed_tokens + rows):
                        break
                if only is None:
                    self.waiting.popleft()
                else:
                    self.waiting.remove(seq)
                seq.status = SeqStatus.RUNNING
                if self.slots is not None:
                    seq.slot = self.slots.allocate()
                    batch.admitted.append(seq)
                self.running.append(seq)
                self._add_to_batch(batch, seq, rows, [])
                budget -= rows
        return batch

    def _next_waiting(self, only: set[str] | None) -> Sequence | None:
        if only is None:
            return self.waiting[0] if self.waiting else None
        return next((s for s in self.waiting if s.request_id in only), None)

    def roll_back(self, batch: StepBatch, undo_pending: bool) -> None:
        """Undo a step that was scheduled but will never reach the ledger (it failed): each of
        its requests' KV ledger goes back to where the step's rows began. The KV before that is
        untouched (a step writes only its own rows), so re-running the request from there is
        exact. The blocks grown for the step stay in its table, where the re-run needs them
        (and where a draft model's KV for those positions still is); finishing frees them.
        Roll back the newest step first when several are undone. undo_pending: the step was
        launched overlapped, so it counted one pending token for each request it samples."""
        for seq, start, epoch, samples, nd in zip(
            batch.seqs, batch.starts, batch.epochs, batch.samples, batch.num_drafts
        ):
            if seq.is_finished or seq.epoch != epoch:
                continue  # finished or preempted since: its KV went with its blocks
            if undo_pending and samples:
                seq.num_pending = max(0, seq.num_pending - 1)
                seq.num_pending_drafts = max(0, seq.num_pending_drafts - nd)
            seq.num_computed_tokens = start

    def all_may_end(self) -> bool:
        """Under overlap: no request waits, and every running one is decoding with drafts in
        flight that take it to max_tokens or max_model_len if all are accepted. A step launched
        ahead of their readback would then be discarded whole (at batch 1: every request's
        last), so the engine reads the step in flight back first."""
        # per step: the all() stops at the first request that goes on (most steps, any batch)
        return (
            not self.waiting
            and all(s.num_pending and self._ends_with_pending(s, True) for s in self.running)
            and any(s.num_pending_drafts for s in self.running)
        )

    def _ends_with_pending(self, seq: Sequence, drafts: bool = False) -> bool:
        """Under overlap: the step in flight already takes the request to max_tokens or
        max_model_len (drafts: if its drafts in flight are all accepted), so scheduling another
        row for it would only be discarded."""
        n_tokens = seq.num_tokens + seq.num_pending + (seq.num_pending_drafts if drafts else 0)
        max_tokens = seq.params.max_tokens
        if max_tokens is not None and n_tokens - seq.num_prompt_tokens >= max_tokens:
            return True
        return n_tokens >= self.max_model_len

    def _release_slot(self, seq: Sequence) -> None:
        if self.slots is not None and seq.slot:
            self.slots.release(seq.slot)
            seq.slot = 0

    def _fits(self, seq: Sequence, cached: list[int], rows: int) -> bool:
        cached_free = sum(1 for b in cached if self.bm.blocks[b].ref_count == 0)
        new_blocks = self.bm.blocks_needed(len(cached) * self.bm.block_size + rows) - len(cached)
        return new_blocks + cached_free <= self.bm.num_free_blocks

    def _add_to_batch(self, batch: StepBatch, seq: Sequence, rows: int, drafts: list[int]) -> None:
        start = seq.num_computed_tokens
        if start + rows > len(seq.block_table.blocks) * self.bm.block_size:
            self.bm.allocate(seq.block_table, start + rows)
        if self.lookahead:
            ahead = start + rows + self.lookahead
            if self.bm.can_allocate(seq.block_table, ahead):
                self.bm.allocate(seq.block_table, ahead)
        pending_drafts = seq.num_pending_drafts
        samples = start + rows - len(drafts) == (
            len(seq.token_ids) + seq.num_pending + pending_drafts
        )
        batch.shifts.append(pending_drafts > 0)
        batch.starts.append(start)
        batch.epochs.append(seq.epoch)
        seq.num_computed_tokens = start + rows  # advance_optimistically
        batch.seqs.append(seq)
        batch.query_lens.append(rows)
        batch.num_drafts.append(len(drafts))
        batch.samples.append(samples)
        batch.drafts.append(drafts)

    def check_invariants(self) -> None:
        self.bm.check_invariants()
        if self.slots is not None:  # invariant 4: slots in use == running requests
            assert self.slots.num_in_use == len(self.running)
            assert all(s.slot > 0 for s in self.running)
        if not self.running and not self.waiting:
            assert self.bm.num_used_blocks == 0, "idle engine holds KV blocks"
