"""Held-out evaluation: the head drafts chains as it would at serving time, on every row at once.

For each held-out sequence (a prompt and the target's greedy answer), every row t with
t + 1 >= p is a state the engine can be in: the target just emitted x_{t+1}. The head drafts a
chain of K tokens from it, feeding each draft back in (not the true token): the same unroll as
training (ttt.py), with the drafted token as each step's input. The chain's accepted length
a_t is its number of leading drafts equal to the answer's next tokens (the target's greedy
continuation). Tokens per step for a verify length k then follow by walking the answer as
greedy speculative decoding does: from row t emit min(a_t, k) + 1 tokens, jump that far, repeat.

The per-position confidences and soft acceptance labels of the rows whose chain so far was
accepted (the rows where the drafts equal the true tokens, so the label is the true
conditional acceptance) come back for calibration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.train.ttt import TTTBatch, acceptance_label, shift

EVAL_K = 7


@dataclass
class ChainRows:
    """One batch's free-running chains."""

    accepted: list[list[int]]  # per sequence: a_t for each chain start row t (t from p - 1)
    conf_logits: list[torch.Tensor]  # per position i: [N_i] confidence logits, chains alive
    labels: list[torch.Tensor]  # per position i: [N_i] soft acceptance labels


@torch.no_grad()
def draft_chains(head: torch.nn.Module, batch: TTTBatch, k: int = EVAL_K) -> ChainRows:
    b, length = batch.input_ids.shape
    dev = batch.input_ids.device
    t_idx = torch.arange(length, device=dev)[None, :]
    base_pos = t_idx.expand(b, length)
    start_ok = t_idx + 1 >= batch.prompt_lens[:, None]  # [B, L] rows where a chain starts
    alive = start_ok.clone()  # chain accepted so far
    accepted = torch.zeros(b, length, dtype=torch.int64, device=dev)
    ids = shift(batch.input_ids, 1)
    hidden = batch.aux
    past: list[tuple[torch.Tensor, torch.Tensor]] = []
    confs, labels = [], []
    for i in range(k):
        exists = t_idx + 2 + i <= batch.lens[:, None] - 1  # the predicted token exists
        out = head(ids, hidden, base_pos + i, past_kv=past or None)
        past.append(out.kv)
        hidden = out.prenorm
        draft = head.draft_to_target()[out.logits.argmax(-1)]  # [B, L] target ids
        truth = shift(batch.input_ids, 2 + i, -1)
        live = alive & exists
        if out.confidence is not None:
            tgt = shift(batch.draft_logits, 1 + i)
            lse = shift(batch.logsumexp, 1 + i)
            lab = acceptance_label(out.logits.softmax(-1), (tgt - lse[..., None]).exp())
            confs.append(out.confidence[live].float().cpu())
            labels.append(lab[live].float().cpu())
        hit = live & (draft == truth)
        accepted += hit.long()
        alive = hit
        ids = draft
    acc = []
    for r in range(b):
        p, n = int(batch.prompt_lens[r]), int(batch.lens[r])
        acc.append(accepted[r, p - 1 : max(n - 2, p - 1)].tolist())
    return ChainRows(acc, confs, labels)


def walk(accepted: list[int], k: int) -> tuple[int, int]:
    """(tokens emitted, steps) of greedy speculation with k drafts over one answer.

    accepted[j] is a_t of chain start row t = p - 1 + j, one per answer token after the first
    (the prefill emits the first; it is not counted here). A step from row t emits
    min(a_t, k) + 1 tokens (the accepted drafts and the target's own) and lands on the row of
    its last token."""
    total = len(accepted)
    tokens = steps = 0
    while tokens < total:
        tokens += min(min(accepted[tokens], k) + 1, total - tokens)
        steps += 1
    return tokens, steps


@dataclass
class EvalReport:
    tokens_per_step: dict[int, float]  # k -> emitted tokens / steps, over all answers
    acceptance_per_position: list[float]  # P(draft i accepted | drafts < i accepted), K chains
    survival_per_position: list[float]  # P(drafts 0..i all accepted)
    num_sequences: int
    num_chains: int

    def as_dict(self) -> dict:
        return {
            "tokens_per_step": {str(k): v for k, v in self.tokens_per_step.items()},
            "acceptance_per_position": self.acceptance_per_position,
            "survival_per_position": self.survival_per_position,
            "num_sequences": self.num_sequences,
            "num_chains": self.num_chains,
        }

    def table(self) -> str:
        ks = sorted(self.tokens_per_step)
        lines = [
            "k              " + " ".join(f"{k:>6d}" for k in ks),
            "tokens/step    " + " ".join(f"{self.tokens_per_step[k]:6.3f}" for k in ks),
            "accept | pos   " + " ".join(f"{a:6.3f}" for a in self.acceptance_per_position),
            "survival @ pos " + " ".join(f"{a:6.3f}" for a in self.survival_per_position),
        ]
        return "\n".join(lines)


def summarize(accepted: list[list[int]], k_max: int = EVAL_K) -> EvalReport:
    chains = [a for seq in accepted for a in seq]
    tps = {}
    for k in range(1, k_max + 1):
        tok = steps = 0
        for seq in accepted:
            t, s = walk(seq, k)
            tok, steps = tok + t, steps + s
        tps[k] = tok / max(steps, 1)
    n = len(chains)
    survival = [sum(a > i for a in chains) / max(n, 1) for i in range(k_max)]
    cond = []
    for i in range(k_max):
        reached = sum(a >= i for a in chains) if i else n
        cond.append(sum(a > i for a in chains) / max(reached, 1))
    return EvalReport(tps, cond, survival, len(accepted), n)
