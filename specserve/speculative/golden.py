"""Golden drafter (benchmarks): proposes each request's golden continuation, each draft right with
probability acceptance_rate, so the cost of verification can be measured with random weights
(drafts are accepted exactly when they match the golden token the verifier forces).

Whether the draft of output position p is right is drawn once per request and position, from
the request's prompt and golden ids: every engine, mode and repeat that runs the same request
meets the same right and wrong drafts, however many it drafts or verifies each step. A benchmark
comparing speculation modes then sees their decisions, not the luck of the draws (one shared
random stream gave fixed k 1,612-2,022 tok/s over five repeats of one H200 point, R = 0.8).
The coin of each position is independent of those before it, so each verified draft is right
with probability acceptance_rate whichever drafts a step verifies."""

from __future__ import annotations

import random

from specserve.engine.sequence import Sequence


def golden_coins(seed: int, rate: float, prompt: list[int], gold: list[int]) -> list[bool]:
    """Is the draft of output position p right, for each golden position of a request."""
    # hashes of int tuples are the same in every process (no hash randomisation)
    rng = random.Random(hash((seed, tuple(prompt), tuple(gold))))
    return [rng.random() < rate for _ in gold]


class GoldenDrafter:
    has_q = False  # one-hot drafts

    def __init__(self, acceptance_rate: float, vocab_size: int, seed: int = 0) -> None:
        self.rate = acceptance_rate
        self.vocab_size = vocab_size
        self.seed = seed
        self._right: dict[str, list[bool]] = {}  # request id -> is the draft of position p right

    def _coins(self, seq: Sequence, gold: list[int]) -> list[bool]:
        coins = self._right.get(seq.request_id)
        if coins is None or len(coins) != len(gold):
            coins = golden_coins(self.seed, self.rate, seq.prompt_token_ids, gold)
            self._right[seq.request_id] = coins
        return coins

    def propose(
        self, seqs: list[Sequence], limits: list[int]
    ) -> list[tuple[list[int], list[float]]]:
        out = []
        for seq, k in zip(seqs, limits):
            gold = seq.params.golden_token_ids or []
            n = seq.num_output_tokens
            drafts = []
            if k > 0 and n < len(gold):
                right = self._coins(seq, gold)
                for p in range(n, min(n + k, len(gold))):
                    drafts.append(gold[p] if right[p] else (gold[p] + 1) % self.vocab_size)
            out.append((drafts, [self.rate] * len(drafts)))
        return out

    def observe(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        self._right.pop(seq.request_id, None)

    def plan_confidences(self, seq: Sequence, k: int) -> list[float] | None:
        return [self.rate] * k  # the dialled rate
