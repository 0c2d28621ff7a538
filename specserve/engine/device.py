"""Which device and dtype an engine runs on: CUDA with bf16 when present, else CPU with fp32;
and the collector's view of what an engine built at start-up."""

from __future__ import annotations

import gc

import torch

from specserve.sampling_params import InvalidRequestError


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in table:
        raise InvalidRequestError(f"unknown dtype {dtype!r}; use one of {sorted(table)}", "dtype")
    return table[dtype]


def freeze_startup_objects() -> None:
    """What start-up built (model, tokenizer vocabulary, graphs) lives as long as the engine: out
    of the collector's sight, a full collection mid-run walks only the requests' objects (a
    ~0.3 s host stall in a step of the 256-request H200 run looked like one)."""
    gc.collect()
    gc.freeze()


def release_dropped_engines(device: torch.device) -> None:
    """Before a new engine sizes its KV cache: frozen objects are never collected, so an engine
    dropped after freeze_startup_objects() (engines hold reference cycles) would keep its
    weights and KV cache on the device for good. Unfreeze, collect, return the cached blocks."""
    if gc.get_freeze_count() == 0:
        return
    gc.unfreeze()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
