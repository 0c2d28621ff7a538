"""Draft slot pool: persistent per-request storage of the drafts the next step verifies.

Request with slot s owns rows [s*k, (s+1)*k) of every table; slot 0 is padding and never handed
out, so a padding row indexed 0 reads harmless data. Allocated when a request starts running,
released when it finishes, aborts or is preempted.

The draft distribution q is stored in full ([rows, V]) only for drafters that have one (draft
model): exact rejection sampling needs q at the drafted token *and* the residual max(p - q, 0)
over the whole vocabulary when a draft is rejected. A top-k compressed q would be exact only if
the drafter also sampled from that truncated q; storing the full row keeps any sampler exact at
V floats per draft (64 slots x k=4 x 49k vocab x 4 B = 50 MB on CPU). Model-free drafters
(n-gram) have q = one-hot and store no q at all.
"""

from __future__ import annotations

import torch


class DraftSlotPool:
    def __init__(
        self, num_slots: int, k: int, vocab_size: int, store_q: bool, device: torch.device
    ) -> None:
        self.k = k
        self.num_slots = num_slots
        rows = (num_slots + 1) * k
        # host-side ids and confidences: the scheduler lays the drafts into the step's rows
        # (the GPU overlap path will keep device copies indexed the same way)
        self.token_ids: list[list[int]] = [[] for _ in range(num_slots + 1)]
        self.confidence: list[list[float]] = [[] for _ in range(num_slots + 1)]
        self.q = (
            torch.zeros(rows, vocab_size, dtype=torch.float32, device=device) if store_q else None
        )
        self._free = list(range(num_slots, 0, -1))

    @property
    def num_in_use(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"draft slot pool exhausted ({self.num_slots} slots)")
        slot = self._free.pop()
        self.clear(slot)
        return slot

    def release(self, slot: int) -> None:
        assert slot > 0, "slot 0 is padding and never owned"
        self.clear(slot)
        self._free.append(slot)

    def clear(self, slot: int) -> None:
        self.token_ids[slot] = []
        self.confidence[slot] = []

    def put(self, slot: int, drafts: list[int], confidence: list[float]) -> None:
        assert slot > 0 and len(drafts) <= self.k
        self.token_ids[slot] = drafts
        self.confidence[slot] = confidence

    def q_rows(self, slot: int, n: int) -> torch.Tensor:
        """[n, V] view of the draft distributions of a slot's first n drafts."""
        assert self.q is not None
        return self.q[slot * self.k : slot * self.k + n]
