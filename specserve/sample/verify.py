"""Verification of a flat step: accept/reject verify rows, prefix acceptance, the sampled token.

Torch reference (vectorised, no loop over rows, no host sync). The GPU fused kernel must match it:
bit-identical for greedy, same random streams for sampling.

`verify` dispatches: CUDA tensors with triton importable and a step the kernel covers
(`specserve.sample.triton_verify.fusable`: no draft-model q, no top-k/top-p/min-p row) run the fused
Triton pass; everything else, and any call with `env.settings.fused_verify` off
($SPECSERVE_FUSED_VERIFY=0) or fused=False, runs `verify_reference`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specserve import env
from specserve.ops import cpu_fused
from specserve.ops.random import hashed_uniform
from specserve.ops.sampling import (
    ACCEPT_SALT,
    SAMPLE_SALT,
    SamplingTensors,
    sample,
    target_probs,
)
from specserve.sample.layout import RowLayout, build_layout


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


def _sample_rows(probs: torch.Tensor, t: SamplingTensors, rows: torch.Tensor) -> torch.Tensor:
    """Exponential race over probs [R, V] with the RNG keys of the given rows."""
    e = -torch.log(hashed_uniform(t.seed[rows], t.counter[rows], SAMPLE_SALT, probs.shape[1]))
    return (probs / e).argmax(dim=-1)


def _fused_allowed(fused: bool | None) -> bool:
    """fused=None defers to `env.settings.fused_verify` (read per call, so tests and benchmarks
    can flip it with `env.override`)."""
    if fused is None:
        return env.settings.fused_verify
    return fused


def verify(
    logits: torch.Tensor,  # [total_q, V] f32, penalties and masks already applied
    draft_token_ids: torch.Tensor,  # [total_q] int64, the draft each verify row checks
    draft_probs: torch.Tensor | None,  # [total_q, V] q at verify rows; None = one-hot (model-free)
    t: SamplingTensors,  # per row
    layout: RowLayout,
    forced: torch.Tensor | None = None,  # [total_q] int64 golden token per row, -1 = none
    *,
    fused: bool | None = None,  # False: always the reference; None: $SPECSERVE_FUSED_VERIFY
) -> VerifyResult:
    """The fused Triton pass where it applies (see the module docstring), else the reference."""
    if logits.is_cuda and _fused_allowed(fused):
        # Imported here: triton_attention's check keeps triton itself unimported until needed.
        from specserve.ops.triton_attention import use_triton

        if use_triton(logits.device):
            from specserve.sample import triton_verify

            if triton_verify.fusable(t, draft_probs):
                return triton_verify.verify_triton(logits, draft_token_ids, t, layout, forced)
    return verify_reference(logits, draft_token_ids, draft_probs, t, layout, forced)


def verify_reference(
    logits: torch.Tensor,  # [total_q, V] f32, penalties and masks already applied
    draft_token_ids: torch.Tensor,  # [total_q] int64, the draft each verify row checks
    draft_probs: torch.Tensor | None,  # [total_q, V] q at verify rows; None = one-hot (model-free)
    t: SamplingTensors,  # per row
    layout: RowLayout,
    forced: torch.Tensor | None = None,  # [total_q] int64 golden token per row, -1 = none
) -> VerifyResult:
    """Torch reference and CPU path.

    forced (teacher forcing): a row with a golden token accepts its draft iff it equals it and,
    as the final row, emits it; rows without one behave as usual."""
    if t.all_greedy:
        target = cpu_fused.argmax(logits)  # [total_q]
        if forced is not None:
            target = torch.where(forced >= 0, forced, target)
        accept = target == draft_token_ids
        accepted, num_accepted = prefix_accept(accept, layout)
        final_rows = layout.ftp + num_accepted
        sampled = target[final_rows]
    elif draft_probs is None:
        # one-hot q (model-free drafter): draw x_r ~ p_r from the row's own output-token stream
        # and accept iff x_r == draft. Lossless (x given x != d is exactly norm(max(p - q, 0)))
        # and a seeded request then emits the very tokens it would emit with speculation off.
        p = target_probs(logits, t)  # [total_q, V]
        x = sample(p, t, SAMPLE_SALT)  # [total_q]
        if forced is not None:
            x = torch.where(forced >= 0, forced, x)
        accepted, num_accepted = prefix_accept(x == draft_token_ids, layout)
        final_rows = layout.ftp + num_accepted
        sampled = x[final_rows]
    else:
        p = target_probs(logits, t)  # [total_q, V]
        # -1: no draft (a device drafter had fewer than the rows laid out); never accepted
        drafted = draft_token_ids.clamp_min(0).unsqueeze(1)
        p_draft = p.gather(1, drafted).squeeze(1)  # [total_q]
        q_draft = draft_probs.gather(1, drafted).squeeze(1)
        u = hashed_uniform(t.seed, t.counter, ACCEPT_SALT, 1).squeeze(1)  # [total_q]
        # accept with probability min(1, p/q): u * q < p (q > 0 for a drafted token)
        accept = (u * q_draft < p_draft) & (draft_token_ids >= 0)
        if forced is not None:
            accept = torch.where(forced >= 0, draft_token_ids == forced, accept)
        accepted, num_accepted = prefix_accept(accept, layout)
        final_rows = layout.ftp + num_accepted
        p_final = p[final_rows]  # [R, V]
        residual = (p_final - draft_probs[final_rows]).clamp_min_(0.0)
        # p == q leaves no residual mass, but then the row was accepted with probability one
        has_mass = residual.sum(dim=1, keepdim=True) > 0
        final_is_verify = layout.is_verify[final_rows].unsqueeze(1)  # rejected -> residual
        probs = torch.where(final_is_verify & has_mass, residual, p_final)
        # sample() needs no normalisation; the final rows' own seeds/counters key the draw
        sampled = _sample_rows(probs, t, final_rows)
        if forced is not None:
            sampled = torch.where(forced[final_rows] >= 0, forced[final_rows], sampled)
    verified = torch.where(accepted, draft_token_ids, torch.full_like(draft_token_ids, -1))
    return VerifyResult(verified.to(torch.int32), sampled, num_accepted, final_rows)


def verify_padded(
    logits: torch.Tensor,  # [Tb, V] f32
    draft_token_ids: torch.Tensor,  # [Tb] int64, the draft each verify row checks
    temperature: torch.Tensor,  # [Tb] float32, 0 = greedy row
    seed: torch.Tensor,  # [Tb] int64
    counter: torch.Tensor,  # [Tb] int64
    seqlens_q: torch.Tensor,  # [Bb] int64: the real requests first, then 0 (padding, no rows)
    ftp: torch.Tensor,  # [Bb] int64
    forced: torch.Tensor | None = None,  # [Tb] int64 golden token per row, -1 = none
) -> VerifyResult:
    """Verification of a CUDA graph bucket (runner/graph_tail.py): fixed shapes whatever the
    step's rows T <= Tb and requests R <= Bb; rows past T belong to no request. Greedy or
    temperature-only rows, one-hot drafts. A padding request accepts nothing; its token is not
    read. The fused Triton pass on CUDA (no host sync: graph-capturable); on the CPU (the fake
    graph backend of the tests and host profiles) verify_reference over the real rows, padded."""
    if logits.is_cuda:
        from specserve.sample import triton_verify

        return triton_verify.verify_padded(
            logits, draft_token_ids, temperature, seed, counter, seqlens_q, ftp, forced
        )
    n, bb = logits.shape[0], seqlens_q.shape[0]
    r, t = int((seqlens_q > 0).sum()), int(seqlens_q.sum())  # CPU: host reads cost nothing
    sq = seqlens_q[:r]
    layout = build_layout(sq, t, int(sq.max()) - 1 if r else 0)
    temp = temperature[:t]
    zeros = torch.zeros(t, dtype=torch.int32)
    greedy = not bool((temp > 0).any())
    st = SamplingTensors(
        temp, zeros, torch.ones(t), zeros.float(), seed[:t], counter[:t],
        all_greedy=greedy, any_greedy=True, any_top_k=False, any_top_p=False, any_min_p=False,
        max_top_k=0,
    )  # fmt: skip
    gold = forced[:t] if forced is not None else None
    res = verify_reference(logits[:t], draft_token_ids[:t], None, st, layout, gold)

    def pad(x: torch.Tensor, size: int, fill: int) -> torch.Tensor:
        return torch.cat([x, x.new_full((size - x.shape[0],), fill)])

    return VerifyResult(
        pad(res.verified_token_ids, n, -1),
        pad(res.sampled_token_ids, bb, 0),
        pad(res.num_accepted, bb, 0),
        pad(res.final_rows, bb, t),
    )
