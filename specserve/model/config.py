"""Model hyper-parameters for the Llama family, read from a HF config.json (transformers 4.x/5.x)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specserve.model.errors import ModelLoadError

# HF `architectures` entry -> family. SmolLM2 ships as LlamaForCausalLM with tied embeddings.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# "freq_factors" is specserve's own: per-frequency divisors, as GGUF stores Llama 3.1 scaling.
_SUPPORTED_ROPE = ("default", "llama3", "linear", "freq_factors")
_LAYER_TYPES = ("full_attention", "sliding_attention")
_HF_DEFAULT_WINDOW = 4096
_HF_DEFAULT_MAX_WINDOW_LAYERS = 28


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None = plain rope; else {"rope_type": "llama3" | "linear" | "freq_factors", ...fields}
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Sliding-window attention: a query at position i sees keys j with i - W < j <= i (HF's
    # mask). `sliding_window` None = every layer attends to its whole context; else the layers
    # marked "sliding_attention" in `layer_types` (None: all of them) use the window.
    sliding_window: int | None = None
    layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; specserve runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(f"sliding_window={self.sliding_window} must be >= 1")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ModelLoadError(
                    f"layer_types has {len(self.layer_types)} entries for "
                    f"num_hidden_layers={self.num_hidden_layers}"
                )
            bad = sorted(set(self.layer_types) - set(_LAYER_TYPES))
            if bad:
                raise ModelLoadError(
                    f"unsupported layer_types {bad}; supported: {', '.join(_LAYER_TYPES)}"
                )

    def layer_window(self, layer: int) -> int:
        """Keys a query of this layer sees, itself included; 0 = its whole context."""
        if self.sliding_window is None:
            return 0
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return 0
        return self.sliding_window

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(
        cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Build from a parsed config.json (and optionally generation_config.json for EOS ids)."""
        arch = _pick_architecture(cfg)
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ModelLoadError(f"unsupported hidden_act {cfg.get('hidden_act')!r} (need silu)")
        if cfg.get("mlp_bias"):
            raise ModelLoadError("mlp_bias=true is not supported")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            head_dim = cfg.get("head_dim") or hidden // heads
            theta, scaling = _rope(cfg)
            vocab, inter = int(cfg["vocab_size"]), int(cfg["intermediate_size"])
            layers = int(cfg["num_hidden_layers"])
            window, layer_types = _sliding_window(arch, cfg, layers)
            return cls(
                architecture=arch,
                vocab_size=vocab,
                hidden_size=hidden,
                intermediate_size=inter,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                # HF's Qwen2 always has q/k/v bias; Llama/Qwen3 read attention_bias.
                attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias")),
                qk_norm=arch == "Qwen3ForCausalLM",
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=_eos_ids(cfg, generation_config),
                sliding_window=window,
                layer_types=layer_types,
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json is missing required field {e.args[0]!r}") from None


def _pick_architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return a
    if not archs and cfg.get("model_type") in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[cfg["model_type"]]
    found = ", ".join(archs) if archs else f"model_type={cfg.get('model_type')!r}"
    raise ModelLoadError(
        f"unsupported architecture ({found}); specserve runs {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either 4.x (rope_theta + rope_scaling) or 5.x (rope_parameters)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type not in _SUPPORTED_ROPE:
        raise ModelLoadError(
            f"unsupported rope scaling {rope_type!r}; supported: {', '.join(_SUPPORTED_ROPE)}"
        )
    if rope_type == "default":
        return float(theta), None
    return float(theta), {**scaling, "rope_type": rope_type}


def _sliding_window(
    arch: str, cfg: dict[str, Any], num_layers: int
) -> tuple[int | None, list[str] | None]:
    """(window, layer_types) as transformers' modeling code reads them, per architecture.

    Llama: never windowed (LlamaAttention has no sliding window). Mistral: `sliding_window` on
    every layer (its modeling ignores `layer_types`). Qwen2/Qwen3: the window only with
    `use_sliding_window`, on the layers `layer_types` marks; without `layer_types`, HF derives
    them: layer i slides when i >= max_window_layers.
    """
    if arch == "LlamaForCausalLM":
        return None, None
    # An absent key takes the config class's default (4096 in MistralConfig and Qwen2Config
    # alike, 4.x and 5.x); only an explicit null turns the window off.
    window = cfg.get("sliding_window", _HF_DEFAULT_WINDOW)
    if arch == "MistralForCausalLM":
        return (None if window is None else int(window)), None
    if not cfg.get("use_sliding_window", False) or window is None:
        return None, None
    types = cfg.get("layer_types")
    if types is None:
        first = int(cfg.get("max_window_layers", _HF_DEFAULT_MAX_WINDOW_LAYERS))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return int(window), list(types)


def _eos_ids(cfg: dict[str, Any], gen: dict[str, Any] | None) -> list[int]:
    ids: list[int] = []
    for src in (cfg, gen or {}):
        e = src.get("eos_token_id")
        for i in e if isinstance(e, list) else [e]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids
