"""The linear dispatch (specserve.ops.gemv, ops.pdl) off the GPU: F.linear exactly, no triton
import.

The GEMV kernel itself runs here in Triton's interpreter; compiled, on the device
(tests/gpu/test_triton_gemv.py)."""

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


@pytest.mark.parametrize("rows_switch", [True, False])
def test_the_gemv_serves_up_to_max_rows(rows_switch, monkeypatch) -> None:
    """Where PDL runs, 1 to MAX_ROWS rows take Triton (one weight read for a verify step's
    rows); more rows, or more than one with $SPECSERVE_GEMV_ROWS=0, take F.linear."""
    from specserve import env

    monkeypatch.setattr(gemv, "pdl_enabled", lambda x: True)  # the dispatch alone, no GPU
    w = torch.zeros(16, 8, dtype=torch.bfloat16)
    with env.override(gemv_rows=rows_switch):
        for rows in range(1, gemv.MAX_ROWS + 2):
            x = torch.zeros(rows, 8, dtype=torch.bfloat16)
            want = rows == 1 or (rows <= gemv.MAX_ROWS and rows_switch)
            assert gemv.gemv_eligible(x, w, None) == want, rows
            assert gemv.glu_eligible(x, w) == want, rows


_INTERPRETED = """
import os
os.environ["TRITON_INTERPRET"] = "1"  # before triton reads it: the kernel runs on the CPU
import torch
import torch.nn.functional as F
from specserve import env
from specserve.ops import gemv, triton_gemv

def launch(x, w, paired, whole):
    with env.override(gemv_whole_k=whole):
        plan = gemv.GemvPlan(w.shape[0] // (1 + paired), w.shape[1], x.device, paired)
    out = torch.empty(1, plan.n)
    triton_gemv._gemv_kernel[plan.grid](
        x, w, out, plan.part, plan.count, N=plan.n, NQ=plan.rows, K=plan.k,
        BLOCK_N=gemv.BLOCK_N, BLOCK_K=gemv.BLOCK_K, SPLIT_K=plan.split_k, K_PER=plan.k_per,
        MODE=int(paired), WHOLE_K=plan.whole_k, GDC=False)
    assert int(plan.count.sum()) == 0  # the split-K counters are back at zero
    return out, plan

gen = torch.Generator().manual_seed(0)
for n, k, whole in ((100, 300, True), (100, 300, False), (26, 1100, False)):
    w = torch.randn(n, k, generator=gen) / k**0.5
    x = torch.randn(1, k, generator=gen)
    out, plan = launch(x, w, False, whole)
    assert (plan.whole_k > 0) == whole and (plan.split_k > 1) == (not whole)
    torch.testing.assert_close(out, F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert torch.equal(launch(x, w, False, whole)[0], out)  # the same sums again
    glu, _ = launch(x, w, True, whole)
    full = F.linear(x, w)
    want = F.silu(full[:, : n // 2]) * full[:, n // 2 :]
    torch.testing.assert_close(glu, want, atol=1e-5, rtol=1e-5)

def launch_rows(x, w, paired):
    plan = gemv.RowsPlan(w.shape[0] // (1 + paired), w.shape[1], x.device, paired)
    out = torch.empty(x.shape[0], plan.n)
    triton_gemv._rows_kernel[plan.grid](
        x, w, out, plan.part, plan.count, x.shape[0], N=plan.n, NQ=plan.rows, K=plan.k,
        ROWS=gemv.TILE_ROWS, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, SPLIT_K=plan.split_k,
        K_PER=plan.k_per, MODE=int(paired), GDC=False)
    assert int(plan.count.sum()) == 0
    return out, plan

for n, k in ((100, 300), (26, 1100)):
    w = torch.randn(n, k, generator=gen) / k**0.5
    x = torch.randn(5, k, generator=gen)
    out, plan = launch_rows(x, w, False)
    assert plan.split_k > 1 and plan.grid[0] * plan.block_n >= n
    torch.testing.assert_close(out, F.linear(x, w), atol=1e-5, rtol=1e-5)
    for m in (1, 2, 4):  # fewer rows: the same results for those rows
        assert torch.equal(launch_rows(x[:m], w, False)[0], out[:m]), m
    glu, _ = launch_rows(x, w, True)
    full = F.linear(x, w)
    want = F.silu(full[:, : n // 2]) * full[:, n // 2 :]
    torch.testing.assert_close(glu, want, atol=1e-5, rtol=1e-5)
print("ok")
"""


def test_the_gemv_kernel_interpreted_on_the_cpu() -> None:
    """The kernels themselves (not just their dispatch) in Triton's interpreter: the one-row
    GEMV and the rows kernel against F.linear, whole and split K, the GLU epilogue, counters
    back at zero, a row's result independent of the row count (the GPU suite checks them
    compiled, in bf16, under PDL)."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
