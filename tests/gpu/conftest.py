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


def steps_without_host_sync(engine, prompts: list, params: list) -> int:
    """Add the requests and step the engine until they end under
    torch.cuda.set_sync_debug_mode("error"): any synchronising call inside a step (a .item(), a
    .tolist() of a device tensor, a pageable copy) raises; the wait for the step in flight
    lifts the mode for itself only (designed_sync). Returns the steps run."""
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    torch.cuda.synchronize()
    steps = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        while engine.has_unfinished():
            engine.step()
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return steps
