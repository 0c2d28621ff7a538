"""Golden drafting on the device (benchmarks): each request's golden ids and its per-position
coins live in per-slot device tables; after each step the draft of output position p is the
golden token if coin p is heads, else a wrong token (golden + 1 mod V).

The coins are those of golden.py (drawn once per request and position from a generator seeded
by the engine seed, the prompt and the golden ids), drawn on the host when the request starts
running and copied with its golden ids: every engine, mode and repeat meets the same right and
wrong drafts, so benchmarks compare speculation modes, not luck. Nothing per step on the host.
"""

from __future__ import annotations

import torch

from specserve.engine.sequence import Sequence
from specserve.engine.slots import DraftSlotPool
from specserve.speculative.golden import golden_coins


class GoldenDeviceDrafter:
    def __init__(self, pool: DraftSlotPool, rate: float, vocab_size: int, seed: int) -> None:
        self.pool, self.rate, self.vocab_size, self.seed = pool, rate, vocab_size, seed
        # [slots + 1, G] bool, coin of each golden position (allocated with the gold table)
        self.coins: torch.Tensor | None = None

    def admit_coins(self, seq: Sequence) -> list[bool]:
        gold = seq.params.golden_token_ids or []
        return golden_coins(self.seed, self.rate, seq.prompt_token_ids, gold)

    def admit(self, slot: int, coins: torch.Tensor) -> None:
        """coins [n] bool on the device (n <= the gold table's width)."""
        if self.coins is None or self.coins.shape[1] != self.pool.gold.shape[1]:
            self.coins = torch.zeros_like(self.pool.gold, dtype=torch.bool)
        self.coins[slot].zero_()
        self.coins[slot, : coins.shape[0]].copy_(coins)

    def draft(self, slots: torch.Tensor, num_output: torch.Tensor) -> None:
        """num_output [R] int64: output tokens of each request after this step."""
        pool = self.pool
        k = pool.draft_ids.shape[1]
        r = slots.shape[0]
        if pool.gold is None or self.coins is None:
            pool.draft_ids.index_fill_(0, slots, -1)
            return
        width = pool.gold.shape[1]
        at = num_output.unsqueeze(1) + torch.arange(k, device=slots.device)  # [R, k]
        inside = at < width
        col = at.clamp(0, width - 1)
        gold = pool.gold[slots].gather(1, col)
        heads = self.coins[slots].gather(1, col)
        wrong = (gold + 1) % self.vocab_size
        drafts = torch.where(heads, gold, wrong)
        drafts = torch.where(inside & (gold >= 0), drafts, torch.full_like(drafts, -1))
        pool.draft_ids.index_copy_(0, slots, drafts)
        conf = torch.where(drafts >= 0, self.rate, 0.0).to(torch.float32).expand(r, k)
        pool.draft_conf.index_copy_(0, slots, conf)
