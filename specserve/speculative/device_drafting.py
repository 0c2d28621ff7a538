"""Drafting inside the step (device drafters): after a step's verification the drafter writes
the next step's drafts into the draft slot pool, where that step's inputs read them. The host
never sees a draft, so the next step can be scheduled and launched while this one runs.

EAGLE-3 (eagle3_device.py) and the draft model (draft_model_device.py) run after the
verification the same way (`model_drafter` below: their catch-up layout is read from the requests at
launch).

What the host does: when a request starts running (admission, also after a preemption) it
uploads the request's tokens (n-gram history) and golden ids + coins, applied on the device at
the start of that step, in stream order behind every step that still reads the slot's previous
owner. Per step it uploads the n-gram confidences (its acceptance estimate, learned one step
late from the readback). Everything else is device work in StepSampler.execute's after_verify.

The verify budget (allot below) sizes each request's rows on the host from the confidences read
back with each step: those of the drafts a step wrote for the step after it. Under overlap the
newest the host has when it lays out step N+1 are the ones of step N's drafts (N, which drafts
for N+1, is still in flight): one step old. A request not yet read back starts at confidence 1
(verify, to learn). A request whose newest drafts are fewer than its rows checks -1 there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from specserve.config import SpeculativeConfig
from specserve.engine.ledger import HostStepResult
from specserve.engine.sequence import Sequence
from specserve.engine.slots import DraftSlotPool
from specserve.ops.transfer import h2d
from specserve.runner.graph_tail import TailDrafting, TailStep
from specserve.runner.step_sampler import SamplerPlan
from specserve.sample.verify import VerifyResult
from specserve.speculative.acceptance import PRIOR_RATE, AcceptanceEstimator
from specserve.speculative.draft_model_device import DraftModelDeviceDrafter
from specserve.speculative.eagle3_device import Eagle3DeviceDrafter
from specserve.speculative.golden_device import GoldenDeviceDrafter
from specserve.speculative.ngram_device import NgramDeviceDrafter
from specserve.speculative.verify_budget import VerifyBudget, survivals

DEVICE_METHODS = ("ngram", "golden", "eagle3", "draft_model")


class Admission(NamedTuple):
    slot: int
    num_tokens: int
    num_prompt_tokens: int
    tokens: torch.Tensor | None  # [n] int64, n-gram history
    gold: torch.Tensor | None  # [g] int64 golden ids
    coins: torch.Tensor | None  # [g] bool, golden drafter


class DeviceDrafting:
    def __init__(
        self,
        spec: SpeculativeConfig,
        pool: DraftSlotPool,
        vocab_size: int,
        seed: int,
        max_model_len: int,
        engine: object = None,  # eagle3: the engine the head is built for (eagle3.py)
    ) -> None:
        assert spec.method in DEVICE_METHODS
        self.pool = pool
        self.device = pool.device
        self.max_model_len = max_model_len
        self.k = pool.k
        # [slots + 1] int64 prompt length of each slot's request (golden: output positions)
        self.prompt_len = torch.zeros(pool.num_slots + 1, dtype=torch.int64, device=pool.device)
        # [slots + 1, k] the newest confidences read back per slot (the budget's inputs)
        self.host_conf = np.ones((pool.num_slots + 1, max(self.k, 1)))
        self.ngram: NgramDeviceDrafter | None = None
        self.golden: GoldenDeviceDrafter | None = None
        self.model_drafter: Eagle3DeviceDrafter | DraftModelDeviceDrafter | None = None
        if spec.method == "draft_model":
            from specserve.speculative.draft_model import DraftModelDrafter

            self.model_drafter = DraftModelDeviceDrafter(
                DraftModelDrafter(spec, engine), pool, max_model_len
            )
        elif spec.method == "eagle3":
            from specserve.speculative.eagle3 import Eagle3Drafter

            self.model_drafter = Eagle3DeviceDrafter(
                Eagle3Drafter(spec, engine), pool, max_model_len
            )
        elif spec.method == "ngram":
            self.ngram = NgramDeviceDrafter(
                pool, spec.prompt_lookup_min, spec.prompt_lookup_max, max_model_len
            )
            self.acceptance = AcceptanceEstimator()
        else:
            self.golden = GoldenDeviceDrafter(pool, spec.acceptance_rate, vocab_size, seed)
            # its tables before any graph captures their addresses (tail_drafting)
            self.golden.allocate(pool.ensure_gold(max_model_len))

    def tail_drafting(self) -> TailDrafting | None:
        """The drafter's work as a graph tail takes it (runner/graph_tail.py). Golden's needs
        nothing from the host per step. A model drafter's steady greedy step (every request
        caught up, tail_ready) has the tail write its chain's inputs, then replays its chain's
        graph for the step's real requests (its bucket by requests, not by the forward's
        rows). n-gram's matcher scans as much history as the step's longest request (a graph
        would scan max_model_len tokens of every slot each step): its steps sample eagerly."""
        prompt_len = self.prompt_len
        if self.golden is not None:
            golden = self.golden
            return TailDrafting(
                self.pool, lambda st: golden.draft(st.views.slots, st.seq_len, prompt_len)
            )
        md = self.model_drafter
        if md is None or not md.chain.buckets:  # CPU: the chain runs unpadded, eagerly
            return None

        def inputs(st: TailStep) -> None:
            md.chain.tail_inputs(st, st.seq_len - prompt_len[st.views.slots])

        return TailDrafting(self.pool, inputs, lambda r: md.chain.replay_tail(r))

    def tail_ready(self, seqs: list[Sequence]) -> bool:
        """Whether a step of these requests may draft in the graph tail (given the tail takes
        its sampling, sampler_inputs.pack_tail): golden's always; a model drafter's when every
        request is greedy (sampled drafts are verified against their q: the eager sampler's),
        without golden ids, and caught up in its epoch (a fresh one catches up eagerly)."""
        md = self.model_drafter
        if md is None:
            return True
        return all(
            s.params.greedy
            and not s.params.golden_token_ids
            and md.caught_up.get(s.request_id) == s.epoch
            for s in seqs
        )

    def capture(self, backend) -> None:
        """CUDA graphs of the model drafter's fixed-shape work (draft_graphs.py)."""
        if self.model_drafter is not None:
            self.model_drafter.capture(backend)

    # -- host ---------------------------------------------------------------------------------
    def admit(self, seqs: list[Sequence]) -> list[Admission]:
        """Uploads for the requests given a slot in this step (host: read them now)."""
        out = []
        for seq in seqs:
            self.host_conf[seq.slot] = 1.0
            gold = seq.params.golden_token_ids
            g = c = toks = None
            if gold:
                self.pool.ensure_gold(self.max_model_len)
                g = h2d(gold[: self.max_model_len], torch.int64, self.device)
                if self.golden is not None:
                    coins = self.golden.admit_coins(seq)[: self.max_model_len]
                    c = h2d(coins, torch.bool, self.device)
            if self.ngram is not None:
                toks = h2d(seq.token_ids[: self.max_model_len], torch.int64, self.device)
            out.append(Admission(seq.slot, seq.num_tokens, seq.num_prompt_tokens, toks, g, c))
        return out

    def step_hook(
        self, seqs: list[Sequence], anchor_pos: list[int], num_drafts: list[int]
    ) -> Callable[[SamplerPlan, VerifyResult, torch.Tensor], None]:
        """The after_verify of one step (its sampling requests, the KV position of each anchor
        row as laid out, its draft rows): drafts the next step. Host inputs are read now: the
        n-gram confidences (the acceptance seen so far), EAGLE-3's catch-up layout."""
        conf = lay = None
        # the longest sequence after this step, at most: all drafts accepted
        bound = max((p + n + 2 for p, n in zip(anchor_pos, num_drafts)), default=1)
        if self.ngram is not None:
            rates = [self.acceptance.global_rates.rate(j, PRIOR_RATE) for j in range(self.k)]
            conf = h2d(rates, torch.float32, self.device)
        if self.model_drafter is not None:
            lay = self.model_drafter.layout(seqs, anchor_pos, num_drafts)

        def hook(plan: SamplerPlan, result: VerifyResult, seq_len: torch.Tensor) -> None:
            slots = plan.slots
            if self.ngram is not None:
                self.ngram.append(
                    slots,
                    plan.layout,
                    result.verified_token_ids,
                    result.sampled_token_ids,
                    result.num_accepted,
                    seq_len,
                )
                self.ngram.draft(slots, seq_len, conf, bound)
            elif self.model_drafter is not None:
                self.model_drafter.draft(
                    lay, plan, result, seq_len, seq_len - self.prompt_len[slots]
                )
            else:
                self.golden.draft(slots, seq_len, self.prompt_len)

        return hook

    def allot(self, ready: list[Sequence], budget: VerifyBudget, room: list[int]) -> list[int]:
        """The draft rows of each decode-ready request in the next step (room[i]: its most)."""
        surv = survivals(self.host_conf[[s.slot for s in ready]])
        return budget.allot(surv, len(ready), room)

    def observe(self, seqs: list[Sequence], host: HostStepResult) -> None:
        """A step read back: the confidences its drafts for the next step came with (a request
        that ended since has given its slot away: skipped); the n-gram acceptance estimate
        learns from its real drafts."""
        if host.next_confidences is not None:
            for s, conf in zip(seqs, host.next_confidences):
                if s.slot and not s.is_finished:
                    self.host_conf[s.slot, : len(conf)] = conf
        if self.ngram is None or host.num_real_drafts is None:
            return
        for s, n, acc in zip(seqs, host.num_real_drafts, host.num_accepted):
            if n:
                self.acceptance.record(s.request_id, n, min(acc, n))

    def release(self, seq: Sequence) -> None:
        if self.ngram is not None:
            self.acceptance.release(seq.request_id)
        if self.model_drafter is not None:
            self.model_drafter.release(seq)

    # -- device -------------------------------------------------------------------------------
    def apply(self, admissions: list[Admission]) -> None:
        """At the start of the admitting step's device work: the slots' new owners."""
        pool = self.pool
        for a in admissions:
            pool.draft_ids[a.slot].fill_(-1)
            pool.rejected[a.slot].fill_(0)
            pool.seq_len[a.slot].fill_(a.num_tokens)
            self.prompt_len[a.slot].fill_(a.num_prompt_tokens)
            if pool.gold is not None:
                pool.gold[a.slot].fill_(-1)
                if a.gold is not None:
                    pool.gold[a.slot, : a.gold.shape[0]].copy_(a.gold)
            if self.golden is not None and a.coins is not None:
                self.golden.admit(a.slot, a.coins)
            if self.ngram is not None and a.tokens is not None:
                self.ngram.admit(a.slot, a.tokens)
