"""N-gram (prompt lookup) drafting on the device: the same proposals as ngram.py's host index,
from a per-slot token history the step appends its emitted tokens to.

For each request the last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are
compared with every earlier window of n tokens of its history; the most recent window that
matches (ending at e <= len - 1, so the suffix never matches itself) proposes the tokens that
followed it, history[e : e + k], cut at the end of the history. Tensor ops only: O(n_max^2 *
R * L) comparisons per step for R requests whose lengths the host bounds by L, no host
sync.

Confidences are learned on the device too, by the kind of the drafts (the matched length n, as
acceptance.py keys the host drafter's): engine-wide counts per (n, position) of the drafts each
step verified and accepted, read before the step's drafting overwrites them, give the rate of
position j as acceptance.PositionCounts.rate does (PRIOR_WEIGHT pseudo-verifications at
PRIOR_RATE); a request's drafts carry the rates of their kind into the pool.
"""

from __future__ import annotations

import torch

from specserve.engine.slots import DraftSlotPool
from specserve.sample.layout import RowLayout
from specserve.speculative.acceptance import PRIOR_RATE, PRIOR_WEIGHT


class NgramDeviceDrafter:
    def __init__(self, pool: DraftSlotPool, n_min: int, n_max: int, max_model_len: int) -> None:
        self.pool, self.n_min, self.n_max = pool, n_min, n_max
        self.width = max_model_len
        # [slots + 1, L + 1] int64 tokens of each slot's sequence; column L takes the writes of
        # rows that emit nothing (and positions past the end)
        self.history = torch.zeros(
            pool.num_slots + 1, max_model_len + 1, dtype=torch.int64, device=pool.device
        )
        dev, k = pool.device, pool.draft_ids.shape[1]
        self.kind = torch.zeros(pool.num_slots + 1, dtype=torch.int64, device=dev)  # n, 0: none
        # [n_max + 1, k] drafts of each kind verified at position j (reached: the drafts
        # before it accepted) and accepted there
        self.verified = torch.zeros(n_max + 1, k, dtype=torch.float32, device=dev)
        self.accepted = torch.zeros(n_max + 1, k, dtype=torch.float32, device=dev)

    def admit(self, slot: int, tokens: torch.Tensor) -> None:
        """A request starts running in `slot` with these tokens ([n] int64, on the device)."""
        n = min(tokens.shape[0], self.width)
        self.history[slot, :n].copy_(tokens[:n])

    def append(
        self,
        slots: torch.Tensor,  # [R] int64
        layout: RowLayout,
        verified: torch.Tensor,  # [total_q] int32, -1 after the accepted prefix
        sampled: torch.Tensor,  # [R] int64
        num_accepted: torch.Tensor,  # [R] int64
        seq_len: torch.Tensor,  # [R] int64, lengths after this step
    ) -> None:
        """Write each request's emitted tokens (accepted drafts, then the sampled token) at
        their positions: row j of a request emits at seq_len - accepted - 1 + j, j <= accepted."""
        req, j = layout.row_to_req, layout.local_step
        acc = num_accepted[req]
        tok = torch.where(j < acc, verified.to(torch.int64), sampled[req])
        pos = seq_len[req] - acc - 1 + j
        dump = torch.full_like(pos, self.width)
        pos = torch.where((j <= acc) & (pos >= 0) & (pos < self.width), pos, dump)
        flat = slots[req] * (self.width + 1) + pos
        self.history.view(-1).scatter_(0, flat, tok)

    def learn(
        self,
        slots: torch.Tensor,  # [R] int64
        seqlens_q: torch.Tensor,  # [R] the step's rows per request
        num_accepted: torch.Tensor,  # [R] int64
    ) -> None:
        """Count the drafts the step verified (still in the pool: call before draft), by kind."""
        drafts = self.pool.draft_ids[slots]  # [R, k]
        real = torch.minimum((drafts >= 0).sum(1), seqlens_q.to(torch.int64) - 1)  # [R]
        j = torch.arange(drafts.shape[1], device=drafts.device)
        reached = j < torch.minimum(real, num_accepted + 1).unsqueeze(1)  # [R, k]
        taken = j < torch.minimum(real, num_accepted).unsqueeze(1)
        kind = self.kind[slots]
        self.verified.index_add_(0, kind, reached.to(torch.float32))
        self.accepted.index_add_(0, kind, taken.to(torch.float32))

    def rates(self) -> torch.Tensor:
        """[n_max + 1, k] the confidence of position j of a draft of kind n."""
        return (self.accepted + PRIOR_WEIGHT * PRIOR_RATE) / (self.verified + PRIOR_WEIGHT)

    def draft(self, slots: torch.Tensor, seq_len: torch.Tensor, bound: int) -> None:
        """Drafts of every request of the step into its pool slot (-1 where none), with the
        confidences of their kind; bound: a host bound on the lengths (only that much of the
        history is scanned)."""
        pool, width = self.pool, max(1, min(bound, self.width))
        k = pool.draft_ids.shape[1]
        hist = self.history[slots, :width]  # [R, L]
        lens = seq_len.clamp(max=width)
        r = hist.shape[0]
        ends = torch.arange(width, device=hist.device).expand(r, width)  # [R, L]
        pad = torch.full((r, self.n_max), -2, dtype=hist.dtype, device=hist.device)
        padded = torch.cat([pad, hist], dim=1)  # column c of hist at c + n_max
        start = torch.full_like(lens, -1)
        kind = torch.zeros_like(lens)
        for n in range(self.n_max, self.n_min - 1, -1):
            at = (lens - n).clamp_min(0).unsqueeze(1) + torch.arange(n, device=hist.device)
            suffix = hist.gather(1, at.clamp(max=width - 1))  # [R, n] the last n tokens
            match = (ends >= n) & (ends <= (lens - 1).unsqueeze(1)) & (lens >= n).unsqueeze(1)
            for i in range(n):  # window ending at e holds hist[e - n + i] at i
                lo = self.n_max - n + i
                match &= padded[:, lo : lo + width] == suffix[:, i : i + 1]
            best = torch.where(match, ends, torch.full_like(ends, -1)).amax(dim=1)  # [R]
            kind = torch.where((start < 0) & (best >= 0), n, kind)
            start = torch.where(start < 0, best, start)
        offs = start.unsqueeze(1) + torch.arange(k, device=hist.device)  # [R, k]
        ok = (start >= 0).unsqueeze(1) & (offs < lens.unsqueeze(1))
        drafts = hist.gather(1, offs.clamp(0, width - 1))
        drafts = torch.where(ok, drafts, torch.full_like(drafts, -1))
        pool.draft_ids.index_copy_(0, slots, drafts)
        conf = self.rates()[kind]  # [R, k]
        pool.draft_conf.index_copy_(0, slots, torch.where(ok, conf, 0.0))
        self.kind.index_copy_(0, slots, kind)
