"""EAGLE-3 drafter: a head on the target's hidden states chains k drafts per request.

The target's forward captures the residual streams entering three of its layers and, in the same
forward (a sink of aux_capture.py, inside the CUDA graph too), stores their fusion g = fc(aux)
per KV slot: `store[slot(p)]` holds g at position p of the request owning the slot. So the
store shares the target's block tables like the KV cache does, and whatever step computed a
position (a prefill chunk, an overlapped plain step, a verify step) left its g behind.

Head position p feeds (token p + 1, g_p) and predicts token p + 2. Its KV cache (one layer) also
shares the target's block tables; positions [0, computed) of it are valid. Drafting for a
request with N tokens: a catch-up over positions [computed, N - 2] (the tokens committed since
it last drafted, however many plain steps passed: they stored their g too; the last of them
yields draft 1), then k - 1 chained steps, each at the next
position feeding the draft just made and the previous step's pre-norm output as its hidden.
The chained positions hold speculative inputs, so `computed` ends at N - 1 whatever is accepted:
the next round rewrites them from the target's own g. A preemption frees the blocks (store and
KV with them): computed restarts at 0 and the re-prefill rewrites the store.

Confidences: c_j = sigmoid(z_j / T_j) from the confidence head, T_j the per-position temperatures
head training fit (`confidence_temperatures` in config.json; 1 without); a head without a
confidence head gives the drafted token's q instead.
"""

from __future__ import annotations

import torch

from specserve.config import SpeculativeConfig
from specserve.engine.sequence import Sequence
from specserve.model.aux_capture import AuxCapture
from specserve.model.eagle3 import Eagle3Head
from specserve.model.errors import ModelLoadError
from specserve.model.loader.eagle3 import default_head_path, load_eagle3_head
from specserve.model.quant import drafter_linears
from specserve.ops.attention import paged_attention, write_kv
from specserve.ops.forward_context import ForwardContext
from specserve.ops.sampling import SamplingTensors
from specserve.runner.model_runner import ModelRunner, StepInputs
from specserve.speculative.catch_up import draft_confidence, pick_drafts
from specserve.speculative.drafter import DraftKVMarks, reserve_draft_blocks


class Eagle3Drafter:
    has_q = True

    def __init__(self, spec: SpeculativeConfig, engine) -> None:
        self.engine = engine
        self.k = spec.num_speculative_tokens
        target, tc = engine.target_model, engine.model_config
        embed = target.embed_tokens
        if hasattr(embed, "replicated"):  # tensor parallel: the head runs on rank 0 alone
            embed = embed.replicated()  # with the whole vocabulary's embedding
        # no model named: the target is the default model (EngineConfig checks), whose head ships
        path = spec.model or default_head_path()
        self.head: Eagle3Head = load_eagle3_head(path, tc, engine.device, engine.dtype, embed)
        self.head.fuse_for_serving()
        # CPU: the head's linears quantized as speculative_config.quantization says, else as
        # the target's, else packed (it serves here; training builds its own)
        drafter_linears(self.head, spec.quantization or engine.config.quantization)
        hc = self.head.config
        # per-position temperatures of the confidence logits (head training's calibration):
        # c_j = sigmoid(z_j / T_j), the last temperature for positions past the list
        temps = hc.raw.get("confidence_temperatures") or [1.0]
        if not isinstance(temps, list) or not all(
            isinstance(t, (int, float)) and t > 0 for t in temps
        ):
            raise ModelLoadError(
                f"EAGLE-3 head config confidence_temperatures={temps!r}: need a list of numbers > 0"
            )
        self.temperatures = [float(t) for t in temps]
        bs, nblocks = engine.config.block_size, engine.num_kv_blocks
        # the head's one-layer KV cache and the row layout (prepare_rows) of its forwards
        self.runner = ModelRunner(
            self.head,
            1,
            hc.num_key_value_heads,
            hc.head_dim,
            nblocks,
            bs,
            engine.dtype,
            engine.device,
        )
        # [slots + 1, H]: g per KV slot; the last row takes the writes of padding rows
        self.store = torch.zeros(
            nblocks * bs + 1, hc.hidden_size, dtype=engine.dtype, device=engine.device
        )
        self._trash = nblocks * bs
        max_rows = max(engine.max_num_batched_tokens, engine.config.max_num_seqs * (1 + self.k))
        target.aux_capture = AuxCapture(
            hc.layer_ids(tc.num_hidden_layers),
            tc.hidden_size,
            max_rows,
            engine.dtype,
            engine.device,
            sink=self._store_fused,
        )
        self._marks = DraftKVMarks()  # valid positions of the head's KV, per request

    @torch.inference_mode()
    def _store_fused(self, rows: torch.Tensor, ctx: ForwardContext) -> None:
        """Sink of the target's forward: g = fc(aux) of each row into its KV slot's entry."""
        slots = ctx.slot_mapping
        slots = torch.where(slots >= 0, slots, self._trash)  # no host sync: padding -> trash
        self.store.index_copy_(0, slots, self.head.fc(rows).to(self.store.dtype))

    def observe(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        pass  # the chain's positions are rewritten by the next catch-up whatever is accepted

    def release(self, seq: Sequence) -> None:
        self._marks.release(seq)

    def plan_confidences(self, seq: Sequence, k: int) -> list[float] | None:
        return None  # the head's, with its drafts

    def _run(
        self, inputs: StepInputs, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One head step over the rows; (prenorm, logits, confidence logit) of the logit rows."""
        cache, ctx = self.runner.kv_caches[0], inputs.ctx
        scale = self.head.midlayer.self_attn.scale

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            write_kv(k, v, cache, ctx.slot_mapping)
            return paged_attention(q, cache, ctx, scale)

        out = self.head.step(
            inputs.input_ids, hidden, inputs.positions, attend, ctx.max_context_len,
            inputs.logit_rows,
        )  # fmt: skip
        return out.prenorm, out.logits, out.confidence

    @torch.inference_mode()
    def propose(
        self, seqs: list[Sequence], limits: list[int]
    ) -> list[tuple[list[int], list[float]]]:
        eng = self.engine
        # the chain writes head KV up to position num_tokens + k - 3
        active = reserve_draft_blocks(eng, seqs, limits, min_tokens=2)
        drafts: list[list[int]] = [[] for _ in seqs]
        confs: list[list[float]] = [[] for _ in seqs]
        if not active:
            return list(zip(drafts, confs))
        # catch-up: positions [start, N - 2] feed tokens start+1 .. N-1 (at least the last one)
        rows, starts = {}, {}
        for i in active:
            seq = seqs[i]
            starts[i] = min(self._marks.valid(seq), seq.num_tokens - 2)
            rows[i] = seq.token_ids[starts[i] + 1 :]
        hidden: torch.Tensor | None = None
        pool = eng.slot_pool
        to_target = self.head.draft_to_target()  # [Vd] target id of each draft token
        for j in range(max(limits[i] for i in active)):
            idx = [i for i in active if limits[i] > j]
            inputs = self.runner.prepare_rows(
                [rows[i] for i in idx],
                [starts[i] for i in idx],
                [seqs[i].block_table.blocks for i in idx],
                [1] * len(idx),
            )
            assert isinstance(inputs, StepInputs)
            if j == 0:
                hidden = self.store[inputs.ctx.slot_mapping]  # the target's g at those positions
            prenorm, logits, conf_logit = self._run(inputs, hidden)
            t = SamplingTensors.build(
                [seqs[i].params for i in idx],
                [seqs[i].seed for i in idx],
                [seqs[i].num_output_tokens + j for i in idx],
                eng.device,
            )
            # q [n, V] (0 off the draft vocabulary) into the pool; greedy alone: the argmax, no q
            q_rows = None
            if not t.all_greedy:
                q_rows = torch.tensor([seqs[i].slot * pool.k + j for i in idx], device=eng.device)
            tok, q = pick_drafts(logits, t, pool, q_rows, self.head.target_logits, to_target)
            temp = self.temperatures[min(j, len(self.temperatures) - 1)]
            conf = (
                torch.sigmoid(conf_logit / temp)
                if conf_logit is not None
                else draft_confidence(q, tok)
            )
            # requests that stop drafting after this step drop out of the next one's rows
            keep = [r for r, i in enumerate(idx) if limits[i] > j + 1]
            hidden = prenorm[keep] if len(keep) < len(idx) else prenorm
            for i, t_id, c in zip(idx, tok.tolist(), conf.tolist()):
                drafts[i].append(t_id)
                confs[i].append(c)
                rows[i] = [t_id]
                starts[i] = seqs[i].num_tokens - 1 + j
        for i in active:
            seq = seqs[i]
            self._marks.set(seq, seq.num_tokens - 1)
        return list(zip(drafts, confs))
