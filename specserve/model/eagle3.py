"""EAGLE-3 draft head: one Llama decoder layer over the target's fused hidden states.

Parameter names are the checkpoint names vLLM (`llama_eagle3.py`, `Eagle3LlamaForCausalLM`) and
SGLang (`llama_eagle3.py`, `LlamaForCausalLMEagle3`) load, so `state_dict()` is the file:

    fc.weight                                   [H, 3 Ht]  fuses the low/mid/high target layers
    midlayer.input_layernorm.weight             [H]        norm of the token embedding
    midlayer.hidden_norm.weight                 [H]        norm of the (fused) hidden state
    midlayer.self_attn.{q,k,v}_proj.weight      [heads * D, 2H]  input cat(embed, hidden)
    midlayer.self_attn.o_proj.weight            [H, heads * D]
    midlayer.post_attention_layernorm.weight    [H]
    midlayer.mlp.{gate,up}_proj.weight          [I, H];  midlayer.mlp.down_proj.weight [H, I]
    norm.weight                                 [H]
    lm_head.weight                              [draft_vocab, H]
    d2t                                         [draft_vocab] int64: target id = draft + d2t
    t2d                                         [vocab] bool: target ids in the draft vocab
    embed_tokens.weight (optional)              [vocab, H]; absent: the target's embedding

One step: residual = h (hidden_norm(h) with `norm_before_residual`), x = cat(input_layernorm(
e(token)), hidden_norm(h)); residual += o_proj(attn(x)); prenorm = residual +
mlp(post_attention_layernorm(residual)); logits = lm_head(norm(prenorm)). A chain feeds
`prenorm` on as the next step's h; the first step's h is fc(aux), the target's residual streams
entering its `aux_layer_ids` layers, concatenated in layer order (vLLM's capture).

The confidence head (DSpark) c = sigmoid(w . [norm(prenorm) ; e(token)] + b) estimates that the
step's draft is accepted. Its tensors (`confidence_head.weight` [1, 2H], `.bias` [1]) live in a
file of their own that other engines do not read (loader/eagle3.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model.eagle3_config import EAGLE3_ARCHITECTURE, Eagle3Config
from specserve.model.layers import Linear, RMSNorm, RotaryEmbedding
from specserve.ops.fused import apply_rope, rope_, silu_and_mul
from specserve.ops.gemv import gemv_glu, glu_eligible


@dataclass
class Eagle3Output:
    prenorm: torch.Tensor  # [..., H] the next chain / TTT step's hidden state
    logits: torch.Tensor  # [..., draft_vocab] float32
    confidence: torch.Tensor | None  # [...] float32 logit of c (None: no confidence head)
    kv: tuple[torch.Tensor, torch.Tensor] | None = None  # dense: this step's k, v [B, Hkv, T, D]


class Eagle3Attention(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.scale = c.head_dim**-0.5
        self.q_proj = Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.qkv_proj: nn.Linear | None = None  # serving: q, k, v stacked (fuse_for_serving)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, 2H] -> q [T, heads, D], k and v [T, kv_heads, D] (before rope)."""
        t, d = x.shape[0], self.head_dim
        return (
            self.q_proj(x).view(t, self.num_heads, d),
            self.k_proj(x).view(t, self.num_kv_heads, d),
            self.v_proj(x).view(t, self.num_kv_heads, d),
        )

    def qkv_roped(
        self, x: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, 2H] -> q [T, heads, D], k and v [T, kv_heads, D], q and k roped. Stacked: one
        matmul, q and k roped in one pass, all three views of its output."""
        if self.qkv_proj is None:
            q, k, v = self.qkv(x)
            return apply_rope(q, cos_sin), apply_rope(k, cos_sin), v
        h, hkv = self.num_heads, self.num_kv_heads
        heads = self.qkv_proj(x).view(x.shape[0], h + 2 * hkv, self.head_dim)
        qk = rope_(heads[:, : h + hkv], cos_sin)  # in place on the fused path
        return qk[:, :h], qk[:, h:], heads[:, h + hkv :]


class Eagle3MLP(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None  # serving: gate, up stacked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if type(gate_up) is Linear and glu_eligible(x, gate_up.weight):
            return self.down_proj(gemv_glu(x, gate_up.weight))  # one kernel to [T, I]
        if gate_up is not None:
            return self.down_proj(silu_and_mul(gate_up(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Eagle3Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = Eagle3MLP(c)


# (q [T, heads, D], k, v [T, kv_heads, D], all roped) -> attention output [T, heads, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Eagle3Head(nn.Module):
    def __init__(
        self,
        config: Eagle3Config,
        embed_tokens: nn.Embedding | None = None,  # the target's (shared, not a parameter here)
        confidence_head: bool = True,
    ) -> None:
        super().__init__()
        c = self.config = config
        self.owns_embedding = embed_tokens is None
        if embed_tokens is None:
            # an explicit weight skips normal_() (slow on the meta device; overwritten on load)
            self.embed_tokens = nn.Embedding(
                c.vocab_size, c.hidden_size, _weight=torch.empty(c.vocab_size, c.hidden_size)
            )
        else:
            object.__setattr__(self, "_shared_embed", embed_tokens)  # kept out of state_dict
        self.fc = Linear(c.fc_in, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))
        self.confidence_head = nn.Linear(2 * c.hidden_size, 1) if confidence_head else None
        self.rotary = RotaryEmbedding(
            c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings
        )

    def fuse_for_serving(self) -> None:
        """q/k/v and gate/up as one matmul each: fewer launches a head step. For serving only:
        the stacked weights replace the checkpoint's tensors (state_dict loses their names)."""

        def stacked(*parts: nn.Linear) -> Linear:
            w = torch.cat([p.weight.detach() for p in parts])
            out = Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
            out.weight = nn.Parameter(w, requires_grad=False)
            return out

        attn, mlp = self.midlayer.self_attn, self.midlayer.mlp
        attn.qkv_proj = stacked(attn.q_proj, attn.k_proj, attn.v_proj)
        mlp.gate_up_proj = stacked(mlp.gate_proj, mlp.up_proj)
        del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj

    @property
    def embedding(self) -> nn.Embedding:
        return self.embed_tokens if self.owns_embedding else self._shared_embed

    def draft_to_target(self) -> torch.Tensor:  # [draft_vocab] int64 target ids
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, draft_vocab] -> [N, vocab] float32, -inf outside the draft vocabulary (q = 0)."""
        out = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        return out.index_copy_(1, self.draft_to_target(), logits).float()

    def step(
        self,
        input_ids: torch.Tensor,  # [T] the token each row feeds (the one after its hidden's)
        hidden: torch.Tensor,  # [T, 3Ht] target aux streams (fc applied), or [T, H] prenorm
        positions: torch.Tensor,  # [T] int64 rope positions
        attend: Attend,
        max_position: int,
        rows: torch.Tensor | None = None,  # [R] int64: only these rows' outputs (None: all)
    ) -> Eagle3Output:
        """One head step over flat rows; `attend` supplies the attention (paged or dense)."""
        c, layer = self.config, self.midlayer
        if hidden.shape[-1] != c.hidden_size:
            hidden = self.fc(hidden)
        embeds = self.embedding(input_ids).to(hidden.dtype)  # [T, H]
        h_normed = layer.hidden_norm(hidden)
        residual = h_normed if c.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), h_normed], dim=-1)  # [T, 2H]
        cos_sin = self.rotary.cos_sin(positions, max_position, x.dtype)
        q, k, v = layer.self_attn.qkv_roped(x, cos_sin)
        o = attend(q, k, v)  # [T, heads, D]
        # each residual add fused with the norm after it (one kernel on CUDA)
        attn_out = layer.self_attn.o_proj(o.reshape(o.shape[0], -1))
        h, residual = layer.post_attention_layernorm.add_forward(attn_out, residual)
        normed, prenorm = self.norm.add_forward(layer.mlp(h), residual)
        if rows is not None:  # the vocabulary-wide GEMM on the rows that draft only
            normed, prenorm, embeds = normed[rows], prenorm[rows], embeds[rows]
        conf = None
        if self.confidence_head is not None:
            conf = self.confidence_head(torch.cat([normed, embeds], dim=-1)).squeeze(-1).float()
        return Eagle3Output(prenorm, self.lm_head(normed).float(), conf)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        hidden: torch.Tensor,  # [B, T, 3Ht] aux streams, or [B, T, H] the previous step's prenorm
        positions: torch.Tensor,  # [B, T] int64
        past_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        padding_mask: torch.Tensor | None = None,  # [B, Tk] bool over step 0's keys, True = real
        q_offset: int = 0,
    ) -> Eagle3Output:
        """Dense forward for training (training-time test). With no `past_kv`, plain causal
        attention over the T positions. TTT step i > 0 passes the kv of steps 0..i-1: a query at
        index t then sees step 0's keys at indices <= t (causal, the context) and the keys at
        index t itself of steps 1..i (its own earlier chain steps), as SpecForge and EAGLE-3
        train it. q_offset (steps i > 0 only): the rows are step 0's indices q_offset.. (a
        window: rows before it never start a chain that counts), steps 1..i-1 ran on the same
        window. Returns [B, T, ...] tensors and this step's kv to pass on."""
        b, t = input_ids.shape
        c = self.config
        assert q_offset == 0 or past_kv, "a query window needs step 0's keys (past_kv)"
        tk = past_kv[0][0].shape[2] if past_kv else t  # step 0's key rows
        dev = input_ids.device
        q_idx = torch.arange(t, device=dev)[:, None] + q_offset  # [T, 1] step-0 index of a row
        k_idx = torch.arange(tk, device=dev)[None, :]
        group = c.num_attention_heads // c.num_key_value_heads
        mask = (k_idx <= q_idx)[None, None]  # [1, 1, T, Tk]
        if padding_mask is not None:
            # a row always sees itself, so a padding row's softmax stays finite
            mask = (mask & padding_mask[:, None, None, :]) | (k_idx == q_idx)
        kv_out: list[tuple[torch.Tensor, torch.Tensor]] = []

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            def heads(x: torch.Tensor) -> torch.Tensor:  # [B*T, h, D] -> [B, h, T, D]
                return x.view(b, t, x.shape[1], x.shape[2]).transpose(1, 2)

            k, v = heads(k), heads(v)
            kv_out.append((k, v))
            steps = [*(past_kv or []), (k, v)]
            qh = heads(q)  # [B, Hq, T, D]
            k0, v0 = (x.repeat_interleave(group, dim=1) for x in steps[0])
            s = (qh @ k0.transpose(-1, -2)) * self.midlayer.self_attn.scale  # [B, Hq, T, Tk]
            scores = [s.masked_fill(~mask, float("-inf"))]
            values = []
            for kj, vj in steps[1:]:
                kj, vj = kj.repeat_interleave(group, dim=1), vj.repeat_interleave(group, dim=1)
                scores.append((qh * kj).sum(-1, keepdim=True) * self.midlayer.self_attn.scale)
                values.append(vj)
            p = torch.cat(scores, dim=-1).float().softmax(-1).to(qh.dtype)
            o = p[..., :tk] @ v0  # [B, Hq, T, D]
            for j, vj in enumerate(values):
                o = o + p[..., tk + j : tk + j + 1] * vj
            return o.transpose(1, 2).reshape(b * t, c.num_attention_heads, c.head_dim)

        flat_h = hidden.reshape(b * t, hidden.shape[-1])
        out = self.step(
            input_ids.reshape(-1),
            flat_h,
            positions.reshape(-1),
            attend,
            int(positions.max()) + 1,
        )
        conf = out.confidence.view(b, t) if out.confidence is not None else None
        return Eagle3Output(out.prenorm.view(b, t, -1), out.logits.view(b, t, -1), conf, kv_out[0])


__all__ = [
    "EAGLE3_ARCHITECTURE",
    "Eagle3Config",
    "Eagle3Head",
    "Eagle3Output",
]
