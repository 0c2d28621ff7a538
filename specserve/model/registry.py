"""HF architecture name -> model class."""

from __future__ import annotations

from torch import nn

from specserve.model.errors import ModelLoadError
from specserve.model.llama import LlamaForCausalLM

_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
SUPPORTED_ARCHITECTURES = tuple(_REGISTRY)


def get_model_class(architecture: str) -> type[nn.Module]:
    cls = _REGISTRY.get(architecture)
    if cls is None:
        raise ModelLoadError(
            f"unsupported architecture {architecture!r}; specserve runs {', '.join(_REGISTRY)}"
        )
    return cls
