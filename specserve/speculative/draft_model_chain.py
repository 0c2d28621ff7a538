"""Steady draft-model drafting inside the step as one CUDA graph per requests bucket and sampling
shape (draft_graphs.py): the catch-up forward over each request's verify rows padded to k + 1,
then the k - 1 chained forwards, sampling and the pool writes. The draft model's position p
feeds token p (draft_model.py): verify row j's token goes to the anchor's position + 1 + j.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from specserve.engine.slots import DraftSlotPool
from specserve.speculative.catch_up import draft_confidence, pick_drafts
from specserve.speculative.draft_graphs import DraftGraphs

# logits [R, V] fp32 of the rows `rows` of one draft-model forward over (tokens, positions, ctx)
DraftForward = Callable[..., torch.Tensor]


class DraftModelChain(DraftGraphs):
    def __init__(
        self,
        forward: DraftForward,
        pool: DraftSlotPool,
        width: int,
        block_size: int,
        trash: int,
        padded: bool,
    ) -> None:
        super().__init__(pool, width, block_size, trash, padded)
        self.forward = forward

    def _bodies(self):
        return {"steady": self._steady_body}

    def _steady_body(self, n: int, shape: str, max_top_k: int = 0) -> None:
        pool, k, slots = self.pool, self.k, self.slots[:n]
        # verify row 0's token goes to the anchor's true position + 1 (the anchor: the length
        # the step wrote, less what it accepted, - 2)
        rows = self._catch_up_rows(n, self.seq_len[:n] - self.accepted[:n] - 1)
        logits = self.forward(rows.tokens, rows.pos, rows.ctx, rows.final)  # at position len - 1
        t = self._sampling(n, shape, max_top_k)
        drafts: list[torch.Tensor] = []
        confs: list[torch.Tensor] = []
        tok = rows.tokens  # replaced by draft 1 before a chained forward reads it
        contexts = self._chain_contexts(n, self.seq_len[:n])  # draft j at len - 1 + j
        for j in range(k):
            if j > 0:  # chained: the previous draft at the next position
                pos, ctx = contexts[j - 1]
                logits = self.forward(tok, pos, ctx, self.reqs[:n])
            tj = t if t.all_greedy else dataclasses.replace(t, counter=t.counter + j)
            tok, q = pick_drafts(logits, tj, pool, None if t.all_greedy else slots * k + j)
            drafts.append(tok)
            confs.append(draft_confidence(q, tok))
        pool.draft_ids.index_copy_(0, slots, torch.stack(drafts, 1))
        pool.draft_conf.index_copy_(0, slots, torch.stack(confs, 1))
