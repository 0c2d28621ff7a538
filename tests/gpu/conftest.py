"""GPU test fixtures: `cuda` is the device to run on, or a skip where there is none.

TRITON_INTERPRET=1 (with triton installed) runs the Triton kernels on the CPU through Triton's
interpreter, so kernel logic can be checked on a machine without a GPU (slowly: small cases).
"""

from __future__ import annotations

import os

import pytest
import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def cuda() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if interpreting():
        return torch.device("cpu")
    pytest.skip("needs a CUDA device")
