"""EAGLE-3 drafting inside the step as CUDA graphs (draft_graphs.py has the buffers, buckets
and sampling shapes): the chained head steps (drafts 2..k) after a catch-up that was not steady
(catch_up_graphs.py), and in the steady state the catch-up step before them too, all in one
graph.

A head step at position p feeds token p + 1 and a hidden state: the target's fused g_p (from
the store its sink filled in the forward) at the catch-up, the previous step's prenorm output
in the chain.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from specserve.engine.slots import DraftSlotPool
from specserve.ops.sampling import SamplingTensors
from specserve.speculative.draft_graphs import DraftGraphs

# (prenorm, draft logits, confidence logit) of one head step over (tokens, hidden, positions,
# ctx, rows: the rows returned, None for all)
HeadStep = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
# drafts [R] int64 and q [R, V] (None: all greedy) from (draft logits, sampling, pool q rows)
Pick = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
# the confidence of draft j: (confidence logit or None, q or None, drafted token, j) -> [R]
Confidence = Callable[[torch.Tensor | None, torch.Tensor | None, torch.Tensor, int], torch.Tensor]


class Eagle3Chain(DraftGraphs):
    def __init__(
        self,
        step: HeadStep,
        pick: Pick,
        confidence: Confidence,
        pool: DraftSlotPool,
        hidden_size: int,
        dtype: torch.dtype,
        width: int,
        block_size: int,
        trash: int,
        padded: bool,
        store: torch.Tensor,  # [slots + 1, H] the target's fused g per KV slot (last: trash)
    ) -> None:
        super().__init__(pool, width, block_size, trash, padded)
        self.step, self.pick, self.confidence, self.store = step, pick, confidence, store
        # draft 1's prenorm, beside draft_graphs' tok and conf
        self.hidden = torch.zeros(pool.num_slots, hidden_size, dtype=dtype, device=pool.device)

    def _bodies(self):
        return {"chain": self._body, "steady": self._steady_body}

    def _body(self, n: int, shape: str, max_top_k: int = 0) -> None:
        t = self._sampling(n, shape, max_top_k)
        self._chain(n, t, self.tok[:n], self.conf[:n], self.hidden[:n])

    def _steady_body(self, n: int, shape: str, max_top_k: int = 0) -> None:
        """The catch-up step over k + 1 rows per request, then the chain."""
        # the anchor's true position: the length the step wrote, less what it accepted
        rows = self._catch_up_rows(n, self.seq_len[:n] - self.accepted[:n] - 2)
        kv = rows.ctx.slot_mapping
        hidden, logits, conf_logit = self.step(
            rows.tokens, self.store[kv], rows.pos, rows.ctx, rows.final
        )
        t = self._sampling(n, shape, max_top_k)
        tok, q = self.pick(logits, t, None if t.all_greedy else self.slots[:n] * self.k)
        self._chain(n, t, tok, self.confidence(conf_logit, q, tok, 0), hidden)

    def _chain(
        self,
        n: int,
        t: SamplingTensors,
        tok: torch.Tensor,  # [n] draft 1
        conf: torch.Tensor,  # [n] its confidence
        hidden: torch.Tensor,  # [n, H] its step's prenorm
    ) -> None:
        pool, k, slots = self.pool, self.k, self.slots[:n]
        drafts, confs = [tok], [conf]
        # step j at the previous draft's position, len - 2 + j
        contexts = self._chain_contexts(n, self.seq_len[:n] - 1)
        greedy = t.all_greedy  # no counters, no q (pick_drafts)
        for j, (pos, ctx) in enumerate(contexts, 1):
            hidden, logits, conf_logit = self.step(tok, hidden, pos, ctx, None)
            tj = t if greedy else dataclasses.replace(t, counter=t.counter + j)
            tok, q = self.pick(logits, tj, None if greedy else slots * k + j)
            drafts.append(tok)
            confs.append(self.confidence(conf_logit, q, tok, j))
        pool.draft_ids.index_copy_(0, slots, torch.stack(drafts, 1))
        pool.draft_conf.index_copy_(0, slots, torch.stack(confs, 1))
