"""Training-time test (TTT): the head unrolled over k chain steps, and its losses.

Notation, for one sequence x_0 .. x_{L-1} (prompt of p tokens, then the target's answer):
h_t is the target's aux hidden state at row t (it has read x_0..x_t), P_t the target's
next-token distribution at row t (the law of x_{t+1}).

Step i = 0 .. k-1, row t:
    input token   x_{t+1+i}                 (the token after the last one the hidden has read)
    input hidden  fc(h_t) for i = 0; the head's own pre-norm output of step i-1 at row t else
    rope position t + i                      (as the engine's chain drafting places it)
    predicts      x_{t+2+i}, trained toward P_{t+1+i}
    attention     step 0's keys at rows <= t (the context) and row t's keys of steps 1..i
                  (its own earlier chain steps): Eagle3Head.forward with past_kv

So row t at step i is exactly the head's i-th chain step at serving time, after the target
emitted x_{t+1}, when the drafts before it were accepted (they equal x_{t+2..t+1+i}). Rows
count when that chain occurs at serving time and the predicted token exists: t + 1 >= p (the
chain starts after the first answer token) and t + 2 + i <= L - 1. (SpecForge trains the
same unroll; its older SDPA path also hid one more step-0 key per step, which serving never
does: we follow its flex-attention mask, which does not.)

Losses per step i, over the rows that count:
    soft cross-entropy   -sum_d P~_{t+1+i}(d) log q(d), P~ = the target's distribution
                         restricted to the draft vocabulary and renormalised; rows whose
                         target argmax is outside the draft vocabulary are skipped (SpecForge)
    acceptance label     y = 1 - 0.5 * ||q - P_{t+1+i}||_1 over the whole target vocabulary
                         (q is 0 outside the draft vocabulary) = sum_v min(q_v, P_v): the
                         chance rejection sampling accepts a draft drawn from q
    confidence BCE       BCE(sigmoid(confidence logit), y), y detached
    loss = sum_i 0.8^i * CE_i + confidence_weight * mean_i BCE_i
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from specserve.train.capture import TargetRows


@dataclass
class TTTBatch:
    """Sequences padded on the right to a common length L."""

    input_ids: torch.Tensor  # [B, L] int64 (0 past a sequence's end)
    aux: torch.Tensor  # [B, L, 3Ht] target aux streams
    draft_logits: torch.Tensor  # [B, L, Vd] fp32 target logits on the draft vocabulary
    logsumexp: torch.Tensor  # [B, L] fp32 target log-normaliser (whole vocabulary)
    greedy: torch.Tensor  # [B, L] int64 target argmax (target ids)
    lens: torch.Tensor  # [B] int64
    prompt_lens: torch.Tensor  # [B] int64

    @classmethod
    def build(
        cls,
        sequences: list[list[int]],
        prompt_lens: list[int],
        rows: TargetRows,
        dtype: torch.dtype,
    ) -> TTTBatch:
        b, length = len(sequences), max(len(s) for s in sequences)
        dev = rows.aux_hidden.device
        parts = rows.split()

        def pad(x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
            out = x.new_full((length, *x.shape[1:]), fill)
            out[: x.shape[0]] = x
            return out

        ids = torch.zeros(b, length, dtype=torch.int64)
        for i, s in enumerate(sequences):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.int64)
        return cls(
            input_ids=ids.to(dev),
            aux=torch.stack([pad(r.aux_hidden) for r in parts]).to(dtype),
            draft_logits=torch.stack([pad(r.draft_logits) for r in parts]),
            logsumexp=torch.stack([pad(r.logsumexp) for r in parts]),
            greedy=torch.stack([pad(r.greedy, -1) for r in parts]),
            lens=torch.tensor([len(s) for s in sequences], dtype=torch.int64, device=dev),
            prompt_lens=torch.tensor(prompt_lens, dtype=torch.int64, device=dev),
        )


def shift(x: torch.Tensor, n: int, fill: float = 0) -> torch.Tensor:
    """x[:, t] <- x[:, t + n] along dim 1, `fill` past the end."""
    if n == 0:
        return x
    out = x.new_full(x.shape, fill)
    out[:, : x.shape[1] - n] = x[:, n:]
    return out


def row_mask(batch: TTTBatch, step: int) -> torch.Tensor:  # [B, L] bool
    """Rows whose step-`step` prediction counts (see the module docstring)."""
    t = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)[None, :]
    return (t + 1 >= batch.prompt_lens[:, None]) & (t + 2 + step <= batch.lens[:, None] - 1)


def acceptance_label(
    q: torch.Tensor,  # [..., Vd] the draft distribution on the draft vocabulary
    p_draft: torch.Tensor,  # [..., Vd] the target's probabilities of the draft tokens
) -> torch.Tensor:  # [...]
    """1 - 0.5 * ||q - p||_1 over the whole target vocabulary: q is 0 off the draft vocabulary,
    where p holds the mass 1 - sum(p_draft)."""
    outside = (1.0 - p_draft.sum(-1)).clamp_min(0.0)
    l1 = (q - p_draft).abs().sum(-1) + outside
    return (1.0 - 0.5 * l1).clamp(0.0, 1.0)


@dataclass
class StepStats:
    rows: int = 0  # rows that count
    ce_rows: int = 0  # ... whose target argmax is in the draft vocabulary
    ce: float = 0.0  # mean soft cross-entropy
    bce: float = 0.0  # mean confidence BCE
    acc: float = 0.0  # share of rows whose draft argmax is the target's argmax
    label: float = 0.0  # mean soft acceptance label


@dataclass
class TTTResult:
    loss: torch.Tensor  # scalar, differentiable
    steps: list[StepStats] = field(default_factory=list)


def ttt_loss(
    head: torch.nn.Module,
    batch: TTTBatch,
    ttt_steps: int,
    step_decay: float = 0.8,
    confidence_weight: float = 1.0,
    window: bool = True,
) -> TTTResult:
    """Unroll the head over `ttt_steps` chain steps on a batch; the weighted loss and stats.

    Only rows from w = (the batch's shortest prompt) - 1 on ever count, so every step after
    step 0 runs on that window alone (step 0 runs on every row: its keys are the context), and
    losses are taken there: the same loss, without the prompt rows' unrolled steps (most of a
    multi-turn batch's rows are prompt). window=False runs every step on every row."""
    b, length = batch.input_ids.shape
    w = max(0, int(batch.prompt_lens.min()) - 1) if window else 0
    base_pos = torch.arange(length, device=batch.input_ids.device)[None, :].expand(b, length)
    in_vocab = head.t2d  # [V] bool
    hidden = batch.aux
    past: list[tuple[torch.Tensor, torch.Tensor]] = []
    ce_terms, bce_terms, stats = [], [], []
    for i in range(ttt_steps):
        mask = row_mask(batch, i)[:, w:]  # [B, L - w]
        ids = shift(batch.input_ids, 1 + i)
        if i == 0:
            out = head(ids, hidden, base_pos)
            past.append(out.kv)
            conf = out.confidence[:, w:] if out.confidence is not None else None
            out = replace(
                out, prenorm=out.prenorm[:, w:], logits=out.logits[:, w:], confidence=conf
            )
        else:
            out = head(ids[:, w:], hidden, base_pos[:, w:] + i, past_kv=past, q_offset=w)
            past.append(out.kv)
        hidden = out.prenorm
        tgt_logits = shift(batch.draft_logits, 1 + i)[:, w:]  # [B, L - w, Vd]
        tgt_lse = shift(batch.logsumexp, 1 + i)[:, w:]
        tgt_greedy = shift(batch.greedy, 1 + i, -1)[:, w:].clamp_min(0)
        logq = out.logits.log_softmax(-1)  # [B, L - w, Vd]
        p_renorm = tgt_logits.softmax(-1)
        ce_mask = mask & in_vocab[tgt_greedy]
        ce_rows = ce_mask.sum()
        ce_row = -(p_renorm * logq).sum(-1)  # [B, L - w]
        ce = (ce_row * ce_mask).sum() / ce_rows.clamp_min(1)
        with torch.no_grad():
            label = acceptance_label(logq.exp(), (tgt_logits - tgt_lse[..., None]).exp())
            draft_target = head.draft_to_target()[out.logits.argmax(-1)]
        rows = mask.sum()
        if out.confidence is not None:
            bce_row = F.binary_cross_entropy_with_logits(out.confidence, label, reduction="none")
            bce = (bce_row * mask).sum() / rows.clamp_min(1)
            bce_terms.append(bce)
        else:
            bce = torch.zeros((), device=ce.device)
        ce_terms.append(step_decay**i * ce)
        n = int(rows)
        stats.append(
            StepStats(
                rows=n,
                ce_rows=int(ce_rows),
                ce=float(ce.detach()),
                bce=float(bce.detach()),
                acc=float(((draft_target == tgt_greedy) & mask).sum()) / max(n, 1),
                label=float((label * mask).sum()) / max(n, 1),
            )
        )
    loss = torch.stack(ce_terms).sum()
    if bce_terms and confidence_weight:
        loss = loss + confidence_weight * torch.stack(bce_terms).mean()
    return TTTResult(loss, stats)
