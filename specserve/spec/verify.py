"""Verification of a flat step: accept/reject verify rows, prefix acceptance, the sampled token.

Torch reference (vectorised, no loop over rows, no host sync). The GPU fused kernel must match it:
bit-identical for greedy, same random streams for sampling.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specserve.ops.random import hashed_uniform
from specserve.ops.sampling import ACCEPT_SALT, SAMPLE_SALT, SamplingTensors, target_probs
from specserve.spec.layout import RowLayout


class VerifyResult(NamedTuple):
    verified_token_ids: torch.Tensor  # [total_q] int32: accepted drafts, -1 everywhere else
    sampled_token_ids: torch.Tensor  # [R] int64, drawn at each request's final row
    num_accepted: torch.Tensor  # [R] int64 = last_valid_offset (local step of the final row)
    final_rows: torch.Tensor  # [R] int64, ftp + num_accepted


def prefix_accept(accept: torch.Tensor, layout: RowLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix acceptance with one global cumsum.

    blocked = ~(is_verify & accept); a row is alive when no row of its request before it is
    blocked. The final row (alive & blocked) is the first blocked row: the correction or bonus.
    Returns (alive_accepted [total_q] bool, num_accepted [R] int64).
    """
    blocked = ~(layout.is_verify & accept)
    csum = torch.cumsum(blocked.to(torch.int32), 0)
    blocked_before = csum - blocked.to(torch.int32)  # blocked rows strictly before r
    alive = blocked_before == blocked_before[layout.ftp][layout.row_to_req]
    accepted = alive & ~blocked
    num_accepted = torch.zeros_like(layout.seqlens_q).scatter_add_(
        0, layout.row_to_req, accepted.to(layout.seqlens_q.dtype)
    )
    return accepted, num_accepted


def verify(
    logits: torch.Tensor,  # [total_q, V] f32, penalties and masks already applied
    draft_token_ids: torch.Tensor,  # [total_q] int64, the draft each verify row checks
    draft_probs: torch.Tensor | None,  # [total_q, V] q at verify rows; None = one-hot (model-free)
    t: SamplingTensors,  # per row
    layout: RowLayout,
) -> VerifyResult:
    if t.all_greedy:
        target = logits.argmax(dim=-1)  # [total_q]
        accept = target == draft_token_ids
        accepted, num_accepted = prefix_accept(accept, layout)
        final_rows = layout.ftp + num_accepted
        sampled = target[final_rows]
    else:
        p = target_probs(logits, t)  # [total_q, V]; greedy rows are one-hot at the argmax
        p_draft = p.gather(1, draft_token_ids.unsqueeze(1)).squeeze(1)  # [total_q]
        if draft_probs is None:
            q_draft = torch.ones_like(p_draft)
        else:
            q_draft = draft_probs.gather(1, draft_token_ids.unsqueeze(1)).squeeze(1)
        u = hashed_uniform(t.seed, t.counter, ACCEPT_SALT, 1).squeeze(1)  # [total_q]
        # accept with probability min(1, p/q): u * q < p (q > 0 for a drafted token)
        accept = u * q_draft < p_draft
        accepted, num_accepted = prefix_accept(accept, layout)
        final_rows = layout.ftp + num_accepted
        p_final = p[final_rows]  # [R, V]
        final_is_verify = layout.is_verify[final_rows]  # rejected verify row -> residual
        if draft_probs is None:
            q_final = torch.zeros_like(p_final)
            q_final.scatter_(1, draft_token_ids[final_rows].unsqueeze(1), 1.0)
        else:
            q_final = draft_probs[final_rows]
        residual = (p_final - q_final).clamp_min_(0.0)
        mass = residual.sum(dim=1, keepdim=True)
        # p == q leaves no residual mass, but then the row was accepted with probability one
        residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_final)
        probs = torch.where(final_is_verify.unsqueeze(1), residual, p_final)
        # exponential race: argmax p / E, E = -log u; zero-probability tokens never win
        e = -torch.log(hashed_uniform(t.seed[final_rows], t.counter[final_rows], SAMPLE_SALT, probs.shape[1]))
        sampled = (probs / e).argmax(dim=-1)
    verified = torch.where(accepted, draft_token_ids, torch.full_like(draft_token_ids, -1))
    return VerifyResult(verified.to(torch.int32), sampled, num_accepted, final_rows)
