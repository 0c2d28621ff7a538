"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2) over a flat batch of rows.

One class covers the four families; they differ only in q/k/v bias (Qwen2), per-head q/k RMSNorm
(Qwen3), rope scaling, tied embeddings and sliding-window attention (Mistral, Qwen2/3: a window
per layer, see ModelConfig.layer_window). q/k/v and gate/up are fused into single matmuls: on a
small CPU, batch-1 decode is bound by weight bandwidth plus a fixed cost per op, so fewer ops help.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model import cpu_stack
from specserve.model.aux_capture import AuxCapture
from specserve.model.config import ModelConfig
from specserve.model.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding
from specserve.ops.attention import paged_attention, slots_all_valid, write_kv
from specserve.ops.forward_context import ForwardContext, KVCache
from specserve.ops.fused import rope_, rope_write_kv_


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        # keys each query sees (itself included); 0 = the whole context
        self.window = config.layer_window(layer)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos_sin: torch.Tensor,  # [T, 2, 1, D]
        cache: KVCache,
        ctx: ForwardContext,
        all_valid: bool,
    ) -> torch.Tensor:  # [T, hidden]
        t = x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) * D]
        if self.qk_norm:
            v = qkv[:, self.q_size + self.kv_size :].view(t, hkv, d)
            q = self.q_norm(qkv[:, : self.q_size].view(t, h, d))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, hkv, d))
            # q, k are fresh norm outputs here, so rotating them in place (fused path) is safe.
            q, k = rope_(q, cos_sin), rope_(k, cos_sin)
            write_kv(k, v, cache, ctx.slot_mapping, all_valid)
        else:
            # q and k rotate together and k, v go to the cache in the same pass: one kernel on
            # the fused path (q, rotated in place, is then a strided view of qkv).
            heads = qkv.view(t, h + 2 * hkv, d)
            q = rope_write_kv_(heads, h, cos_sin, cache, ctx.slot_mapping, all_valid)
        o = paged_attention(q, cache, ctx, self.scale, self.window)  # [T, H, D]
        return self.o_proj(o.view(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden] previous layer's MLP output (layer 0: the embeddings)
        residual: torch.Tensor | None,  # [T, hidden] residual stream before x; None at layer 0
        cos_sin: torch.Tensor,
        cache: KVCache,
        ctx: ForwardContext,
        all_valid: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual stream), both [T, hidden]
        """The residual stream after this layer is residual + the returned MLP output; the add is
        left to the next norm (next layer's input norm, or the model's final norm), which fuses
        it. Same values as `x = x + attn(norm(x)); x = x + mlp(norm(x))`, fewer kernels."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos_sin, cache, ctx, all_valid)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    # HF checkpoint projection name -> (our fused parameter, shard index)
    STACKED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Passing the (uninitialised) weight skips nn.Embedding's normal_() init, which on the meta
        # device pulls in torch._dynamo (seconds of import time for values we overwrite anyway).
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.rope_theta,
            config.rope_scaling,
            config.max_position_embeddings,
        )
        # set by an EAGLE-3 drafter or head training (aux_capture.py); None: no capture work
        self.aux_capture: AuxCapture | None = None
        # tensor parallelism (specserve.distributed): [N, V / tp] local logits -> [N, V]
        self.gather_logits: Callable[[torch.Tensor], torch.Tensor] | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],  # one per layer
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, hidden], final-normed
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions, ctx.max_context_len, x.dtype)
        residual: torch.Tensor | None = None
        cap = self.aux_capture
        stack = cpu_stack.stack_for(self, x, cos_sin, kv_caches, ctx)  # CPU fp32: one call
        if stack is not None:
            x, residual = stack.run(x, cos_sin, kv_caches, ctx, cap)
        else:
            # Checked once here rather than in each layer's KV write.
            all_valid = slots_all_valid(ctx.slot_mapping)
            for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                if cap is not None:
                    cap.record(i, x, residual)
                x, residual = layer(x, residual, cos_sin, cache, ctx, all_valid)
        if cap is not None:
            cap.finish(ctx, x.shape[0])
        return self.norm.add_forward(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V] fp32
        if self.lm_head is None:
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        else:  # nn.Linear, or a quantized head (model/quant.py)
            logits = self.lm_head(hidden).float()
        return logits if self.gather_logits is None else self.gather_logits(logits)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our (fused) parameters; return the parameter names filled.

        A fused parameter counts as filled only once all its shards arrived, so the loader's
        coverage check also catches a checkpoint that lacks, say, one up_proj.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        shards_seen: dict[str, set[int]] = {}
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            shard = None
            for proj, (fused, idx) in self.STACKED.items():
                if f".{proj}." in name:
                    name, shard = name.replace(f".{proj}.", f".{fused}."), idx
                    break
            param = params.get(name)
            if param is None:
                raise KeyError(f"checkpoint tensor {hf_name!r} has no place in the model")
            dst = param.data if shard is None else self._shard_view(param.data, name, shard)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            if shard is None:
                loaded.add(name)
            else:
                shards_seen.setdefault(name, set()).add(shard)
        for name, seen in shards_seen.items():
            if len(seen) == (3 if ".qkv_proj." in name else 2):
                loaded.add(name)
        return loaded

    def _shard_view(self, data: torch.Tensor, name: str, shard: int) -> torch.Tensor:
        """Rows of a fused weight/bias that hold one HF projection."""
        c = self.config
        if ".qkv_proj." in name:
            sizes = [c.q_size, c.kv_size, c.kv_size]
        else:
            sizes = [c.intermediate_size, c.intermediate_size]
        return data.narrow(0, sum(sizes[:shard]), sizes[shard])
