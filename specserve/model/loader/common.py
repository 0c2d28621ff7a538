"""Pieces every loader shares: building an empty model, filling it, loading a tokenizer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from specserve.model.config import ModelConfig
from specserve.model.errors import ModelLoadError
from specserve.model.registry import get_model_class


@dataclass
class LoadedModel:
    model: nn.Module  # eval mode, on the requested device and dtype
    config: ModelConfig
    tokenizer: Any  # transformers PreTrainedTokenizerBase (chat_template when the model has one)
    name: str


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Model with allocated but uninitialised weights: no time spent on random init we overwrite."""
    cls = get_model_class(config.architecture)
    with _default_dtype(dtype), torch.device("meta"):
        model = cls(config)
    return model.to_empty(device=device).requires_grad_(False).eval()


def build_meta_model(config: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Shapes only (meta device): inspect a large config without allocating it."""
    cls = get_model_class(config.architecture)
    with _default_dtype(dtype), torch.device("meta"):
        return cls(config).eval()


def fill_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    total: int | None,
    progress: bool,
    source: str,
) -> None:
    """Load HF-named tensors into the model; every parameter must be covered."""
    bar = tqdm(weights, total=total, desc="loading weights", unit="tensor", disable=not progress)
    try:
        loaded = model.load_weights(bar)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{source}: {e.args[0] if e.args else e}") from None
    finally:
        bar.close()
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"{source}: checkpoint is missing {len(missing)} weights: {shown}")


def load_tokenizer(path: Path, **kwargs: Any) -> Any:
    """AutoTokenizer from local files, with a ModelLoadError instead of a traceback."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, **kwargs)
    except Exception as e:  # transformers raises many types for missing/broken files
        raise ModelLoadError(f"could not load a tokenizer from {path}: {e}") from None
