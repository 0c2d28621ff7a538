"""The linear dispatch (specserve.ops.gemv, ops.pdl) off the GPU: F.linear exactly, no triton.

The GEMV kernel itself is checked on the device (tests/gpu/test_triton_gemv.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from specserve.model.layers import Linear
from specserve.ops import gemv
from specserve.ops.pdl import launch_options, pdl_enabled


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_linear_is_f_linear(rows, bias, dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    layer = Linear(24, 40, bias=bias).to(dtype)
    x = torch.randn(rows, 24, generator=gen).to(dtype)
    assert not gemv.gemv_eligible(x, layer.weight, layer.bias)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_no_pdl_off_cuda() -> None:
    x = torch.zeros(1, 8, dtype=torch.bfloat16)
    assert not pdl_enabled(x)
    assert launch_options(x) == {"GDC": False}  # kernels launch plainly, no launch_pdl


def test_linear_keeps_the_nn_linear_state_dict() -> None:
    """Checkpoints load by name: the subclass must not rename or add parameters."""
    ours, theirs = Linear(8, 4, bias=True), torch.nn.Linear(8, 4, bias=True)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 8)
    assert torch.equal(ours(x), theirs(x))


def test_one_row_bf16_on_cpu_never_imports_triton() -> None:
    code = (
        "import sys, torch\n"
        "from specserve.model.layers import Linear\n"
        "Linear(16, 8, bias=False).to(torch.bfloat16)(torch.ones(1, 16, dtype=torch.bfloat16))\n"
        "assert 'triton' not in sys.modules, 'triton imported on CPU'\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
