"""Runs one step's forward: builds the flat rows and the ForwardContext, owns the paged KV cache.

On CUDA, after `init_cuda_graphs`, decode/verify steps (every row wants logits) go through
`DecodeGraphs` (one CUDA graph per total_q bucket, see cuda_graph.py); everything else, and every
step on CPU, runs the eager path below.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import torch

from specserve import env
from specserve.engine.scheduler import StepBatch
from specserve.ops.forward_context import ForwardContext, KVCache
from specserve.ops.transfer import h2d
from specserve.ops.triton_attention import MIN_KEYS_PER_SPLIT, use_triton
from specserve.runner.cuda_graph import BucketStep, CudaGraphBackend, DecodeGraphs, GraphBackend
from specserve.runner.device_feed import feed_ids, shift_context_lens, shift_rows
from specserve.runner.graph_tail import SampledTail, TailDrafting
from specserve.runner.prompt_logprobs import PromptLogprobs, PromptRows, score_prompt_rows


class StepInputs(NamedTuple):
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    ctx: ForwardContext
    logit_rows: torch.Tensor  # [total_q] int64, rows of the verify layout inside the T rows
    # [T] int64 slot whose next_tokens entry feeds the row (0: input_ids[r] as is). Read in
    # forward(), not when the inputs are built: the step in flight may not have written it yet.
    pending: torch.Tensor | None = None
    prompt: PromptRows | None = None  # prompt rows to score (requests asking prompt_logprobs)
    # device drafts and the in-flight step's rejections (device_feed.py), [T] int64 each
    draft_at: torch.Tensor | None = None
    shift: torch.Tensor | None = None
    row_req: torch.Tensor | None = None  # [T] int64, with shift


def kv_bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    return (
        2
        * num_layers
        * block_size
        * num_kv_heads
        * head_dim
        * torch.tensor([], dtype=dtype).element_size()
    )


class ModelRunner:
    # decode/verify steps of the common shape sample inside the bucket's graph (graph_tail.py);
    # tensor parallelism keeps its sampling eager (the lm_head there is every rank's work)
    sample_tail = True

    def __init__(
        self,
        model: torch.nn.Module,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_num_seqs: int = 256,
        draft_ids: torch.Tensor | None = None,  # [slots + 1, k] int64, the slot pool's
        rejected: torch.Tensor | None = None,  # [slots + 1] int64, the slot pool's
        kv_dtype: torch.dtype | None = None,  # K/V in the cache (None: dtype)
    ) -> None:
        self.model = model
        # [slots] the token each request sampled in its latest step, indexed by its slot (0 =
        # padding): under overlap scheduling the next step reads its anchor token from here
        # before the host has seen it.
        self.next_tokens = torch.zeros(max_num_seqs + 1, dtype=torch.int64, device=device)
        # device drafters: the drafts the next step feeds and the rows the step in flight
        # rejected, both indexed by slot (device_feed.py); zeros when there is no pool
        if draft_ids is None:
            draft_ids = torch.full((max_num_seqs + 1, 1), -1, dtype=torch.int64, device=device)
        self.draft_width = draft_ids.shape[1]
        self.draft_ids = draft_ids.view(-1)
        self.rejected = (
            rejected
            if rejected is not None
            else torch.zeros(max_num_seqs + 1, dtype=torch.int64, device=device)
        )
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        kv_dtype = kv_dtype or dtype
        self.kv_caches = [
            KVCache(
                torch.zeros(shape, dtype=kv_dtype, device=device),
                torch.zeros(shape, dtype=kv_dtype, device=device),
            )
            for _ in range(num_layers)
        ]
        self.graphs: DecodeGraphs | None = None

    def init_cuda_graphs(
        self,
        max_num_seqs: int,
        max_rows_per_seq: int,  # 1 + k
        max_model_len: int,
        capture: bool = True,
        progress: bool = True,
        backend: GraphBackend | None = None,
        drafting: TailDrafting | None = None,  # a device drafter whose steps fit the tail
        max_mixed_rows: int = 0,  # the most rows of a step with a prompt chunk run in a graph
    ) -> None:
        """Route decode/verify steps through the bucket layout and (capture=True) capture one
        graph per bucket. capture=False (enforce_eager) keeps the layout but runs it eagerly, so
        the numbers match the graphs bit for bit. No-op off CUDA unless a backend is given
        (tests drive the layout on CPU with a fake one)."""
        if backend is None and not use_triton(self.device):
            return
        self.graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.block_size,
            max_num_seqs,
            max_rows_per_seq,
            max_model_len,
            self.device,
            self.model.config.hidden_size,
            self.dtype,
            self.next_tokens,
            self.draft_ids,
            self.rejected,
            tail=self.sample_tail and env.settings.graph_tail and env.settings.fused_verify,
            drafting=drafting,
            max_mixed_rows=max_mixed_rows,
        )
        if capture:
            self.graphs.capture(backend or CudaGraphBackend(self.device), progress)

    def warm_up_eager(self, max_query_rows: int, max_positions: int) -> int:
        """Run eager forwards per attention tile class (rows per request -> tile height), over
        a short context and over one long enough to split its keys, so their Triton kernels
        compile at start-up, not inside the first steps that need them: on the H200 the
        256-request run spent ~0.9 s of its 5.3 s compiling prefill variants, and a drafter's
        catch-up over a long context (a split launch) stalled its step as long.
        max_query_rows / max_positions: the most rows / positions a forward may take.
        Only before serving: the rows write blocks no request owns yet, and every block is
        rewritten by its owner before it is read (a block the prefix cache holds would not be).
        Returns the forwards run."""
        cfg = self.model.config
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        runs = 0
        for tile_rows in (16, 32, 64, 128):
            # >= 2 rows with one logit: a prefill chunk, never a decode-shaped (graph) step
            q = min(max(2, tile_rows // group), max_query_rows)
            for start in (0, 2 * MIN_KEYS_PER_SPLIT):
                blocks = -(-(start + q) // self.block_size)
                if q < 2 or blocks > self.num_blocks or start + q > max_positions:
                    continue
                inputs = self.prepare_rows([[0] * q], [start], [list(range(blocks))], [1])
                self.forward(inputs)
                runs += 1
        return runs

    def prepare(self, batch: StepBatch, split: bool = True) -> StepInputs | BucketStep:
        """The step's inputs; a device-split batch (split=True: as one) its per-request ones."""
        if split and batch.split_total is not None and self.graphs is not None:
            anchors, pending = [], []
            for seq, start in zip(batch.seqs, batch.starts):
                known = start < len(seq.token_ids)  # else sampled by the step in flight
                anchors.append(seq.token_ids[start] if known else 0)
                pending.append(0 if known else seq.slot)
            tables = [s.block_table.blocks for s in batch.seqs]
            step = self.graphs.prepare_split(anchors, pending, tables, batch.split_total)
            if step is not None:
                return step
        rows, tables, num_logits = [], [], []
        pending: np.ndarray | None = None
        draft_at: np.ndarray | None = None
        shift: np.ndarray | None = None
        shifts = batch.shifts or [False] * len(batch.seqs)
        k = self.draft_width
        prompt_rows: list[int] = []
        prompt_targets: list[int] = []
        spans: list[tuple[PromptLogprobs, int, int]] = []
        offset = 0
        for seq, start, qlen, d, samples, shifted in zip(
            batch.seqs, batch.starts, batch.query_lens, batch.drafts, batch.samples, shifts
        ):
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                # this chunk feeds prompt rows that predict prompt tokens: score them
                state = seq.prompt_logprobs_state
                if state is None:
                    state = PromptLogprobs(seq.params.prompt_logprobs, seq.prompt_token_ids)
                    seq.prompt_logprobs_state = state
                score = state.take_rows(start, qlen - len(d))
                if score:
                    prompt_rows.extend(
                        range(offset + score.start - start, offset + score.stop - start)
                    )
                    prompt_targets.extend(seq.prompt_token_ids[score.start + 1 : score.stop + 1])
                    spans.append((state, score.start, len(score)))
            toks = seq.token_ids[start : start + qlen - len(d)]
            if len(toks) < qlen - len(d):
                # its anchor token was sampled by the step in flight: read it on the device
                if pending is None:
                    pending = np.zeros(batch.num_rows, dtype=np.int64)
                pending[offset + len(toks)] = seq.slot
                toks.append(0)
            if d and batch.device_drafts:
                if draft_at is None:
                    draft_at = np.zeros(batch.num_rows, dtype=np.int64)
                at = offset + len(toks)
                draft_at[at : at + len(d)] = np.arange(1, len(d) + 1) + seq.slot * k
                d = [0] * len(d)
            if shifted:
                if shift is None:
                    shift = np.zeros(batch.num_rows, dtype=np.int64)
                shift[offset : offset + qlen] = seq.slot
            rows.append(toks + d if d else toks)
            tables.append(seq.block_table.blocks)
            num_logits.append(1 + len(d) if samples else 0)
            offset += qlen
        prompt = None
        if spans:
            prompt = PromptRows(
                h2d(prompt_rows, torch.int64, self.device),
                h2d(prompt_targets, torch.int64, self.device),
                max(state.num_top for state, _, _ in spans),
                spans,
            )
        return self.prepare_rows(
            rows, batch.starts, tables, num_logits, pending, prompt, draft_at, shift
        )

    def prepare_rows(
        self,
        rows: list[list[int]],
        starts: list[int],
        tables: list[list[int]],
        num_logits: list[int],
        pending: np.ndarray | None = None,  # [T] int64: slot whose next token feeds the row, 0
        prompt: PromptRows | None = None,
        draft_at: np.ndarray | None = None,  # [T] int64: flat draft pool index + 1, 0
        shift: np.ndarray | None = None,  # [T] int64: slot whose rejected rows shift it, 0
    ) -> StepInputs | BucketStep:
        """Request i feeds tokens rows[i] at positions starts[i].. and wants logits for its last
        num_logits[i] rows; `prompt` rows are scored for prompt logprobs (eager steps only)."""
        if self.graphs is not None and prompt is None:
            step = self.graphs.prepare(rows, starts, tables, pending, draft_at, shift, num_logits)
            if step is not None:
                return step
        bs = self.block_size
        pos: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        logit_rows: list[np.ndarray] = []
        context_lens: list[int] = []
        qlens = [len(r) for r in rows]
        row = 0
        for qlen, start, blocks, nl in zip(qlens, starts, tables, num_logits):
            p = np.arange(start, start + qlen, dtype=np.int64)
            pos.append(p)
            table = np.asarray(blocks, dtype=np.int64)
            slots.append(table[p // bs] * bs + p % bs)
            if nl:
                logit_rows.append(np.arange(row + qlen - nl, row + qlen, dtype=np.int64))
            context_lens.append(start + qlen)
            row += qlen
        max_blocks = max(len(t) for t in tables)
        bt = np.zeros((len(tables), max_blocks), dtype=np.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = t
        cu = np.zeros(len(qlens) + 1, dtype=np.int32)
        np.cumsum(qlens, out=cu[1:])
        dev = self.device

        def t(x: np.ndarray) -> torch.Tensor:
            return h2d(x, torch.from_numpy(x).dtype, dev)

        ctx = ForwardContext(
            query_lens=t(np.asarray(qlens, dtype=np.int32)),
            cu_query_lens=t(cu),
            context_lens=t(np.asarray(context_lens, dtype=np.int32)),
            block_tables=t(bt),
            slot_mapping=t(np.concatenate(slots)),
            max_query_len=max(qlens),
            max_context_len=max(context_lens),
            query_lens_cpu=qlens,
            context_lens_cpu=context_lens,
        )
        ids = np.fromiter((x for r in rows for x in r), dtype=np.int64, count=sum(qlens))
        lr = np.concatenate(logit_rows) if logit_rows else np.zeros(0, dtype=np.int64)
        src = t(pending) if pending is not None else None
        at = t(draft_at) if draft_at is not None else None
        sh = rr = None
        if shift is not None:
            sh = t(shift)
            rr = t(np.repeat(np.arange(len(qlens), dtype=np.int64), qlens))
        return StepInputs(t(ids), t(np.concatenate(pos)), ctx, t(lr), src, prompt, at, sh, rr)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs | BucketStep) -> torch.Tensor | SampledTail:
        """Logits [total_q, V] of the verify layout's rows (float32); a bucket step whose
        sampling runs in its graph's tail (inputs.tail) returns its results instead."""
        if isinstance(inputs, BucketStep):
            return self.graphs.run(inputs)
        ids = feed_ids(
            inputs.input_ids, inputs.pending, inputs.draft_at, self.next_tokens, self.draft_ids
        )
        positions, ctx = inputs.positions, inputs.ctx
        if inputs.shift is not None:
            positions, slot_mapping, corr = shift_rows(
                positions,
                ctx.slot_mapping,
                inputs.shift,
                inputs.row_req,
                ctx.block_tables,
                self.block_size,
                self.rejected,
            )
            context_lens = shift_context_lens(
                ctx.context_lens, ctx.cu_query_lens, ctx.query_lens, corr
            )
            # the host lengths are upper bounds now: the CPU attention reads the tensor
            ctx = dataclasses.replace(
                ctx, slot_mapping=slot_mapping, context_lens=context_lens, context_lens_cpu=None
            )
        hidden = self.model(ids, positions, self.kv_caches, ctx)
        if inputs.prompt is not None:
            score_prompt_rows(self.model.compute_logits, hidden, inputs.prompt)
        if inputs.logit_rows.numel() == 0:
            return hidden.new_zeros((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden[inputs.logit_rows])
