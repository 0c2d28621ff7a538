"""Draft slot pool: persistent per-request storage of the drafts the next step verifies.

Request with slot s owns row s of every table; slot 0 is padding and never handed out, so a
padding row indexed 0 reads harmless data (no drafts, nothing rejected). Allocated when a request
starts running, released when it finishes, aborts or is preempted.

Two kinds of drafter fill it:
- device drafters (drafter.device: n-gram, golden) write `draft_ids` / `draft_conf` inside the
  step, after its verification, and the next step's inputs read them there by slot: the host
  never sees a draft, so overlap holds with speculation on. Absent drafts are -1, which no
  verification accepts (the accepted prefix ends there: lossless).
- host drafters (draft model, EAGLE-3) put host lists (`token_ids`, `confidence`) that the
  scheduler lays into the step's rows, and (draft model) the full q.

Per slot the device also keeps what the host learns only one step late under overlap: the
sequence length after the latest step (`seq_len`, where the next anchor row sits) and how many
verify rows the latest step rejected (`rejected`: the host scheduled the next step as if all
were accepted, and the device shifts that step's positions back by this many).

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
        self.device = device
        rows = (num_slots + 1) * k
        # host drafters: the scheduler lays these drafts into the step's rows
        self.token_ids: list[list[int]] = [[] for _ in range(num_slots + 1)]
        self.confidence: list[list[float]] = [[] for _ in range(num_slots + 1)]
        self.q = (
            torch.zeros(rows, vocab_size, dtype=torch.float32, device=device) if store_q else None
        )
        # device drafters: [slots + 1, k] drafts (-1 = none) and their confidences
        width = max(k, 1)
        self.draft_ids = torch.full((num_slots + 1, width), -1, dtype=torch.int64, device=device)
        self.draft_conf = torch.zeros(num_slots + 1, width, dtype=torch.float32, device=device)
        # [slots + 1] int64: tokens of the sequence after its latest step, and verify rows that
        # step rejected (slot 0 stays 0: rows without a correction read it)
        self.seq_len = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
        self.rejected = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
        # [slots + 1, G] int64 golden ids (-1 past the end) of requests that have them, on the
        # device for steps whose output positions only the device knows (allocated on first use)
        self.gold: torch.Tensor | None = None
        self._free = list(range(num_slots, 0, -1))

    @property
    def num_in_use(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def flat_draft_ids(self) -> torch.Tensor:
        """[(slots + 1) * k] view: draft j of slot s at s * k + j (the steps' gather index)."""
        return self.draft_ids.view(-1)

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

    def ensure_gold(self, width: int) -> torch.Tensor:
        if self.gold is None:
            self.gold = torch.full(
                (self.num_slots + 1, width), -1, dtype=torch.int64, device=self.device
            )
        return self.gold

    def golden_rows(self, row_slots: torch.Tensor, out_index: torch.Tensor) -> torch.Tensor:
        """[rows] golden token of each row (row_slots [rows] int64, out_index [rows] int64 the
        output position the row produces), -1 where there is none."""
        if self.gold is None:
            return torch.full_like(out_index, -1)
        width = self.gold.shape[1]
        tok = self.gold[row_slots, out_index.clamp(0, width - 1)]
        return torch.where(out_index < width, tok, torch.full_like(tok, -1))

    def q_rows(self, slot: int, n: int) -> torch.Tensor:
        """[n, V] view of the draft distributions of a slot's first n drafts."""
        assert self.q is not None
        return self.q[slot * self.k : slot * self.k + n]
