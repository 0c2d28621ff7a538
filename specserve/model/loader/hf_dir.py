"""Hugging Face model directories: config.json + safetensors (single or sharded) + tokenizer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specserve.model.config import ModelConfig
from specserve.model.errors import ModelLoadError
from specserve.model.loader.common import (
    LoadedModel,
    build_empty_model,
    fill_weights,
    load_tokenizer,
)
from specserve.model.registry import SUPPORTED_ARCHITECTURES


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not read {path}: {e}") from None


def read_hf_config(path: Path) -> ModelConfig:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is a directory without config.json; not a HF model folder")
    gen_path = path / "generation_config.json"
    gen = read_json(gen_path) if gen_path.is_file() else None
    raw = read_json(path / "config.json")
    _refuse_remote_code(raw, path)
    return ModelConfig.from_hf(raw, gen)


def _refuse_remote_code(raw: dict[str, Any], path: Path) -> None:
    """A config whose architecture lives in the repository's own Python (`auto_map`) would need
    trust_remote_code in transformers; specserve runs no remote code, whatever the flag says."""
    archs = raw.get("architectures") or []
    if "auto_map" in raw and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ModelLoadError(
            f"{path}: architecture {archs[0] if archs else '?'!r} is defined by the model's own "
            "code (config.json has auto_map); specserve never runs remote code "
            "(trust_remote_code is accepted but changes nothing) and runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{path}: shards listed in the index are missing: {absent}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} holds no *.safetensors weights")
    return files


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, sf.get_tensor(name)


def _count_tensors(files: list[Path]) -> int:
    from safetensors import safe_open

    n = 0
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            n += len(sf.keys())
    return n


def load_hf_dir(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool,
    name: str | None = None,
    tokenizer: Any = None,
) -> LoadedModel:
    """Load a HF folder. `tokenizer` overrides the folder's own (dummy and GGUF paths use it)."""
    config = read_hf_config(path)
    files = safetensors_files(path)
    try:
        total = _count_tensors(files)
    except Exception as e:  # safetensors raises its own error type for corrupt headers
        raise ModelLoadError(f"{path}: unreadable safetensors file: {e}") from None
    if tokenizer is None:
        tokenizer = load_tokenizer(path)
    model = build_empty_model(config, dtype, device)
    try:
        fill_weights(model, _iter_safetensors(files), total, progress, str(path))
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{path}: failed reading weights: {e}") from None
    return LoadedModel(model, config, tokenizer, name or path.name)
