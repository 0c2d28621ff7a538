"""EAGLE-3 drafting inside the step: after the target's forward and verification, the head
catches up on the positions the step settled and chains k drafts, writing them, their q and
their confidences into the draft slot pool (eagle3.py has the head's conventions: head position
p feeds token p + 1 and the target's fused g_p, from the store its sink filled in the forward).

Catch-up rows of a request, laid out by the host at launch: its verify rows (anchor + drafts),
position p0 + j feeding the token the step emitted at row j (accepted draft or sampled token;
rows past the accepted prefix feed garbage that the chain overwrites or nothing reads), and,
in its step that samples a prompt's last chunk, every earlier position (its tokens known on the
host). A request that resumes drafting with decode rows caught up ahead of the step's forward
(`catch_up_gap`: positions from len - 1 of the last step that drafted for it to its anchor's,
the anchor token in flight from next_tokens). Under overlap p0 is known only on the device (the
step in flight's rejections): each request's correction is its host p0 less the true one,
taken from the lengths the step just wrote. The k - 1 chained steps then run one row per
request at positions len - 1, len, ... (the scheduler grows each request's blocks k - 1
positions past its rows for them).

On CUDA a steady step (no request with prompt rows to catch up) replays one CUDA graph for the
catch-up and the chain (eagle3_chain.py); a step that admits a request catches up eagerly (its
rows vary) and replays the chain's graph. A steady greedy step sampling in the target's graph
tail has its inputs written there, no host layout at all (runner/graph_tail.py).
"""

from __future__ import annotations

import torch

from specserve import env
from specserve.engine.sequence import Sequence
from specserve.engine.slots import DraftSlotPool
from specserve.ops.attention import paged_attention, write_kv
from specserve.ops.forward_context import ForwardContext, KVCache
from specserve.ops.sampling import SamplingTensors
from specserve.runner.step_sampler import SamplerPlan
from specserve.sample.verify import VerifyResult
from specserve.speculative.catch_up import (
    CatchUp,
    catch_up_tokens,
    draft_confidence,
    gap_context,
    kv_slots,
    pack_catch_up,
    pack_gap,
    pick_drafts,
    prefix_rows,
    settled,
)
from specserve.speculative.catch_up_graphs import CatchUpGraphs
from specserve.speculative.draft_graphs import SteadyRows
from specserve.speculative.eagle3 import Eagle3Drafter
from specserve.speculative.eagle3_chain import Eagle3Chain


class Eagle3DeviceDrafter:
    def __init__(self, drafter: Eagle3Drafter, pool: DraftSlotPool, max_model_len: int) -> None:
        assert pool.q is not None, "EAGLE-3 drafts carry q: the pool must store it"
        self.inner, self.pool = drafter, pool
        self.head = drafter.head
        self.block_size = drafter.runner.block_size
        # the head's KV cache with one more block: positions a request has no block for yet
        # (its chain ran past the blocks the pool could give) write there, harmlessly
        k0 = drafter.runner.kv_caches[0]
        self.trash = k0.k.shape[0]
        grow = (1, *k0.k.shape[1:])
        self.cache = KVCache(
            torch.cat([k0.k, k0.k.new_zeros(grow)]), torch.cat([k0.v, k0.v.new_zeros(grow)])
        )
        drafter.runner.kv_caches[0] = self.cache
        self.device = pool.device
        # block-table columns of every position a step touches (chain included), + the trash one
        self.width = -(-(max_model_len + pool.k + 1) // self.block_size) + 1
        self.ids = self.head.draft_to_target()  # [draft vocab] int64 target ids
        self.chain = Eagle3Chain(
            self._step,
            self._pick,
            self._confidence,
            pool,
            self.head.config.hidden_size,
            drafter.store.dtype,
            self.width,
            self.block_size,
            self.trash,
            padded=self.device.type == "cuda",
            store=drafter.store,
        )
        # a catch-up that is not steady (a prompt's, a gap's): its head step over any rows
        self.catch_up = CatchUpGraphs(
            self._catch_up_step, pool.num_slots, self.width, self.chain.max_context_len,
            self.device,
        )  # fmt: skip

    def capture(self, backend) -> None:
        """CUDA graphs of the chained steps (after the target's: the head's rotary table is
        built for the chain's bound first)."""
        table = self.head.rotary.table(
            self.chain.max_context_len, self.device, self.inner.store.dtype
        )
        self.chain.capture(backend, table)
        if env.settings.mixed_graphs:  # catch-ups over any rows, as the target's mixed steps
            self.catch_up.capture(backend)

    # -- host ---------------------------------------------------------------------------------
    def layout(
        self,
        seqs: list[Sequence],
        anchor_pos: list[int],
        num_drafts: list[int],
        resume: list[int | None],  # None: drafted for last step; else its KV's valid length
    ) -> CatchUp | SteadyRows:
        """Read from the requests at launch: the catch-up rows of each sampling request (a
        steady step under the chain's graphs: only their block tables)."""
        steady = self.chain.steady_rows(seqs, [r is not None for r in resume])
        if steady is not None:
            return steady
        k = self.pool.k
        tokens: list[int] = []
        emit_at: list[int] = []
        positions: list[int] = []
        row_req: list[int] = []
        verify_row: list[bool] = []
        qlens: list[int] = []
        prefixes: list[int] = []
        tables: list[list[int]] = []
        top = 1
        row = 0
        for i, (seq, p0, nd, r) in enumerate(zip(seqs, anchor_pos, num_drafts, resume)):
            # one that resumes has no drafts in flight, so its p0 is exact; head position p
            # feeds token p + 1, and its KV is valid below len - 1
            lo = p0 if r is None else max(r - 1, 0)
            pre = p0 - lo
            toks, feed = prefix_rows(seq, lo + 1, p0 + 1)
            tokens += toks + [0] * (nd + 1)
            emit_at += feed + list(range(row + 1, row + nd + 2))
            positions += list(range(lo, p0)) + list(range(p0, p0 + nd + 1))
            row_req += [i] * (pre + nd + 1)
            verify_row += [False] * pre + [True] * (nd + 1)
            qlens.append(pre + nd + 1)
            prefixes.append(pre)
            tables.append(seq.block_table.blocks)
            top = max(top, p0 + nd + k + 1)
            row += nd + 1
        return pack_catch_up(
            (tokens, emit_at, positions, row_req, verify_row),
            qlens,
            prefixes,
            tables,
            top,
            self.block_size,
            self.trash,
            self.device,
            self.width,
        )

    def gap_layout(self, seqs: list[Sequence], kv_lens: list[int], anchors: list[int]) -> CatchUp:
        """Positions max(len - 1, 0) .. p0 - 1 of each request (len: its KV's valid length,
        p0: its anchor's position), each feeding the next token (shift 1)."""
        spans = [(max(n - 1, 0), p0) for n, p0 in zip(kv_lens, anchors)]
        return pack_gap(seqs, spans, 1, self.block_size, self.trash, self.device, self.width)

    # -- device -------------------------------------------------------------------------------
    @torch.inference_mode()
    def catch_up_gap(self, lay: CatchUp, anchor: torch.Tensor, eager: bool = False) -> None:
        """The head's KV over a gap (anchor [R] int64: each request's anchor token;
        eager: outside the rows buckets' graphs, warm_gaps)."""
        _, ctx = gap_context(lay, self.block_size)
        tokens = catch_up_tokens(lay, lay.tokens, anchor)
        last = lay.cu_query_lens[1:].to(torch.int64) - 1
        self.catch_up.run(tokens, lay.positions, ctx, last, eager)

    def _catch_up_step(
        self, tokens: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A catch-up's head step: the target's g at each row's KV slot (padding rows, slot -1:
        the store's trash row)."""
        return self._step(tokens, self.inner.store[ctx.slot_mapping], positions, ctx, rows)

    def _step(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        rows: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One head step over the rows; (prenorm, logits over the draft vocabulary, confidence
        logit) of `rows` (None: of every row, a chained step's)."""
        cache, scale = self.cache, self.head.midlayer.self_attn.scale

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            write_kv(k, v, cache, ctx.slot_mapping)
            return paged_attention(q, cache, ctx, scale)

        out = self.head.step(tokens, hidden, positions, attend, ctx.max_context_len, rows)
        return out.prenorm, out.logits, out.confidence

    def _pick(
        self, logits: torch.Tensor, t: SamplingTensors, q_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts from draft-vocabulary logits, and their q over the target's vocabulary (-inf
        off the draft vocabulary: q = 0 there)."""
        return pick_drafts(logits, t, self.pool, q_rows, self.head.target_logits, self.ids)

    def _confidence(
        self, conf_logit: torch.Tensor | None, q: torch.Tensor | None, tok: torch.Tensor, j: int
    ) -> torch.Tensor:  # [R] float32
        if conf_logit is None:  # a head without a confidence head: the drafted token's q
            return draft_confidence(q, tok)
        temps = self.inner.temperatures
        return torch.sigmoid(conf_logit / temps[min(j, len(temps) - 1)]).float()

    @torch.inference_mode()
    def draft(
        self,
        lay: CatchUp | SteadyRows,
        plan: SamplerPlan,
        result: VerifyResult,
        seq_len: torch.Tensor,  # [R] int64, lengths after this step
        num_output: torch.Tensor,  # [R] int64, output tokens after this step
    ) -> None:
        k = self.pool.k
        acc = result.num_accepted
        # per request sampling params: each one's at its first verify row, DRAFT_SALT stream
        emitted, t = settled(plan, result, num_output)
        if isinstance(lay, SteadyRows):
            return self.chain.run_steady(lay, plan, result, emitted, seq_len, num_output, t)
        tokens = catch_up_tokens(lay, emitted, None)
        # the host laid verify rows out from p0_host; the true anchor is len - accepted - 2
        host_p0 = lay.positions[lay.cu_query_lens[:-1].to(torch.int64) + lay.prefix]
        corr = host_p0 - (seq_len - acc - 2)  # [R]
        pos = lay.positions - torch.where(lay.verify_row, corr[lay.row_req], 0)
        slots = kv_slots(lay.block_tables, lay.row_req, pos, self.block_size)
        ctx = ForwardContext(
            query_lens=lay.query_lens,
            cu_query_lens=lay.cu_query_lens,
            context_lens=(lay.query_lens.to(torch.int64) + pos[lay.cu_query_lens[:-1].long()]).to(
                torch.int32
            ),
            block_tables=lay.block_tables,
            slot_mapping=slots,
            max_query_len=lay.max_query_len,
            max_context_len=lay.max_context_len,
        )
        final = lay.cu_query_lens[:-1].to(torch.int64) + lay.prefix + acc  # [R]
        prenorm, logits, conf_logit = self.catch_up.run(tokens, pos, ctx, final)
        tok, q = self._pick(logits, t, plan.slots * k)
        conf = self._confidence(conf_logit, q, tok, 0)
        self.chain.run(
            tok, conf, seq_len, num_output, plan.slots, lay.block_tables, t,
            extra=((self.chain.hidden, prenorm),),
        )  # fmt: skip
