"""Draft-model drafter: a second (small) model proposes up to k tokens per request.

Its KV cache has its own tensors but shares the target's block tables: position p of a request
lives in the same block/offset in both caches. So the target's allocation, prefix-cache reuse,
preemption and rollback apply to the draft KV too, and "rolling back to the accepted prefix" is
just reading the request's mark of valid draft KV against its tokens (DraftKVMarks): the next
catch-up rewrites the rest, however many steps passed without drafting.
"""

from __future__ import annotations

import torch

from specserve.config import SpeculativeConfig
from specserve.engine.sequence import Sequence
from specserve.model.errors import ModelLoadError
from specserve.model.loader import load_model
from specserve.model.quant import drafter_linears
from specserve.ops.sampling import SamplingTensors
from specserve.runner.model_runner import ModelRunner
from specserve.speculative.catch_up import draft_confidence, pick_drafts
from specserve.speculative.drafter import DraftKVMarks, reserve_draft_blocks


class DraftModelDrafter:
    has_q = True

    def __init__(self, spec: SpeculativeConfig, engine) -> None:
        self.engine = engine
        self.k = spec.num_speculative_tokens
        if spec.model in ("self", "target") or spec.model == engine.config.model:
            model, cfg = engine.target_model, engine.model_config  # the target drafts for itself
        else:
            loaded = load_model(spec.model, engine.dtype, engine.device, progress=False)
            method = spec.quantization or engine.config.quantization
            model, cfg = drafter_linears(loaded.model, method), loaded.config
            if cfg.vocab_size != engine.model_config.vocab_size:
                raise ModelLoadError(
                    f"draft model {spec.model!r} has vocabulary size {cfg.vocab_size}, the target "
                    f"has {engine.model_config.vocab_size}: a draft model must share the target's "
                    "vocabulary"
                )
            tok_t, tok_d = engine.tokenizer, loaded.tokenizer
            if tok_t is not None and tok_d is not None and tok_t.get_vocab() != tok_d.get_vocab():
                raise ModelLoadError(
                    f"draft model {spec.model!r} has a different tokenizer vocabulary than the target"
                )
        self.runner = ModelRunner(
            model,
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            engine.num_kv_blocks,
            engine.config.block_size,
            engine.dtype,
            engine.device,
        )
        self._marks = DraftKVMarks()  # valid positions of the draft model's KV, per request

    def observe(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        pass  # the marks read the outcome from the request's tokens (DraftKVMarks)

    def release(self, seq: Sequence) -> None:
        self._marks.release(seq)

    def plan_confidences(self, seq: Sequence, k: int) -> list[float] | None:
        return None  # the draft model's probabilities, with its drafts

    @torch.inference_mode()
    def propose(
        self, seqs: list[Sequence], limits: list[int]
    ) -> list[tuple[list[int], list[float]]]:
        eng = self.engine
        active = reserve_draft_blocks(eng, seqs, limits)
        drafts: list[list[int]] = [[] for _ in seqs]
        confs: list[list[float]] = [[] for _ in seqs]
        if not active:
            return list(zip(drafts, confs))
        # round 0 catches each request's draft KV up to its last token (a ragged chunk); every
        # later round feeds the draft just proposed, one row per request
        rows = {}
        starts = {}
        for i in active:
            seq = seqs[i]
            starts[i] = min(self._marks.valid(seq), seq.num_tokens - 1)
            rows[i] = seq.token_ids[starts[i] :]
        pool = eng.slot_pool
        for j in range(max(limits[i] for i in active)):
            idx = [i for i in active if limits[i] > j]
            inputs = self.runner.prepare_rows(
                [rows[i] for i in idx],
                [starts[i] for i in idx],
                [seqs[i].block_table.blocks for i in idx],
                [1] * len(idx),
            )
            logits = self.runner.forward(inputs)  # [len(idx), V]
            t = SamplingTensors.build(
                [seqs[i].params for i in idx],
                [seqs[i].seed for i in idx],
                [seqs[i].num_output_tokens + j for i in idx],
                eng.device,
            )
            # q (the target's filtered family) into the pool; greedy alone: the argmax, no q
            q_rows = None
            if not t.all_greedy:
                q_rows = torch.tensor([seqs[i].slot * pool.k + j for i in idx], device=eng.device)
            tok, q = pick_drafts(logits, t, pool, q_rows)  # [len(idx)]
            conf = draft_confidence(q, tok)
            for i, t_id, c in zip(idx, tok.tolist(), conf.tolist()):
                drafts[i].append(t_id)
                confs[i].append(c)
                rows[i] = [t_id]
                starts[i] = seqs[i].num_tokens + j
        for i in active:
            seq = seqs[i]
            # fed: the catch-up through num_tokens - 1, then drafts 1..k-1 from num_tokens on
            self._marks.set(seq, seq.num_tokens, drafts[i][:-1])
        return list(zip(drafts, confs))
