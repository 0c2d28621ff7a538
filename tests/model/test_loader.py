"""load_model's sources other than GGUF: errors a user can cause, dummy presets, HF folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specserve.model.config import ModelConfig
from specserve.model.errors import ModelLoadError
from specserve.model.loader import PRESETS, build_meta_model, dummy_config, load_model
from tests.model.harness import PagedRunner

CPU = torch.device("cpu")


def test_unknown_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "nope"), torch.float32, CPU)


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="without config.json"):
        load_model(str(tmp_path), torch.float32, CPU)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="neither"):
        load_model(str(f), torch.float32, CPU)


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(str(tmp_path), torch.float32, CPU)


def test_missing_and_corrupt_weights(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    for f in tiny_llama_dir.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    state = load_file(str(tiny_llama_dir / "model.safetensors"))
    state.pop("model.layers.1.mlp.up_proj.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing 1 weights"):
        load_model(str(tmp_path), torch.float32, CPU, progress=False)
    (tmp_path / "model.safetensors").write_bytes(b"garbage, not safetensors")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(tmp_path), torch.float32, CPU, progress=False)


def test_dummy_tiny_builds_and_runs() -> None:
    a = load_model("dummy:tiny", torch.float32, CPU, progress=False)
    b = load_model("dummy:tiny", torch.float32, CPU, progress=False)
    assert a.name == "dummy:tiny" and a.config.vocab_size >= len(a.tokenizer)
    for (n, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), n  # seeded
    w = a.model.layers[0].self_attn.qkv_proj.weight
    assert 0.015 < float(w.std()) < 0.025
    ids = a.tokenizer("hello world")["input_ids"]
    logits = PagedRunner(a.model, a.config).logits([(0, ids)])
    assert logits.shape == (len(ids), a.config.vocab_size) and torch.isfinite(logits).all()


def test_dummy_from_hf_dir(tiny_llama_dir: Path) -> None:
    d = load_model(f"dummy:{tiny_llama_dir}", torch.float32, CPU, progress=False)
    assert d.config == load_model(str(tiny_llama_dir), torch.float32, CPU, progress=False).config


def test_dummy_unknown_preset() -> None:
    with pytest.raises(ModelLoadError, match="not a preset"):
        load_model("dummy:gpt-17", torch.float32, CPU)


def test_llama_8b_preset_shapes_on_meta() -> None:
    cfg = dummy_config("llama-3.1-8b")
    assert isinstance(cfg, ModelConfig) and cfg.rope_scaling["rope_type"] == "llama3"
    model = build_meta_model(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert 8.0e9 < n < 8.1e9  # Llama 3.1 8B has 8.03 B parameters
    assert all(p.device.type == "meta" for p in model.parameters())
    assert set(PRESETS) >= {"llama-3.1-8b", "smollm2-135m", "tiny"}
    assert dummy_config("smollm2-135m").tie_word_embeddings
