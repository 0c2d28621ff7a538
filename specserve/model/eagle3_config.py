"""The EAGLE-3 head's config.json, as vLLM, SGLang and SpecForge write and read it (a Llama
config with `architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`, optional
`target_hidden_size`, `eagle_aux_hidden_state_layer_ids` at the top level or in `eagle_config`
(vLLM reads both), `norm_before_residual`). Re-exported by model/eagle3.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specserve.model.config import _rope
from specserve.model.errors import ModelLoadError

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    target_hidden_size: int | None = None  # None: the head's hidden_size
    # target layers whose *input* residual stream feeds fc (vLLM's counting); None: default
    aux_layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False
    raw: dict[str, Any] = field(default_factory=dict)  # config.json as read, written back on save

    @property
    def fc_in(self) -> int:
        return 3 * (self.target_hidden_size or self.hidden_size)

    def layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers to capture, ascending (the order of fc's input blocks)."""
        n = num_target_layers
        ids = self.aux_layer_ids or (2, n // 2, n - 3)
        bad = [i for i in ids if not 0 <= i < n]
        if len(set(ids)) < len(ids):
            raise ModelLoadError(
                f"eagle_aux_hidden_state_layer_ids {list(ids)}: the layers must differ (a target "
                f"of {n} layers needs explicit ids)"
            )
        if bad:
            raise ModelLoadError(
                f"eagle_aux_hidden_state_layer_ids {list(ids)}: {bad} outside the target's "
                f"layers 0..{n - 1}"
            )
        return tuple(sorted(ids))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> Eagle3Config:
        archs = cfg.get("architectures") or []
        if EAGLE3_ARCHITECTURE not in archs:
            raise ModelLoadError(
                f"config.json architectures {archs} is not an EAGLE-3 head: expected "
                f"[{EAGLE3_ARCHITECTURE!r}]"
            )
        if int(cfg.get("num_hidden_layers", 1)) != 1:
            raise ModelLoadError(
                f"num_hidden_layers={cfg['num_hidden_layers']}: only one-layer EAGLE-3 heads "
                "are supported"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag):
                raise ModelLoadError(f"{flag}=true is not supported in an EAGLE-3 head")
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ModelLoadError(f"hidden_act={cfg.get('hidden_act')!r}: need silu")
        eagle = cfg.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state") is False:
            raise ModelLoadError("eagle_config.use_aux_hidden_state=false is not supported")
        ids = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            vocab = int(cfg["vocab_size"])
            theta, scaling = _rope(cfg)
            out = cls(
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                vocab_size=vocab,
                draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                target_hidden_size=cfg.get("target_hidden_size"),
                aux_layer_ids=tuple(int(i) for i in ids) if ids else None,
                norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                raw=dict(cfg),
            )
        except KeyError as e:
            raise ModelLoadError(f"EAGLE-3 config.json is missing field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"EAGLE-3 config.json has a malformed field: {e}") from None
        if out.aux_layer_ids is not None and len(out.aux_layer_ids) != 3:
            raise ModelLoadError(
                f"eagle_aux_hidden_state_layer_ids={list(out.aux_layer_ids)}: need 3 layer ids"
            )
        if out.num_attention_heads % out.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads="
                f"{out.num_key_value_heads}"
            )
        if not 0 < out.draft_vocab_size <= vocab:
            raise ModelLoadError(f"draft_vocab_size={out.draft_vocab_size} not in 1..{vocab}")
        return out

    def to_dict(self) -> dict[str, Any]:
        """config.json: the fields read back (vLLM/SGLang need a Llama config), raw extras kept."""
        out = dict(self.raw)
        out.update(
            architectures=[EAGLE3_ARCHITECTURE],
            model_type=out.get("model_type", "llama"),
            hidden_act="silu",
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=1,
            vocab_size=self.vocab_size,
            draft_vocab_size=self.draft_vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=False,
        )
        out.pop("rope_parameters", None)
        if self.target_hidden_size is not None:
            out["target_hidden_size"] = self.target_hidden_size
        if self.aux_layer_ids is not None:
            out["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
            out.setdefault("eagle_config", {})["eagle_aux_hidden_state_layer_ids"] = list(
                self.aux_layer_ids
            )
        if self.norm_before_residual:
            out["norm_before_residual"] = True
        return out
