"""`dummy:<preset-or-hf-dir>`: real shapes, random weights (benchmarks and tests, no download)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specserve.model.config import ModelConfig
from specserve.model.errors import ModelLoadError
from specserve.model.loader.common import LoadedModel, build_empty_model
from specserve.model.loader.hf_dir import read_hf_config

# HF config.json shapes. Vocabularies are >= SmolLM2's 49152 so its tokenizer's ids always fit.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "tiny": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}
DUMMY_PREFIX = "dummy:"
SEED = 0


def dummy_config(spec: str) -> ModelConfig:
    """Config for the part after `dummy:`: a preset name or a HF folder with config.json."""
    if spec in PRESETS:
        return ModelConfig.from_hf(PRESETS[spec])
    path = Path(spec).expanduser()
    if path.is_dir():
        return read_hf_config(path)
    raise ModelLoadError(
        f"dummy:{spec}: not a preset ({', '.join(PRESETS)}) nor a folder with config.json"
    )


@torch.no_grad()
def init_random_(model: torch.nn.Module, seed: int = SEED) -> None:
    """std-0.02 normals for matrices and biases, ones for norms; same seed -> same weights."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    device_gen: torch.Generator | None = None
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.device.type == "cpu":
            # CPU: the same weights on every machine (tests rely on it)
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.02)
        else:
            # an accelerator samples in place: an 8B model drawn on the host takes minutes
            if device_gen is None:
                device_gen = torch.Generator(device=p.device).manual_seed(seed)
            p.normal_(0.0, 0.02, generator=device_gen)


def load_dummy(spec: str, dtype: torch.dtype, device: torch.device, tokenizer: Any) -> LoadedModel:
    config = dummy_config(spec)
    model = build_empty_model(config, dtype, device)
    init_random_(model)
    return LoadedModel(model, config, tokenizer, f"{DUMMY_PREFIX}{spec}")
