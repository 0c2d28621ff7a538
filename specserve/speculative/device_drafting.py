"""Drafting inside the step (device drafters): after a step's verification the drafter writes
the next step's drafts into the draft slot pool, where that step's inputs read them. The host
never sees a draft, so the next step can be scheduled and launched while this one runs.

EAGLE-3 (eagle3_device.py) and the draft model (draft_model_device.py) run after the
verification the same way (`model_drafter` below: their catch-up layout is read from the requests at
launch).

What the host does: when a request starts running (admission, also after a preemption) it
uploads the request's tokens (n-gram history) and golden ids + coins, applied on the device at
the start of that step, in stream order behind every step that still reads the slot's previous
owner. Everything else is device work in StepSampler.execute's after_verify (n-gram's
confidences too: ngram_device.py learns them from each step's verification).

The verify budget (allot below) sizes each request's rows on the host from the confidences read
back with each step: those of the drafts a step wrote for the step after it. Under overlap the
newest the host has when it lays out step N+1 are the ones of step N's drafts (N, which drafts
for N+1, is still in flight): one step old. A request not yet read back starts at confidence 1
(verify, to learn). A request whose newest drafts are fewer than its rows checks -1 there. A
step sampling in its graph tail has only its total fixed so (row_plan.py); the device shares it
by the newest confidences (runner/device_split.py).

A model drafter's chain runs in every step that drafts, so with the budget each step also
chooses whether to draft (VerifyBudget.plan). A step that does not is a plain step: no feed, no
drafter, no hook (one whose rows still verify or shift by drafts in flight runs the device path,
in the drafted graph tail when it can, without the drafter's chain). When drafting resumes, a
request catches up its drafter's KV from the length after the last step that drafted for it
(read back) to its anchor, ahead of the step's forward (`gap`; the anchor token, still in
flight, read from next_tokens there), so the step drafts as a steady one; the budget waits for
the request's drafts in flight to settle first (may_draft).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from specserve.config import SpeculativeConfig
from specserve.engine.ledger import HostStepResult
from specserve.engine.scheduler import StepBatch
from specserve.engine.sequence import Sequence
from specserve.engine.slots import DraftSlotPool
from specserve.ops.transfer import h2d
from specserve.runner.graph_tail import TailDrafting, TailStep
from specserve.runner.step_sampler import SamplerPlan
from specserve.sample.verify import VerifyResult
from specserve.speculative.catch_up import pack_catch_up
from specserve.speculative.draft_model_device import DraftModelDeviceDrafter
from specserve.speculative.eagle3_device import Eagle3DeviceDrafter
from specserve.speculative.golden_device import GoldenDeviceDrafter
from specserve.speculative.ngram_device import NgramDeviceDrafter
from specserve.speculative.verify_budget import VerifyBudget, survivals

DEVICE_METHODS = ("ngram", "golden", "eagle3", "draft_model")
# (rows, requests) of the gap catch-ups run at start-up (warm_gaps): a row count of 1, a
# multiple of 16 and neither (Triton's specializations), short and long gaps, one request and
# several
GAP_WARMUP = [(r, n) for r in (1, 2, 7, 16, 17, 48, 100, 256, 700) for n in (1, 3) if r >= n]


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
        # model drafters: the budget's choice for the step laid out last (VerifyBudget.plan);
        # per slot, whether its latest sampling step drafted, and the length after the last
        # one that did, read back (its drafter's KV is valid that far: 0 = none yet)
        self.drafting_now = True
        self.drafted = np.zeros(pool.num_slots + 1, dtype=bool)
        self.kv_len = np.zeros(pool.num_slots + 1, dtype=np.int64)
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

        def after(r: int) -> None:  # a step that does not draft verifies, its chain idle
            if self.drafting_now:
                md.chain.replay_tail(r)

        return TailDrafting(self.pool, inputs, after)

    def tail_ready(self, seqs: list[Sequence]) -> bool:
        """Whether a step of these requests may draft in the graph tail (given the tail takes
        its sampling, sampler_inputs.pack_tail): golden's always; a model drafter's when every
        request is greedy (sampled drafts are verified against their q: the eager sampler's)
        without golden ids and, in a step that drafts, caught up to its anchor (drafted for in
        its previous step, or by `gap`; a prompt's catch-up runs eagerly behind the forward).
        A step that does not draft runs the tail with its chain idle."""
        if self.model_drafter is None:
            return True
        return all(s.params.greedy and not s.params.golden_token_ids for s in seqs) and (
            not self.drafting_now or self.all_drafted(seqs)
        )

    def plain(self, batch: StepBatch) -> bool:
        """A step the device drafter takes no part in: a model drafter's that does not draft,
        with no drafts to verify and none in flight to shift its rows."""
        return (
            self.model_drafter is not None
            and not self.drafting_now
            and not any(batch.num_drafts)
            and not any(batch.shifts)
        )

    def all_drafted(self, seqs: list[Sequence]) -> bool:
        """Was each request drafted for in its latest step (before this one is launched)?"""
        return bool(seqs) and all(self.drafted[s.slot] for s in seqs)

    def launched(self, seqs: list[Sequence]) -> None:
        """A step of these sampling requests is launched (after its hook was laid out)."""
        for s in seqs:
            self.drafted[s.slot] = self.drafting_now

    def gap(
        self,
        batch: StepBatch,
        seqs: list[Sequence],  # its sampling requests
        anchor_pos: list[int],
        next_tokens: torch.Tensor,  # [slots + 1] int64, the runner's
    ) -> Callable[[], None] | None:
        """A model drafter's drafting step: the requests with decode rows that were not drafted
        for in their previous step catch up their drafter's KV over every position since the
        last step that did (to the anchor), laid out now and run by the returned callable
        ahead of the step's forward (the anchors in flight still in next_tokens, the target's
        hidden states of those positions stored by earlier steps). They then count as drafted
        for: the step drafts as a steady one."""
        md = self.model_drafter
        if md is None or not self.drafting_now:
            return None
        rows = zip(batch.query_lens, batch.num_drafts, batch.samples)
        decode = [q == 1 + m for q, m, sm in rows if sm]  # an anchor and drafts, no prompt
        behind = [i for i, s in enumerate(seqs) if decode[i] and not self.drafted[s.slot]]
        if not behind:
            return None
        sub = [seqs[i] for i in behind]
        lay = md.gap_layout(
            sub, [int(self.kv_len[s.slot]) for s in sub], [anchor_pos[i] for i in behind]
        )
        slots = h2d([s.slot for s in sub], torch.int64, self.device)
        for s in sub:
            self.drafted[s.slot] = True
        return lambda: md.catch_up_gap(lay, next_tokens[slots])

    def capture(self, backend) -> None:
        """CUDA graphs of the model drafter's fixed-shape work (draft_graphs.py), and its gap
        catch-up's kernels compiled."""
        if self.model_drafter is not None:
            self.model_drafter.capture(backend)
            self.warm_gaps()

    @torch.inference_mode()
    def warm_gaps(self) -> None:
        """Run the gap catch-up eagerly once at each of GAP_WARMUP's shapes (rows, requests)
        before serving, over blocks no request holds yet: a catch-up past the rows buckets'
        graphs (catch_up_graphs.py) runs eagerly, its rows vary from step to step, and a Triton
        kernel variant first met mid-run stalls that step for about a second (H100)."""
        md = self.model_drafter
        bs = md.block_size
        for rows, reqs in GAP_WARMUP:
            per = max(1, rows // reqs)
            nb = -(-per // bs)
            if reqs * nb > md.trash - 1:  # a KV cache too small to hold it: skip the shape
                continue
            tables = [list(range(1 + i * nb, 1 + (i + 1) * nb)) for i in range(reqs)]
            lay = pack_catch_up(
                ([0] * per * reqs, [0] * per * reqs, list(range(per)) * reqs,
                 [i for i in range(reqs) for _ in range(per)], [False] * per * reqs),
                [per] * reqs, [per] * reqs, tables, per, bs, md.trash, self.device,
            )  # fmt: skip
            md.catch_up_gap(lay, torch.zeros(reqs, dtype=torch.int64, device=self.device), True)

    # -- host ---------------------------------------------------------------------------------
    def admit(self, seqs: list[Sequence]) -> list[Admission]:
        """Uploads for the requests given a slot in this step (host: read them now)."""
        out = []
        for seq in seqs:
            self.host_conf[seq.slot] = 1.0
            self.drafted[seq.slot], self.kv_len[seq.slot] = False, 0
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
    ) -> Callable[[SamplerPlan, VerifyResult, torch.Tensor], None] | None:
        """The after_verify of one step (its sampling requests, the KV position of each anchor
        row as laid out, its draft rows): drafts the next step (None: a model drafter's step
        that does not draft). Host inputs are read now: a model drafter's catch-up layout."""
        lay = None
        # the longest sequence after this step, at most: all drafts accepted
        bound = max((p + n + 2 for p, n in zip(anchor_pos, num_drafts)), default=1)
        if self.model_drafter is not None:
            if not self.drafting_now:
                return None
            # None: caught up to its anchor; else the length its KV is valid to (a prompt's)
            resume = [None if self.drafted[s.slot] else int(self.kv_len[s.slot]) for s in seqs]
            lay = self.model_drafter.layout(seqs, anchor_pos, num_drafts, resume)

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
                self.ngram.learn(slots, plan.layout.seqlens_q, result.num_accepted)
                self.ngram.draft(slots, seq_len, bound)
            elif self.model_drafter is not None:
                self.model_drafter.draft(
                    lay, plan, result, seq_len, seq_len - self.prompt_len[slots]
                )
            else:
                self.golden.draft(slots, seq_len, self.prompt_len)

        return hook

    def allot(self, ready: list[Sequence], budget: VerifyBudget, room: list[int]) -> list[int]:
        """The draft rows of each decode-ready request in the next step (room[i]: its most);
        a model drafter's: also whether that step drafts (drafting_now)."""
        slots = [s.slot for s in ready]
        if not budget.drafting or not ready:
            return budget.allot(survivals(self.host_conf[slots]), len(ready), room)
        may = all(self.drafted[s.slot] or not s.num_pending_drafts for s in ready)
        plan = budget.plan(self.host_conf[slots], len(ready), room, self.drafted[slots], may)
        self.drafting_now = plan.draft
        return plan.keep

    def observe(self, seqs: list[Sequence], host: HostStepResult, drafted: bool = True) -> None:
        """A step read back (drafted: it drafted for the next): the confidences its drafts came
        with and, for a model drafter, the length its drafter's KV is now valid to (a request
        that ended since has given its slot away: skipped)."""
        if host.next_confidences is not None and drafted:
            for s, conf, acc in zip(seqs, host.next_confidences, host.num_accepted):
                if s.slot and not s.is_finished:
                    self.host_conf[s.slot, : len(conf)] = conf
                    self.kv_len[s.slot] = s.num_tokens + acc + 1  # read before its ledger

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
