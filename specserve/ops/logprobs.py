"""Log-probabilities of chosen tokens and the top alternatives, batched over sample rows.

Computed from the RAW model logits (before temperature, penalties or filters): vLLM's default
"raw_logprobs" mode, which is what OpenAI-style clients expect. Values may be -inf here; the
output boundary clamps them to -9999.0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogprobsResult:
    token_logprob: torch.Tensor  # [N] float32, log p(token_ids[r])
    token_rank: torch.Tensor  # [N] int64, 1 = most likely (1 + #tokens strictly more likely)
    top_ids: torch.Tensor  # [N, num_top] int64, most likely first
    top_logprobs: torch.Tensor  # [N, num_top] float32, matching top_ids


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsResult:
    """logits [N, V] raw model logits; token_ids [N] int64 in [0, V); num_top >= 0 (clamped to V).

    Ties: a token tied with others gets the best rank among them (rank counts strictly larger
    logprobs), and tied entries in the top list come in torch.topk's order.
    """
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [N, V]
    ids = token_ids.to(device=logp.device, dtype=torch.int64)[:, None]  # [N, 1]
    token_logprob = logp.gather(1, ids)  # [N, 1]
    token_rank = (logp > token_logprob).sum(dim=-1) + 1  # [N]
    k = min(max(num_top, 0), logp.shape[1])
    top = logp.topk(k, dim=-1)  # values/indices [N, k]; k == 0 gives empty [N, 0]
    return LogprobsResult(
        token_logprob=token_logprob[:, 0],
        token_rank=token_rank,
        top_ids=top.indices,
        top_logprobs=top.values,
    )
