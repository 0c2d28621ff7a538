"""Repetition, presence and frequency penalties on a batch of sample rows (vLLM/OpenAI semantics).

The caller decides which tokens each row has "seen": under speculation, row j of a request
includes the drafts before it in its output tokens. This module only takes padded matrices.
"""

from __future__ import annotations

import torch

PAD = -1  # padding id in the token matrices


def token_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrences of each token id per row, ignoring PAD.

    tokens [N, L] int64 (ids in [0, vocab_size) or PAD) -> counts [N, V] int32.
    """
    n = tokens.shape[0]
    # Send PAD to an extra dump column V so one scatter_add handles padding with no masking pass.
    idx = torch.where(tokens < 0, vocab_size, tokens).to(torch.int64)  # [N, L]
    counts = torch.zeros(n, vocab_size + 1, dtype=torch.int32, device=tokens.device)  # [N, V+1]
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.int32))
    return counts[:, :vocab_size]  # [N, V]


def token_mask(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Whether each token id occurs in the row, ignoring PAD: [N, L] int64 -> [N, V] bool."""
    n = tokens.shape[0]
    idx = torch.where(tokens < 0, vocab_size, tokens).to(torch.int64)  # [N, L]
    mask = torch.zeros(n, vocab_size + 1, dtype=torch.bool, device=tokens.device)  # [N, V+1]
    mask.scatter_(1, idx, True)
    return mask[:, :vocab_size]  # [N, V]


def apply_penalties(
    logits: torch.Tensor,
    prompt_tokens: torch.Tensor,
    output_tokens: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Penalised logits; the input is not modified.

    logits [N, V] float; prompt_tokens [N, Lp] int64 and output_tokens [N, Lo] int64, padded
    with -1 (Lp or Lo may be 0); presence, frequency, repetition [N] float.

    Order and formulas follow vLLM:
      1. repetition (HF CTRL-style): for a token in prompt OR output, a positive logit is
         divided by the penalty and a negative one multiplied (so > 1 always discourages);
      2. frequency: logit -= frequency * count, count = occurrences in the OUTPUT tokens;
      3. presence: logit -= presence * (count > 0), again output tokens only.
    Rows with neutral values (1, 0, 0) come out unchanged, so a batch may mix them freely.
    """
    _, vocab = logits.shape
    out = logits.to(torch.float32)  # [N, V]; float32 so penalties are not rounded to bf16
    counts = token_counts(output_tokens, vocab)  # [N, V] int32
    in_output = counts > 0  # [N, V] bool
    seen = in_output
    if prompt_tokens.shape[1] > 0:
        seen = in_output | token_mask(prompt_tokens, vocab)

    rep = repetition.to(device=out.device, dtype=torch.float32)[:, None]  # [N, 1]
    rep = torch.where(seen, rep, 1.0)  # [N, V]
    out = torch.where(out > 0, out / rep, out * rep)  # [N, V]

    freq = frequency.to(device=out.device, dtype=torch.float32)[:, None]  # [N, 1]
    pres = presence.to(device=out.device, dtype=torch.float32)[:, None]  # [N, 1]
    return out - freq * counts.to(torch.float32) - pres * in_output.to(torch.float32)  # [N, V]
