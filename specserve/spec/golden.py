"""Golden drafter (benchmarks): proposes each request's golden continuation, each draft right with
probability acceptance_rate, so the cost of verification can be measured with random weights
(drafts are accepted exactly when they match the golden token the verifier forces)."""

from __future__ import annotations

import random

from specserve.engine.sequence import Sequence


class GoldenDrafter:
    has_q = False  # one-hot drafts

    def __init__(self, acceptance_rate: float, vocab_size: int, seed: int = 0) -> None:
        self.rate = acceptance_rate
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    def propose(
        self, seqs: list[Sequence], limits: list[int]
    ) -> list[tuple[list[int], list[float]]]:
        out = []
        for seq, k in zip(seqs, limits):
            gold = seq.params.golden_token_ids or []
            n = seq.num_output_tokens
            drafts = []
            for j in range(min(k, len(gold) - n)):
                right = self.rng.random() < self.rate
                drafts.append(gold[n + j] if right else (gold[n + j] + 1) % self.vocab_size)
            out.append((drafts, [self.rate] * len(drafts)))
        return out

    def observe(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass
