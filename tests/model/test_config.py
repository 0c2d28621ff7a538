"""ModelConfig.from_hf across transformers 4.x / 5.x config.json shapes, and rope scaling."""

from __future__ import annotations

import pytest
import torch

from specserve.model.config import ModelConfig
from specserve.model.errors import ModelLoadError
from specserve.model.layers import rope_inv_freq

BASE = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_transformers_4x_shape() -> None:
    cfg = ModelConfig.from_hf(
        {
            **BASE,
            "architectures": ["MistralForCausalLM"],
            "rope_theta": 1e6,
            "rope_scaling": {"type": "linear", "factor": 2.0},
            "eos_token_id": 2,
        },
        {"eos_token_id": [2, 7]},
    )
    assert cfg.architecture == "MistralForCausalLM" and cfg.head_dim == 16
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {
        "type": "linear",
        "factor": 2.0,
        "rope_type": "linear",
    }
    assert cfg.eos_token_ids == [2, 7] and not cfg.attention_bias and not cfg.qk_norm


def test_transformers_5x_rope_parameters() -> None:
    cfg = ModelConfig.from_hf(
        {
            **BASE,
            "architectures": ["Qwen3ForCausalLM"],
            "head_dim": 32,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
        }
    )
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling is None
    assert cfg.qk_norm and cfg.head_dim == 32


def test_qwen2_has_qkv_bias_and_model_type_fallback() -> None:
    assert ModelConfig.from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"]}).attention_bias
    assert ModelConfig.from_hf({**BASE, "model_type": "llama"}).architecture == "LlamaForCausalLM"


@pytest.mark.parametrize(
    ("patch", "match"),
    [
        ({"architectures": ["GPTNeoXForCausalLM"]}, "unsupported architecture"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope scaling"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "multiple"),
    ],
)
def test_rejected(patch: dict, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_hf({**BASE, "architectures": ["LlamaForCausalLM"], **patch})


def test_missing_field_is_a_load_error() -> None:
    with pytest.raises(ModelLoadError, match="intermediate_size"):
        ModelConfig.from_hf(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 1,
                "hidden_size": 8,
                "num_attention_heads": 2,
            }
        )


def test_rope_scalings_match_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    for scaling in (llama3, {"rope_type": "linear", "factor": 4.0}):
        hf_cfg = LlamaConfig(
            hidden_size=1024,
            num_attention_heads=8,
            max_position_embeddings=131072,
            rope_parameters={**scaling, "rope_theta": 500000.0},
        )
        want, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, torch.device("cpu"))
        got = rope_inv_freq(128, 500000.0, scaling)
        torch.testing.assert_close(got, want, atol=0, rtol=0)


# Window settings as config.json may carry them; the expected per-layer windows come from the
# transformers config class itself (what its modeling code reads), not from our own rules.
WINDOW_CONFIGS = [
    ("MistralForCausalLM", {"sliding_window": 4096}),
    ("MistralForCausalLM", {"sliding_window": None}),
    ("MistralForCausalLM", {}),  # absent: the class default (4096)
    ("MistralForCausalLM", {"sliding_window": 8, "layer_types": ["full_attention"] * 4}),
    ("Qwen2ForCausalLM", {"use_sliding_window": False, "sliding_window": 8}),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 9}),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "max_window_layers": 0}),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": None}),
    (
        "Qwen3ForCausalLM",
        {
            "use_sliding_window": True,
            "sliding_window": 5,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
    ),
    (
        "Qwen3ForCausalLM",
        {"use_sliding_window": False, "layer_types": ["sliding_attention"] * 4},
    ),
    ("LlamaForCausalLM", {"sliding_window": 8}),  # Llama's modeling has no window
]


def _hf_layer_windows(arch: str, fields: dict) -> list[int]:
    import transformers

    if arch == "LlamaForCausalLM":
        return [0] * 4
    hf = getattr(transformers, arch.replace("ForCausalLM", "Config"))(
        **{**BASE, "num_hidden_layers": 4, **fields}
    )
    if hf.sliding_window is None:
        return [0] * 4
    if arch == "MistralForCausalLM":  # MistralAttention: config.sliding_window, every layer
        return [hf.sliding_window] * 4
    return [hf.sliding_window if t == "sliding_attention" else 0 for t in hf.layer_types]


@pytest.mark.parametrize(("arch", "fields"), WINDOW_CONFIGS)
def test_sliding_window_layers_match_transformers(arch: str, fields: dict) -> None:
    cfg = ModelConfig.from_hf({**BASE, "num_hidden_layers": 4, "architectures": [arch], **fields})
    windows = [cfg.layer_window(i) for i in range(4)]
    assert windows == _hf_layer_windows(arch, fields)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"sliding_window": 0}, "sliding_window=0"),
        ({"sliding_window": 8, "layer_types": ["sliding_attention"]}, "layer_types has 1"),
        ({"sliding_window": 8, "layer_types": ["chunked_attention"] * 2}, "chunked_attention"),
    ],
)
def test_bad_window_settings_are_load_errors(fields: dict, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_hf(
            {**BASE, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, **fields}
        )
