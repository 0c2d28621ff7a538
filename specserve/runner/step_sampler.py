"""From a step's logits to the verifier's host result: per-row sampling tensors, logit bias /
allowed ids / bad words and penalties (drafts before each verify row count as output tokens),
min_tokens masking, verification and logprobs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from specserve.engine.ledger import HostStepResult
from specserve.engine.sequence import Sequence
from specserve.engine.slots import DraftSlotPool
from specserve.ops.logits_processing import LogitsProcessing, apply_logits_processing
from specserve.ops.logprobs import LogprobsResult, compute_logprobs
from specserve.ops.penalties import apply_penalties
from specserve.ops.sampling import SamplingTensors
from specserve.ops.transfer import Readback, h2d, h2d_packed
from specserve.runner.device_feed import DraftFeed, drafted_and_advance, feed_verify_rows
from specserve.runner.logits_plan import plan_logits_processing
from specserve.runner.sampler_inputs import (
    GOLDEN,
    LOGPROBS,
    MIN_TOKENS,
    PENALTIES,
    PROCESSING,
    build_inputs,
)
from specserve.sample.layout import RowLayout
from specserve.sample.verify import VerifyResult, verify


def _padded(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(1, max((len(r) for r in rows), default=1))
    out = np.full((len(rows), width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return h2d(out, torch.int64, device)


class PenaltyInputs(NamedTuple):
    prompt_ids: torch.Tensor  # [rows, P] int64, -1 padded
    output_ids: torch.Tensor  # [rows, O] int64, -1 padded (output tokens + drafts before the row)
    presence: torch.Tensor  # [rows] float32
    frequency: torch.Tensor  # [rows] float32
    repetition: torch.Tensor  # [rows] float32


class SamplerPlan(NamedTuple):
    """The host's half of a step's verification, built from the requests at launch."""

    layout: RowLayout
    t: SamplingTensors  # per row
    draft_ids: torch.Tensor  # [total_q] int64, the draft each verify row checks (0 elsewhere)
    penalties: PenaltyInputs | None
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None  # (rows, cols) to mask, int64
    forced: torch.Tensor | None  # [total_q] int64 golden tokens, -1 = none
    slots: torch.Tensor  # [R] int64, each request's slot (for next_tokens)
    num_logprobs: int | None  # top-N to compute, None = no request wants logprobs
    processing: LogitsProcessing | None = None  # logit_bias / allowed_token_ids / bad_words
    feed: DraftFeed | None = None  # device drafts / positions (None: the host knows them all)
    # [pairs] int64: the min_tokens of each (row, col) of min_tokens_mask, when the step's
    # output indices are upper bounds (feed): the device masks only rows still below it
    min_tokens_limit: torch.Tensor | None = None
    golden: bool = False  # some request has golden tokens (read from the device table: feed)
    seqlens_q: list[int] | None = None  # host copy of the layout's rows per request


class SampledStep:
    """A step's verification launched on the device, its results on their way to the host.
    `wait()` is the step's one designed synchronisation point."""

    def __init__(
        self,
        result: VerifyResult,
        logprobs: LogprobsResult | None,
        draft_confidences: list[list[float]] | None = None,
        drafted: tuple[torch.Tensor, torch.Tensor] | None = None,
        seqlens_q: list[int] | None = None,  # with drafted: the step's rows per request
        next_conf: torch.Tensor | None = None,  # [R, k] float32, with drafted
    ) -> None:
        self.result = result
        self.total_q = result.verified_token_ids.shape[0]
        self.num_reqs = result.sampled_token_ids.shape[0]
        self.draft_confidences = draft_confidences
        # one int64 vector (verified | sampled | accepted) + the logprob tensors: few copies
        ints = torch.cat(
            [
                result.verified_token_ids.to(torch.int64),
                result.sampled_token_ids,
                result.num_accepted,
            ]
        )
        # drafted: ([R] int64 drafts each request really verified, [total_q] float32 confidence
        # of the draft at each verify row), for a step of device drafts; next_conf: the
        # confidences of the drafts it wrote for each request's next step (the verify budget)
        self.has_drafted = drafted is not None
        self.seqlens_q = seqlens_q
        if drafted is not None:
            ints = torch.cat([ints, drafted[0]])
        parts = [ints]
        if drafted is not None:
            nc = next_conf.reshape(-1) if next_conf is not None else drafted[1][:0]
            parts.append(torch.cat([drafted[1], nc]))
        if logprobs is not None:
            lp = logprobs
            parts += [lp.token_logprob, lp.token_rank, lp.top_ids, lp.top_logprobs]
        self._readback = Readback(parts)
        self._host: HostStepResult | None = None

    def wait(self) -> HostStepResult:
        if self._host is None:
            host = self._readback.wait()
            ints = host[0].tolist()
            t, r = self.total_q, self.num_reqs
            lp = ranks = top_ids = top_lps = None
            confs, real, nxt = self.draft_confidences, None, None
            rest = host[1:]
            if self.has_drafted:
                real = ints[t + 2 * r :]
                per_row = rest[0][:t].tolist()
                if rest[0].shape[0] > t:
                    nxt = rest[0][t:].reshape(r, -1).tolist()
                confs, at = [], 0
                for n, rows in zip(real, self.seqlens_q):  # a request's real drafts come first
                    confs.append(per_row[at : at + n])
                    at += rows
                rest = rest[1:]
            if rest:
                lp, ranks, top_ids, top_lps = (x.tolist() for x in rest)
            self._host = HostStepResult(
                ints[:t],
                ints[t : t + r],
                ints[t + r : t + 2 * r],
                lp,
                ranks,
                top_ids,
                top_lps,
                confs,
                real,
                nxt,
            )
        return self._host


class StepSampler:
    def __init__(
        self,
        device: torch.device,
        eos_ids: frozenset[int],
        vocab_size: int,
        pool: DraftSlotPool | None = None,
    ) -> None:
        self.pool = pool  # device drafters' drafts and per-slot state
        self.device = device
        self.eos_ids = sorted(eos_ids)
        self.vocab_size = vocab_size

    def plan(
        self,
        seqs: list[Sequence],
        drafts: list[list[int]],
        device_drafts: bool = False,
        shifts: list[bool] | None = None,
        anchor_pos: list[int] | None = None,
        deferred: bool = False,
    ) -> SamplerPlan:
        """Everything the verification needs from the host, read from the requests now (so the
        device part may run later, e.g. in a worker thread, while the ledger moves on). A
        request's output index counts its pending tokens (overlap scheduling: the step in flight
        appends them), so RNG counters, min_tokens and golden tokens see the right position.

        With a device drafter (device_drafts) drafts[i] are placeholders for the slot pool's,
        and a request with shifts[i] has drafts in flight: its output index counts them as
        accepted, and the device takes off the ones its step rejected (DraftFeed). anchor_pos:
        the KV position of each request's anchor row as laid out (device drafters only).
        deferred: leave out the host-token half (complete() adds it after the ledger)."""
        inp = build_inputs(seqs, drafts, self.device)
        needs = inp.needs  # a scan below runs only when some request needs it
        processing = penalties = None
        if not deferred and needs & (PENALTIES | PROCESSING):
            processing, penalties = self._host_tokens(seqs, drafts)
        want = (
            [s.params.logprobs for s in seqs if s.params.logprobs is not None]
            if needs & LOGPROBS
            else None
        )
        feed = None
        shifted = shifts is not None and any(shifts)
        if device_drafts:
            feed = self._feed(seqs, drafts, shifts or [False] * len(seqs), anchor_pos)
        golden = shifted and bool(needs & GOLDEN)
        mask = limit = None
        if needs & MIN_TOKENS:
            mask, limit = self._min_tokens_mask(seqs, drafts, bounded=shifted)
        forced = None if golden or not needs & GOLDEN else self._forced(seqs, drafts)
        return SamplerPlan(
            inp.layout,
            inp.t,
            inp.draft_ids,
            penalties,
            mask,
            forced,
            inp.slots,
            max(want) if want else None,
            processing,
            feed,
            limit,
            golden,
            inp.seqlens_q,
        )

    def complete(
        self, plan: SamplerPlan, seqs: list[Sequence], drafts: list[list[int]]
    ) -> SamplerPlan:
        """A deferred plan's host-token half, built once the ledger has appended every token
        before the step's rows (overlap: the step in flight read back)."""
        processing, penalties = self._host_tokens(seqs, drafts)
        return plan._replace(processing=processing, penalties=penalties)

    def _host_tokens(
        self, seqs: list[Sequence], drafts: list[list[int]]
    ) -> tuple[LogitsProcessing | None, PenaltyInputs | None]:
        """What reads the requests' output tokens on the host: logits processing (grammar
        bitmasks, bad words; logit bias and allowed ids come along) and penalty inputs."""
        penalties = None
        if any(s.params.has_penalties for s in seqs):
            assert not any(s.num_pending for s in seqs), "penalties need every output token"
            penalties = self._penalty_inputs(seqs, drafts)
        return plan_logits_processing(seqs, drafts, self.device), penalties

    def _feed(
        self,
        seqs: list[Sequence],
        drafts: list[list[int]],
        shifts: list[bool],
        anchor_pos: list[int] | None,
    ) -> DraftFeed:
        k = self.pool.k if self.pool is not None else 0
        at: list[int] = []
        row_shift: list[int] = []
        for seq, d, sh in zip(seqs, drafts, shifts):
            at.extend(seq.slot * k + j + 1 for j in range(len(d)))
            at.append(0)
            row_shift.extend([seq.slot if sh else 0] * (len(d) + 1))
        req_shift = [s.slot if sh else 0 for s, sh in zip(seqs, shifts)]

        i64 = torch.int64
        arrays = [(at, i64), (row_shift, i64), (req_shift, i64), (anchor_pos or [], i64)]
        return DraftFeed(*h2d_packed(arrays, self.device))

    def execute(
        self,
        plan: SamplerPlan,
        logits: torch.Tensor,  # [total_q, V]
        draft_probs: torch.Tensor | None = None,  # [total_q, V]
        next_tokens: torch.Tensor | None = None,  # [slots] int64
        after_verify: Callable[[SamplerPlan, VerifyResult, torch.Tensor], None] | None = None,
    ) -> SampledStep:
        """The device part: logit bias / allowed ids / bad words, penalties, min_tokens mask,
        verification, next_tokens, logprobs (of the raw logits). With a DraftFeed: the drafts
        read from the slot pool, output indices corrected by the step in flight's rejections,
        then the pool's per-slot state advanced and after_verify(plan, result, seq_len [R])
        called (the device drafter drafts the next step there)."""
        layout = plan.layout
        t, draft_ids, forced, feed = plan.t, plan.draft_ids, plan.forced, plan.feed
        if feed is not None:
            pool = self.pool
            golden = (layout.row_to_req, plan.slots) if plan.golden else None
            counter, draft_ids, fed = feed_verify_rows(t.counter, draft_ids, feed, pool, golden)
            t = dataclasses.replace(t, counter=counter)
            forced = fed if plan.golden else forced
            if pool.q is not None and draft_probs is None and not t.all_greedy:
                # q of each verify row's draft (EAGLE-3): 0 where it has none, so a row that
                # checks -1 resamples from p itself (greedy rows never read q: a draft is
                # accepted iff it is the argmax)
                has = (feed.draft_at > 0) & (draft_ids >= 0)
                q = pool.q[(feed.draft_at - 1).clamp_min(0)]
                draft_probs = torch.where(has.unsqueeze(1), q, torch.zeros_like(q))
        proc = logits
        if plan.processing is not None:
            proc = apply_logits_processing(proc, plan.processing)
        if plan.penalties is not None:
            proc = apply_penalties(proc, *plan.penalties)
        if plan.min_tokens_mask is not None:
            rows, cols = plan.min_tokens_mask
            # scatter on flat indices: advanced-index assignment (logits[rows, cols] = x)
            # syncs on CUDA, which the sync guard test caught
            flat = rows * proc.shape[1] + cols
            proc = proc.clone().view(-1)
            if plan.min_tokens_limit is None:
                proc.index_fill_(0, flat, float("-inf"))
            else:  # rows laid out from a lower bound: mask those still below min_tokens
                below = t.counter[rows] < plan.min_tokens_limit
                vals = torch.where(below, torch.full_like(proc[flat], float("-inf")), proc[flat])
                proc.scatter_(0, flat, vals)
            proc = proc.view(logits.shape)
        result = verify(proc, draft_ids, draft_probs, t, layout, forced)
        if next_tokens is not None:
            next_tokens.index_copy_(0, plan.slots, result.sampled_token_ids)
        drafted = next_conf = None
        if feed is not None:
            count, conf, seq_len = drafted_and_advance(
                layout, plan.slots, result.num_accepted, draft_ids, feed, pool
            )
            drafted = (count, conf)
            if after_verify is not None:
                after_verify(plan, result, seq_len)
                next_conf = pool.draft_conf[plan.slots]  # what the budget sizes the next step by
        lr = None
        if plan.num_logprobs is not None:
            emitted = torch.where(
                result.verified_token_ids >= 0,
                result.verified_token_ids.to(torch.int64),
                result.sampled_token_ids[layout.row_to_req],
            )
            lr = compute_logprobs(logits, emitted, plan.num_logprobs)
        seqlens = None if feed is None else plan.seqlens_q
        return SampledStep(result, lr, drafted=drafted, seqlens_q=seqlens, next_conf=next_conf)

    def _forced(self, seqs: list[Sequence], drafts: list[list[int]]) -> torch.Tensor | None:
        """[total_q] golden token of each row (teacher forcing), -1 where a request has none."""
        if all(s.params.golden_token_ids is None for s in seqs):
            return None
        rows: list[int] = []
        for seq, d in zip(seqs, drafts):
            gold = seq.params.golden_token_ids or []
            n = seq.num_output_tokens + seq.num_pending
            rows.extend(gold[n + j] if n + j < len(gold) else -1 for j in range(len(d) + 1))
        return h2d(rows, torch.int64, self.device)

    def _penalty_inputs(self, seqs: list[Sequence], drafts: list[list[int]]) -> PenaltyInputs:
        prompt_rows, output_rows = [], []
        pres, freq, rep = [], [], []
        for seq, d in zip(seqs, drafts):
            out = seq.output_token_ids
            p = seq.params
            for j in range(len(d) + 1):
                prompt_rows.append(seq.prompt_token_ids)
                output_rows.append(out + d[:j])  # the drafts before this verify row
                pres.append(p.presence_penalty)
                freq.append(p.frequency_penalty)
                rep.append(p.repetition_penalty)

        def f32(x: list[float]) -> torch.Tensor:
            return h2d(x, torch.float32, self.device)

        return PenaltyInputs(
            _padded(prompt_rows, self.device),
            _padded(output_rows, self.device),
            f32(pres),
            f32(freq),
            f32(rep),
        )

    def _min_tokens_mask(
        self, seqs: list[Sequence], drafts: list[list[int]], bounded: bool = False
    ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]:
        """((rows, cols) the mask sets to -inf, limits): rows that would produce an output token
        before min_tokens can't pick EOS/stop ids. bounded: output indices are known only from
        below (drafts in flight); the rows are those of the lower bound and limits[pair] the
        min_tokens each (row, col) is masked under (execute checks the true index)."""
        rows: list[int] = []
        cols: list[int] = []
        limits: list[int] = []
        row = 0
        for seq, d in zip(seqs, drafts):
            p = seq.params
            n_out = seq.num_output_tokens + seq.num_pending  # exact without drafts in flight
            if p.min_tokens > n_out:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_ids)
                if any(not 0 <= t < self.vocab_size for t in banned):
                    # a flat index past the row would mask a token of the next request's row
                    raise IndexError(f"{seq.request_id}: stop_token_ids outside the vocabulary")
                for j in range(min(len(d) + 1, p.min_tokens - n_out)):
                    rows.extend([row + j] * len(banned))
                    cols.extend(banned)
                    limits.extend([p.min_tokens] * len(banned))
            row += len(d) + 1
        if not rows:
            return None, None
        mask = h2d(rows, torch.int64, self.device), h2d(cols, torch.int64, self.device)
        return mask, h2d(limits, torch.int64, self.device) if bounded else None
