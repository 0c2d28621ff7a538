"""Launching a step's device work: its forward, then its verification/sampling, queued without
waiting; under overlap, the sampling of a step whose plan needs the step in flight deferred.

Deferred sampling. A request that reads its output tokens on the host (a grammar's bitmask, bad
words, penalties) cannot have its next sampling planned before the ledger has appended the
tokens of the step in flight. Its rows can be laid out all the same: it verifies no drafts, and
its anchor token is fed on the device from next_tokens like any overlapped request's. So a step
N+1 holding such a request is launched in two parts:

    launch(N+1)      N+1's forward queued behind step N (the device stays busy)
    read, ledger N   the host appends N's tokens: grammar matchers and output tokens advance
    finish(N+1)      the plan's host-token half built, N+1's sampling queued behind its forward

and the ledger and the bitmask fill run while the device computes N+1's forward.

The rest of the plan (RNG counters, min_tokens masks, golden rows, a device drafter's feed) is
read at launch, as for any overlapped step: it counts the tokens of the step in flight as
pending (device drafts as accepted, the device taking off the rejected ones), and read after
that step's ledger it would count them twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from specserve.engine.ledger import HostStepResult
from specserve.engine.scheduler import StepBatch
from specserve.engine.sequence import Sequence
from specserve.runner.cuda_graph import BucketStep
from specserve.runner.graph_tail import SampledTail
from specserve.runner.sampler_inputs import pack_tail
from specserve.runner.step_sampler import SampledStep, SamplerPlan

if TYPE_CHECKING:
    from specserve.llm_engine import LLMEngine


class WorkerStep:
    """A step's device part queued in the CPU worker thread: waits for it, then for its results
    (None for a forward alone: a step of prefill chunks only)."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def wait(self) -> HostStepResult | None:
        out = self.future.result()
        return out.wait() if isinstance(out, SampledStep) else None


class _Deferred(NamedTuple):
    plan: SamplerPlan  # without its host-token half (StepSampler.plan(deferred=True))
    drafts: list[list[int]]  # of its sampling requests
    sample: Callable[[SamplerPlan], SampledStep | WorkerStep]  # queues the sampling


@dataclass
class LaunchedStep:
    batch: StepBatch
    seqs: list[Sequence]  # its sampling requests, in verify-layout order
    t0: float  # host time at launch (the step-cost curve)
    behind: bool  # launched while its predecessor was still in flight (device queue never empty)
    # its results on their way; None: a step of prefill chunks only, or sampling still deferred
    sampled: SampledStep | SampledTail | WorkerStep | None = None
    # overlapped: its requests count its tokens as pending, so it is processed at the next
    # step() (its ledger one step late); set once all its device work is queued
    overlapped: bool = False
    deferred: _Deferred | None = None  # sampling to queue after the step in flight's ledger
    forward: Future | None = None  # CPU worker: its forward
    timed: bool = True  # its readback period prices the step-cost curve (llm_engine._time_step)
    drafted: bool = True  # a model drafter drafted in it (the budget's curve of its kind)
    from_drafts: bool = False  # it verifies a model drafter's drafts (the budget's yield)
    rows: int | None = None  # a device-split step's rows (the host's total): what it costs
    # prompt (prompt rows in it), drafting (a model drafter's chain ran), verify (draft rows,
    # no chain) or plain: the device timeline's kind (runner/timeline.py)
    kind: str = "plain"


def settle(launched: LaunchedStep) -> None:
    """A launched step that will be rolled back: let its device part finish first, whatever its
    outcome (the CPU worker may still be writing its KV rows). On CUDA nothing to wait for: a
    step re-run later is queued behind it on the same stream, so its own writes land last."""
    if isinstance(launched.sampled, WorkerStep):
        launched.sampled.future.exception()  # waits; the failure is the step's, discarded
    elif launched.forward is not None:  # the worker runs one task at a time: the last queued
        launched.forward.exception()


def reads_tokens_in_flight(seqs: list[Sequence]) -> bool:
    """Does a sampling request read, on the host, tokens the step in flight has yet to append?"""
    return any(s.num_pending and s.params.reads_output_tokens for s in seqs)


class Launcher:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine  # its runner, sampler, drafters, worker: read at each launch

    def launch(self, batch: StepBatch, overlap: bool, behind: bool) -> LaunchedStep:
        """Queue the step's forward and, unless deferred, its verification; nothing waits for
        it. Deferred (overlapped behind a step in flight whose tokens a sampling request reads
        on the host): finish() queues the verification once that step's ledger has run."""
        t0 = time.perf_counter()
        eng, dd = self.engine, self.engine.device_drafting
        assert not (overlap and any(batch.num_drafts) and dd is None), "host drafts need sync"
        seqs = [s for s, sm in zip(batch.seqs, batch.samples) if sm]
        drafts = [d for d, sm in zip(batch.drafts, batch.samples) if sm]
        eng.timeline.begin("decode" if batch.is_decode_shaped else "other")
        inputs = eng.runner.prepare(batch)
        admitted = dd.admit(batch.admitted) if dd is not None and batch.admitted else None
        drafted = dd is None or dd.drafting_now
        # it verifies what a model drafter's drafting step made for each of its requests
        from_drafts = dd is not None and dd.model_drafter is not None and dd.all_drafted(seqs)
        plain = dd is not None and dd.plain(batch)
        if plain:
            dd = None  # a model drafter's step that does not draft: a plain step
        hook, plan_args, gap = None, {}, None
        if dd is not None and seqs:
            plan_args = self._device_feed(batch)
            gap = dd.gap(batch, seqs, plan_args["anchor_pos"], eng.runner.next_tokens)
        draft_q = eng.speculator.draft_q(seqs, drafts) if eng.speculator and seqs else None
        # the token each request sampled: the next overlapped step (or drafting step) reads it
        has_dd = eng.device_drafting is not None
        next_tokens = eng.runner.next_tokens if overlap or has_dd else None
        defer = overlap and behind and reads_tokens_in_flight(seqs)
        worker = eng._worker if overlap else None
        # the common shape samples inside the bucket's graph, behind its forward (graph_tail.py)
        decode_bucket = isinstance(inputs, BucketStep) and not inputs.bucket.mixed
        tail = eng.runner.graphs.tail if decode_bucket else None
        if tail is not None and worker is None and seqs and draft_q is None and not defer:
            if dd is None:
                inputs.tail = not inputs.split and pack_tail(seqs, drafts, inputs.tail_views())
            elif tail.drafting is not None and dd.tail_ready(seqs):  # and its drafter's work
                feed = (plan_args["shifts"], plan_args["anchor_pos"])
                split = [len(d) for d in drafts] if inputs.split else None
                if pack_tail(seqs, drafts, inputs.tail_views(), feed, split):
                    inputs.tail, inputs.seqlens_q = True, [1 + len(d) for d in drafts]
        if isinstance(inputs, BucketStep) and inputs.split and not inputs.tail:
            # the device lays a split step out in the tail's path only: this one, the host
            inputs = eng.runner.prepare(batch, split=False)
        if plan_args and not (isinstance(inputs, BucketStep) and inputs.tail):
            hook = dd.step_hook(seqs, plan_args["anchor_pos"], [len(d) for d in drafts])
        if has_dd and seqs:
            eng.device_drafting.launched(seqs)
        step = LaunchedStep(batch, seqs, t0, behind, drafted=drafted, from_drafts=from_drafts)
        if isinstance(inputs, BucketStep) and inputs.split:
            step.rows = batch.split_total
        chain = has_dd and eng.device_drafting.model_drafter is not None and drafted and not plain
        if not batch.is_decode_shaped:
            step.kind = "prompt"
        elif chain or any(batch.num_drafts):
            step.kind = "drafting" if chain else "verify"
        if has_dd and eng.device_drafting.model_drafter is not None:
            # the budget's curves price plain steps and steady drafting ones: a switch between
            # them (a catch-up, drafts verified with the chain idle) is neither
            step.timed = plain or (drafted and from_drafts)
        logits: torch.Tensor | None = None  # inline (no worker): the forward's output

        def forward() -> torch.Tensor | SampledTail:  # [total_q, V]
            if admitted:
                eng.device_drafting.apply(admitted)
            if gap is not None:
                gap()
            return eng.runner.forward(inputs)

        def plan() -> SamplerPlan | None:
            return eng.sampler.plan(seqs, drafts, deferred=defer, **plan_args) if seqs else None

        if worker is not None:
            # CPU: the forward runs in the worker while this thread runs the ledger of the
            # previous step and builds the next one (torch releases the GIL inside its ops)
            p = plan()  # read from the requests before this thread moves on
            step.forward = worker.submit(forward)
        else:
            logits = forward()
            if isinstance(logits, SampledTail):
                step.sampled = logits
                self._queued(step, overlap, drafts)
                return step
            p = plan()  # host work (grammar bitmasks) while the device runs the forward queued

        def sample(full: SamplerPlan) -> SampledStep | WorkerStep:
            if worker is None:
                return eng.sampler.execute(full, logits, draft_q, next_tokens, hook)

            def run() -> SampledStep:  # in the worker: its forward ran before (one thread)
                return eng.sampler.execute(full, step.forward.result(), draft_q, next_tokens, hook)

            return WorkerStep(worker.submit(run))

        if defer:
            step.deferred = _Deferred(p, drafts, sample)
            return step
        if p is not None:
            step.sampled = sample(p)
        elif worker is not None:
            step.sampled = WorkerStep(step.forward)
        self._queued(step, overlap, drafts)
        return step

    def finish(self, step: LaunchedStep) -> None:
        """Queue a deferred step's verification: the plan's host-token half built now, from the
        requests the ledger of the step before has just advanced. A request that ended there
        keeps its rows; the ledger discards them (StepSampler.complete leaves them alone)."""
        d = step.deferred
        plan = self.engine.sampler.complete(d.plan, step.seqs, d.drafts)
        step.sampled = d.sample(plan)
        step.deferred = None
        self._queued(step, True, d.drafts)

    def _queued(self, step: LaunchedStep, overlap: bool, drafts: list[list[int]]) -> None:
        """All of the step's device work is queued: under overlap its requests now count its
        tokens as pending (its drafts as accepted) until the ledger reads it back."""
        if overlap:
            step.overlapped = True
            for s, d in zip(step.seqs, drafts):
                s.num_pending += 1
                s.num_pending_drafts += len(d)
        self.engine.timeline.end(step.kind)

    @staticmethod
    def _device_feed(batch: StepBatch) -> dict:
        """A device-drafted step's sampler plan arguments for its sampling requests: drafts
        read from the slot pool, each anchor row's KV position as laid out, and whether the
        rejections of the step in flight move the request's rows back."""
        kept = [i for i, sm in enumerate(batch.samples) if sm]
        anchors = [batch.starts[i] + batch.query_lens[i] - 1 - batch.num_drafts[i] for i in kept]
        shifts = [batch.shifts[i] for i in kept]
        return dict(device_drafts=True, shifts=shifts, anchor_pos=anchors)
