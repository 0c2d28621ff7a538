"""From a step's logits to the verifier's host result: per-row sampling tensors, penalties
(drafts before each verify row count as output tokens), min_tokens masking, verification and
logprobs."""

from __future__ import annotations

import torch

from specserve.engine.ledger import HostStepResult
from specserve.engine.sequence import Sequence
from specserve.ops.logprobs import compute_logprobs
from specserve.ops.penalties import apply_penalties
from specserve.ops.sampling import SamplingTensors
from specserve.spec.layout import RowLayout, build_layout
from specserve.spec.verify import VerifyResult, verify


def _padded(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(1, max((len(r) for r in rows), default=1))
    out = torch.full((len(rows), width), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return out.to(device)


class StepSampler:
    def __init__(self, device: torch.device, eos_ids: frozenset[int]) -> None:
        self.device = device
        self.eos_ids = sorted(eos_ids)

    def layout(self, seqlens_q: list[int]) -> RowLayout:
        t = torch.tensor(seqlens_q, dtype=torch.int64, device=self.device)
        return build_layout(t, sum(seqlens_q), max(seqlens_q) - 1)

    def run(
        self,
        logits: torch.Tensor,  # [total_q, V] raw target logits of the verify layout's rows
        seqs: list[Sequence],  # sampling requests, in layout order
        drafts: list[list[int]],
        draft_probs: torch.Tensor | None = None,  # [total_q, V]
    ) -> tuple[VerifyResult, HostStepResult]:
        seqlens_q = [1 + len(d) for d in drafts]
        layout = self.layout(seqlens_q)
        row_params, row_seeds, row_counters = [], [], []
        draft_rows: list[int] = []
        for seq, d in zip(seqs, drafts):
            n_out = seq.num_output_tokens
            for j in range(len(d) + 1):
                row_params.append(seq.params)
                row_seeds.append(seq.seed)
                row_counters.append(n_out + j)
            draft_rows.extend(d)
            draft_rows.append(0)  # the last row verifies nothing
        t = SamplingTensors.build(row_params, row_seeds, row_counters, self.device)
        draft_ids = torch.tensor(draft_rows, dtype=torch.int64, device=self.device)

        proc = logits
        if any(s.params.has_penalties for s in seqs):
            proc = self._penalize(proc, seqs, drafts)
        proc = self._mask_min_tokens(proc, seqs, drafts)
        result = verify(proc, draft_ids, draft_probs, t, layout, self._forced(seqs, drafts))

        verified = result.verified_token_ids.tolist()
        sampled = result.sampled_token_ids.tolist()
        accepted = result.num_accepted.tolist()
        lp = ranks = top_ids = top_lps = None
        want = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        if want:
            emitted = torch.where(
                result.verified_token_ids >= 0,
                result.verified_token_ids.to(torch.int64),
                result.sampled_token_ids[layout.row_to_req],
            )
            lr = compute_logprobs(logits, emitted, max(want))
            lp, ranks = lr.token_logprob.tolist(), lr.token_rank.tolist()
            top_ids, top_lps = lr.top_ids.tolist(), lr.top_logprobs.tolist()
        host = HostStepResult(verified, sampled, accepted, lp, ranks, top_ids, top_lps)
        return result, host

    def _forced(self, seqs: list[Sequence], drafts: list[list[int]]) -> torch.Tensor | None:
        """[total_q] golden token of each row (teacher forcing), -1 where a request has none."""
        if all(s.params.golden_token_ids is None for s in seqs):
            return None
        rows: list[int] = []
        for seq, d in zip(seqs, drafts):
            gold = seq.params.golden_token_ids or []
            n = seq.num_output_tokens
            rows.extend(gold[n + j] if n + j < len(gold) else -1 for j in range(len(d) + 1))
        return torch.tensor(rows, dtype=torch.int64, device=self.device)

    def _penalize(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]
    ) -> torch.Tensor:
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
            return torch.tensor(x, dtype=torch.float32, device=self.device)

        return apply_penalties(
            logits,
            _padded(prompt_rows, self.device),
            _padded(output_rows, self.device),
            f32(pres),
            f32(freq),
            f32(rep),
        )

    def _mask_min_tokens(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]
    ) -> torch.Tensor:
        """Rows that would produce an output token before min_tokens can't pick EOS/stop ids."""
        rows: list[int] = []
        cols: list[int] = []
        row = 0
        for seq, d in zip(seqs, drafts):
            p = seq.params
            n_out = seq.num_output_tokens
            if p.min_tokens > n_out:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_ids)
                for j in range(min(len(d) + 1, p.min_tokens - n_out)):
                    rows.extend([row + j] * len(banned))
                    cols.extend(banned)
            row += len(d) + 1
        if not rows:
            return logits
        logits = logits.clone()
        logits[torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device)] = (
            float("-inf")
        )
        return logits
