"""Draft-model drafting inside the step: after the target's verification the draft model
catches up on the tokens the step settled and chains k drafts, writing them, their q and
their confidences into the draft slot pool (draft_model.py has the conventions: the draft
model's KV shares the target's block tables, position p feeds token p).

Catch-up rows of a request, laid out by the host at launch: position p0 + 1 + j feeding the
token the step emitted at verify row j (rows past the accepted prefix feed garbage the chain
overwrites or nothing reads), after, in its step that samples a prompt's last chunk, positions
0 .. p0 (its tokens, known on the host). Otherwise position p0, the anchor, was fed by the
previous round's catch-up as that round's last token, or, for a request that resumes drafting,
ahead of the step's forward (`catch_up_gap`: from the length after the last step that drafted
for it through p0, the anchor token in flight from next_tokens). Under overlap p0 is known
only on the device: each request's correction is its host p0 less the true one, from the
lengths the step just wrote. The k - 1 chained steps then run one row per request at positions
len, len + 1, ... (blocks grown k - 1 positions past the rows by the scheduler; past them the
trash block). On CUDA a steady step (no request with prompt rows) replays one CUDA graph for
all of it (draft_model_chain.py), its inputs written by the target's graph tail when the step is
greedy and samples there (runner/graph_tail.py); any other catch-up (a step that admits a
request, a gap) replays the graph of its rows bucket (catch_up_graphs.py), then the chain's.
"""

from __future__ import annotations

import torch

from specserve import env
from specserve.engine.sequence import Sequence
from specserve.engine.slots import DraftSlotPool
from specserve.ops.forward_context import ForwardContext, KVCache
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
from specserve.speculative.draft_model import DraftModelDrafter
from specserve.speculative.draft_model_chain import DraftModelChain


class DraftModelDeviceDrafter:
    def __init__(self, drafter: DraftModelDrafter, pool: DraftSlotPool, max_model_len: int) -> None:
        assert pool.q is not None, "a draft model's drafts carry q: the pool must store it"
        self.pool = pool
        self.model = drafter.runner.model
        self.block_size = drafter.runner.block_size
        self.device = pool.device
        # the draft KV with one more block: positions a request has no block for yet write there
        # (allocated anew, the empty ones dropped first: a draft model's KV can be large)
        like = drafter.runner.kv_caches[0].k
        num_layers = len(drafter.runner.kv_caches)
        drafter.runner.kv_caches = []
        self.trash = like.shape[0]
        shape, dtype, device = (like.shape[0] + 1, *like.shape[1:]), like.dtype, like.device
        del like

        def zeros() -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.caches = [KVCache(zeros(), zeros()) for _ in range(num_layers)]
        drafter.runner.kv_caches = self.caches
        # block-table columns of every position a step touches (chain included), + the trash one
        self.width = -(-(max_model_len + pool.k + 2) // self.block_size) + 1
        self.chain = DraftModelChain(
            self._logits, pool, self.width, self.block_size, self.trash,
            padded=self.device.type == "cuda",
        )  # fmt: skip
        # a catch-up that is not steady (a prompt's, a gap's): its forward over any rows
        self.catch_up = CatchUpGraphs(
            lambda *rows: (self._logits(*rows),), pool.num_slots, self.width,
            self.chain.max_context_len, self.device,
        )  # fmt: skip

    def capture(self, backend) -> None:
        """CUDA graphs of steady drafting (after the target's: the draft model's rotary table
        is built for the graphs' bound first)."""
        dtype = self.caches[0].k.dtype
        self.chain.capture(
            backend, self.model.rotary.table(self.chain.max_context_len, self.device, dtype)
        )
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
        steady = self.chain.steady_rows(seqs, [r is not None for r in resume])
        if steady is not None:
            return steady
        k = self.pool.k
        tokens: list[int] = []
        emit_at: list[int] = []
        positions: list[int] = []
        row_req: list[int] = []
        shifted: list[bool] = []
        qlens: list[int] = []
        leads: list[int] = []
        tables: list[list[int]] = []
        top, row = 1, 0
        for i, (seq, p0, nd, r) in enumerate(zip(seqs, anchor_pos, num_drafts, resume)):
            # one that resumes has no drafts in flight: p0 exact; position p feeds token p
            lo = p0 + 1 if r is None else r
            lead = p0 + 1 - lo
            toks, feed = prefix_rows(seq, lo, p0 + 1)
            tokens += toks + [0] * (nd + 1)
            emit_at += feed + list(range(row + 1, row + nd + 2))
            positions += list(range(lo, p0 + 1)) + list(range(p0 + 1, p0 + nd + 2))
            row_req += [i] * (lead + nd + 1)
            shifted += [False] * lead + [True] * (nd + 1)
            qlens.append(lead + nd + 1)
            leads.append(lead)
            tables.append(seq.block_table.blocks)
            top = max(top, p0 + nd + k + 2)
            row += nd + 1
        return pack_catch_up(
            (tokens, emit_at, positions, row_req, shifted),
            qlens,
            leads,
            tables,
            top,
            self.block_size,
            self.trash,
            self.device,
            self.width,
        )

    def gap_layout(self, seqs: list[Sequence], kv_lens: list[int], anchors: list[int]) -> CatchUp:
        """Positions len .. p0 of each request (len: its KV's valid length, p0: its anchor's
        position), each feeding its own token (shift 0)."""
        spans = [(n, p0 + 1) for n, p0 in zip(kv_lens, anchors)]
        return pack_gap(seqs, spans, 0, self.block_size, self.trash, self.device, self.width)

    # -- device -------------------------------------------------------------------------------
    @torch.inference_mode()
    def catch_up_gap(self, lay: CatchUp, anchor: torch.Tensor, eager: bool = False) -> None:
        """The draft model's KV over a gap (anchor [R] int64: each request's anchor token;
        eager: outside the rows buckets' graphs, warm_gaps)."""
        _, ctx = gap_context(lay, self.block_size)
        last = lay.cu_query_lens[1:].to(torch.int64) - 1
        self.catch_up.run(catch_up_tokens(lay, lay.tokens, anchor), lay.positions, ctx, last, eager)

    def _logits(
        self, tokens: torch.Tensor, pos: torch.Tensor, ctx: ForwardContext, rows: torch.Tensor
    ) -> torch.Tensor:
        hidden = self.model(tokens, pos, self.caches, ctx)
        return self.model.compute_logits(hidden[rows])

    @torch.inference_mode()
    def draft(
        self,
        lay: CatchUp | SteadyRows,
        plan: SamplerPlan,
        result: VerifyResult,
        seq_len: torch.Tensor,  # [R] int64, lengths after this step
        num_output: torch.Tensor,  # [R] int64, output tokens after this step
    ) -> None:
        pool, k = self.pool, self.pool.k
        acc = result.num_accepted
        # per request sampling params: each one's at its first verify row, DRAFT_SALT stream
        emitted, t = settled(plan, result, num_output)
        if isinstance(lay, SteadyRows):
            return self.chain.run_steady(lay, plan, result, emitted, seq_len, num_output, t)
        tokens = catch_up_tokens(lay, emitted, None)
        start = lay.cu_query_lens[:-1].to(torch.int64)
        # the host laid the emitted rows out from p0_host + 1; the true anchor is len - acc - 2
        corr = lay.positions[start + lay.prefix] - 1 - (seq_len - acc - 2)  # [R]
        pos = lay.positions - torch.where(lay.verify_row, corr[lay.row_req], 0)
        slots = kv_slots(lay.block_tables, lay.row_req, pos, self.block_size)
        ctx = ForwardContext(
            query_lens=lay.query_lens,
            cu_query_lens=lay.cu_query_lens,
            context_lens=(lay.query_lens.to(torch.int64) + pos[start]).to(torch.int32),
            block_tables=lay.block_tables,
            slot_mapping=slots,
            max_query_len=lay.max_query_len,
            max_context_len=lay.max_context_len,
        )
        (logits,) = self.catch_up.run(tokens, pos, ctx, start + lay.prefix + acc)  # at len - 1
        tok, q = pick_drafts(logits, t, pool, plan.slots * k)  # q: the target p's family
        conf = draft_confidence(q, tok)
        self.chain.run(tok, conf, seq_len, num_output, plan.slots, lay.block_tables, t)
