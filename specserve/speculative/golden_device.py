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
from specserve.runner.device_feed import feed_kernels
from specserve.speculative.golden import golden_coins


class GoldenDeviceDrafter:
    def __init__(self, pool: DraftSlotPool, rate: float, vocab_size: int, seed: int) -> None:
        self.pool, self.rate, self.vocab_size, self.seed = pool, rate, vocab_size, seed
        # [slots + 1, G] bool, coin of each golden position (allocated with the gold table)
        self.coins: torch.Tensor | None = None

    def admit_coins(self, seq: Sequence) -> list[bool]:
        gold = seq.params.golden_token_ids or []
        return golden_coins(self.seed, self.rate, seq.prompt_token_ids, gold)

    def allocate(self, gold: torch.Tensor) -> None:
        """The coin table beside the pool's gold table [slots + 1, G]."""
        self.coins = torch.zeros_like(gold, dtype=torch.bool)

    def admit(self, slot: int, coins: torch.Tensor) -> None:
        """coins [n] bool on the device (n <= the gold table's width)."""
        if self.coins is None or self.coins.shape[1] != self.pool.gold.shape[1]:
            self.allocate(self.pool.gold)
        self.coins[slot].zero_()
        self.coins[slot, : coins.shape[0]].copy_(coins)

    def draft(self, slots: torch.Tensor, seq_len: torch.Tensor, prompt_len: torch.Tensor) -> None:
        """slots [R], seq_len [R] int64: each request's length after this step; prompt_len
        [slots + 1] int64. On CUDA one Triton launch (runner/triton_feed.py), else the torch ops
        below (its reference)."""
        pool = self.pool
        k = pool.draft_ids.shape[1]
        r = slots.shape[0]
        if pool.gold is None or self.coins is None:
            pool.draft_ids.index_fill_(0, slots, -1)
            return
        kernels = feed_kernels(slots)
        if kernels is not None:
            kernels.golden_drafts(
                slots, seq_len, prompt_len, pool.gold, self.coins, pool.draft_ids,
                pool.draft_conf, self.vocab_size, self.rate,
            )  # fmt: skip
            return
        width = pool.gold.shape[1]
        num_output = seq_len - prompt_len[slots]  # [R] output tokens after this step
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
