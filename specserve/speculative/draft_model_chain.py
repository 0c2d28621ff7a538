"""Draft-model drafting inside the step as CUDA graphs per requests bucket and sampling shape
(draft_graphs.py): the k - 1 chained forwards, sampling and the pool writes after a catch-up
that was not steady (catch_up_graphs.py), and in the steady state the catch-up forward over
each request's verify rows padded to k + 1 before them, all in one graph. The draft model's
position p feeds token p (draft_model.py): verify row j's token goes to the anchor's
position + 1 + j.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from specserve.engine.slots import DraftSlotPool
from specserve.ops.sampling import SamplingTensors
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
        return {"chain": self._body, "steady": self._steady_body}

    def _body(self, n: int, shape: str, max_top_k: int = 0) -> None:
        self._chain(n, self._sampling(n, shape, max_top_k), self.tok[:n], self.conf[:n])

    def _steady_body(self, n: int, shape: str, max_top_k: int = 0) -> None:
        # verify row 0's token goes to the anchor's true position + 1 (the anchor: the length
        # the step wrote, less what it accepted, - 2)
        rows = self._catch_up_rows(n, self.seq_len[:n] - self.accepted[:n] - 1)
        logits = self.forward(rows.tokens, rows.pos, rows.ctx, rows.final)  # at position len - 1
        t = self._sampling(n, shape, max_top_k)
        tok, q = pick_drafts(
            logits, t, self.pool, None if t.all_greedy else self.slots[:n] * self.k
        )
        self._chain(n, t, tok, draft_confidence(q, tok))

    def _chain(self, n: int, t: SamplingTensors, tok: torch.Tensor, conf: torch.Tensor) -> None:
        """Drafts 2..k after draft 1 `tok` [n] (its confidence `conf` [n]); all into the pool."""
        pool, k, slots = self.pool, self.k, self.slots[:n]
        drafts, confs = [tok], [conf]
        contexts = self._chain_contexts(n, self.seq_len[:n])  # draft j at len - 1 + j
        for j, (pos, ctx) in enumerate(contexts, 1):  # the previous draft at the next position
            logits = self.forward(tok, pos, ctx, self.reqs[:n])
            tj = t if t.all_greedy else dataclasses.replace(t, counter=t.counter + j)
            tok, q = pick_drafts(logits, tj, pool, None if t.all_greedy else slots * k + j)
            drafts.append(tok)
            confs.append(draft_confidence(q, tok))
        pool.draft_ids.index_copy_(0, slots, torch.stack(drafts, 1))
        pool.draft_conf.index_copy_(0, slots, torch.stack(confs, 1))
