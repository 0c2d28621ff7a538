"""Which device and dtype an engine runs on: CUDA with bf16 when present, else CPU with fp32."""

from __future__ import annotations

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
