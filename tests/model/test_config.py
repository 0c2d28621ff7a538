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
