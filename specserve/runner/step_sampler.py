"""From a step's logits to the verifier's host result: per-row sampling tensors, logit bias /
allowed ids / bad words and penalties (drafts before each verify row count as output tokens),
min_tokens masking, verification and logprobs."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from specserve.engine.ledger import HostStepResult
from specserve.engine.sequence import Sequence
from specserve.ops.logits_processing import LogitsProcessing, apply_logits_processing
from specserve.ops.logprobs import LogprobsResult, compute_logprobs
from specserve.ops.penalties import apply_penalties
from specserve.ops.sampling import SamplingTensors
from specserve.ops.transfer import Readback, h2d
from specserve.runner.logits_plan import plan_logits_processing
from specserve.sample.layout import RowLayout, build_layout
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


class SampledStep:
    """A step's verification launched on the device, its results on their way to the host.
    `wait()` is the step's one designed synchronisation point."""

    def __init__(
        self,
        result: VerifyResult,
        logprobs: LogprobsResult | None,
        draft_confidences: list[list[float]] | None = None,
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
        parts = [ints]
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
            if len(host) > 1:
                lp, ranks, top_ids, top_lps = (x.tolist() for x in host[1:])
            self._host = HostStepResult(
                ints[:t],
                ints[t : t + r],
                ints[t + r :],
                lp,
                ranks,
                top_ids,
                top_lps,
                self.draft_confidences,
            )
        return self._host


class StepSampler:
    def __init__(self, device: torch.device, eos_ids: frozenset[int], vocab_size: int) -> None:
        self.device = device
        self.eos_ids = sorted(eos_ids)
        self.vocab_size = vocab_size

    def layout(self, seqlens_q: list[int]) -> RowLayout:
        t = h2d(seqlens_q, torch.int64, self.device)
        return build_layout(t, sum(seqlens_q), max(seqlens_q) - 1)

    def plan(self, seqs: list[Sequence], drafts: list[list[int]]) -> SamplerPlan:
        """Everything the verification needs from the host, read from the requests now (so the
        device part may run later, e.g. in a worker thread, while the ledger moves on). A
        request's output index counts its pending tokens (overlap scheduling: the step in flight
        appends them), so RNG counters, min_tokens and golden tokens see the right position."""
        seqlens_q = [1 + len(d) for d in drafts]
        row_params, row_seeds, row_counters = [], [], []
        draft_rows: list[int] = []
        for seq, d in zip(seqs, drafts):
            n_out = seq.num_output_tokens + seq.num_pending
            for j in range(len(d) + 1):
                row_params.append(seq.params)
                row_seeds.append(seq.seed)
                row_counters.append(n_out + j)
            draft_rows.extend(d)
            draft_rows.append(0)  # the last row verifies nothing
        penalties = None
        if any(s.params.has_penalties for s in seqs):
            assert not any(s.num_pending for s in seqs), "penalties need every output token"
            penalties = self._penalty_inputs(seqs, drafts)
        want = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        return SamplerPlan(
            self.layout(seqlens_q),
            SamplingTensors.build(row_params, row_seeds, row_counters, self.device),
            h2d(draft_rows, torch.int64, self.device),
            penalties,
            self._min_tokens_mask(seqs, drafts),
            self._forced(seqs, drafts),
            h2d([s.slot for s in seqs], torch.int64, self.device),
            max(want) if want else None,
            plan_logits_processing(seqs, drafts, self.device),
        )

    def execute(
        self,
        plan: SamplerPlan,
        logits: torch.Tensor,  # [total_q, V]
        draft_probs: torch.Tensor | None = None,  # [total_q, V]
        next_tokens: torch.Tensor | None = None,  # [slots] int64
    ) -> SampledStep:
        """The device part: logit bias / allowed ids / bad words, penalties, min_tokens mask,
        verification, next_tokens, logprobs (of the raw logits)."""
        proc = logits
        if plan.processing is not None:
            proc = apply_logits_processing(proc, plan.processing)
        if plan.penalties is not None:
            proc = apply_penalties(proc, *plan.penalties)
        if plan.min_tokens_mask is not None:
            rows, cols = plan.min_tokens_mask
            # index_fill_ on flat indices: advanced-index assignment (logits[rows, cols] = x)
            # syncs on CUDA, which the sync guard test caught
            flat = rows * proc.shape[1] + cols
            proc = proc.clone().view(-1).index_fill_(0, flat, float("-inf")).view(proc.shape)
        layout = plan.layout
        result = verify(proc, plan.draft_ids, draft_probs, plan.t, layout, plan.forced)
        if next_tokens is not None:
            next_tokens.index_copy_(0, plan.slots, result.sampled_token_ids)
        lr = None
        if plan.num_logprobs is not None:
            emitted = torch.where(
                result.verified_token_ids >= 0,
                result.verified_token_ids.to(torch.int64),
                result.sampled_token_ids[layout.row_to_req],
            )
            lr = compute_logprobs(logits, emitted, plan.num_logprobs)
        return SampledStep(result, lr)

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
        self, seqs: list[Sequence], drafts: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, cols) the mask sets to -inf: rows that would produce an output token before
        min_tokens can't pick EOS/stop ids."""
        rows: list[int] = []
        cols: list[int] = []
        row = 0
        for seq, d in zip(seqs, drafts):
            p = seq.params
            n_out = seq.num_output_tokens + seq.num_pending
            if p.min_tokens > n_out:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_ids)
                if any(not 0 <= t < self.vocab_size for t in banned):
                    # a flat index past the row would mask a token of the next request's row
                    raise IndexError(f"{seq.request_id}: stop_token_ids outside the vocabulary")
                for j in range(min(len(d) + 1, p.min_tokens - n_out)):
                    rows.extend([row + j] * len(banned))
                    cols.extend(banned)
            row += len(d) + 1
        if not rows:
            return None
        return h2d(rows, torch.int64, self.device), h2d(cols, torch.int64, self.device)
