"""A tiny target worth training a head for: three layers (EAGLE-3's default layer ids 2, 1, 0
are all distinct and valid) and wide random weights, so its next-token distributions are
peaked and its greedy answers vary (dummy models at std 0.02 answer one token forever)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

PROMPTS = [
    "Hello there, how are you?",
    "Write a poem about the sea.",
    "What is 2+2?",
    "Explain gravity to a child.",
    "List three colors.",
    "Tell me a joke about cats.",
    "How do I bake bread?",
    "What is the capital of France?",
    "Name a famous scientist.",
    "Describe a sunset.",
    "Why is the sky blue?",
    "Give me a haiku about rain.",
]


@pytest.fixture(scope="session")
def train_target_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any) -> Path:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    d = tmp_path_factory.mktemp("train_target")
    model.save_pretrained(str(d))
    default_tokenizer.save_pretrained(str(d))
    return d


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    p.write_text("\n".join(PROMPTS) + "\n")
    return p
