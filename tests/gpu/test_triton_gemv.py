"""The one-row GEMV (specserve.ops.gemv / triton_gemv) and PDL launches, against F.linear.

    pytest -m gpu tests/gpu/test_triton_gemv.py      # needs a GPU with PDL (compute capability 9+)

The GEMV sums in fp32 in a different order than cuBLAS, so bf16 outputs may differ by an ulp.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve import env
from specserve.ops import fused, gemv
from specserve.ops.pdl import pdl_enabled

pytestmark = pytest.mark.gpu


@pytest.fixture
def pdl_cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda")
    if not pdl_enabled(torch.empty(1, device=dev)):
        pytest.skip("needs programmatic dependent launch (compute capability 9+, triton gdc)")
    return dev


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1.6e-2)


# (N, K): Llama-3.1-8B qkv, o_proj, gate_up, down; SmolLM2 qkv and down; odd sizes that leave
# partial tiles in N and K and empty K slices
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (960, 576), (576, 1536),
          (100, 300), (13, 1000)]  # fmt: skip


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_matches_linear(pdl_cuda, n, k, dtype) -> None:
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(pdl_cuda, dtype)
    x = torch.randn(1, k, generator=gen).to(pdl_cuda, dtype)
    want = F.linear(x.float(), w.float())
    assert gemv.gemv_eligible(x, w, None)
    first = gemv.linear(x, w, None)
    assert first.shape == (1, n) and first.dtype == dtype
    _close(first, want)
    again = gemv.linear(x, w, None)  # the split-K counters are back at zero: the same sum
    assert torch.equal(first, again)
    assert int(gemv._plan(n, k, pdl_cuda).count.sum()) == 0


def test_only_one_row_without_bias_takes_the_gemv(pdl_cuda, monkeypatch) -> None:
    w = torch.randn(64, 32, device=pdl_cuda, dtype=torch.bfloat16)
    x1 = torch.randn(1, 32, device=pdl_cuda, dtype=torch.bfloat16)
    assert gemv.gemv_eligible(x1, w, None)
    assert not gemv.gemv_eligible(torch.cat([x1, x1]), w, None)  # two rows: cuBLAS
    assert not gemv.gemv_eligible(x1, w, torch.zeros(64, device=pdl_cuda, dtype=w.dtype))
    assert not gemv.gemv_eligible(x1.float(), w.float(), None)  # fp32: cuBLAS
    assert not gemv.gemv_eligible(x1.cpu(), w.cpu(), None)
    monkeypatch.setattr(env.settings, "gemv", False)
    assert not gemv.gemv_eligible(x1, w, None)


def test_a_pdl_chain_in_a_cuda_graph_matches_eager_launches(pdl_cuda, monkeypatch) -> None:
    """A one-row layer chain, every kernel launched with PDL (fused norms, silu-and-mul, the
    GEMVs), captured in a CUDA graph and replayed with new inputs: the same values as the same
    chain without PDL, launched eagerly."""
    gen = torch.Generator().manual_seed(0)
    dev, dt = pdl_cuda, torch.bfloat16
    hidden, inter = 512, 1536

    def mat(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen) / k**0.5).to(dev, dt)

    layers = [(mat(3 * hidden, hidden), mat(hidden, hidden), mat(2 * inter, hidden),
               mat(hidden, inter)) for _ in range(4)]  # fmt: skip
    norm_w = torch.ones(hidden, device=dev, dtype=dt)

    def chain(x: torch.Tensor) -> torch.Tensor:
        residual = None
        for qkv, o, gate_up, down in layers:
            h, residual = fused.add_rms_norm(x, residual, norm_w, 1e-5)
            a = gemv.linear(h, qkv, None)[:, :hidden].contiguous()
            a = gemv.linear(a, o, None)
            h, residual = fused.add_rms_norm(a, residual, norm_w, 1e-5)
            x = gemv.linear(fused.silu_and_mul(gemv.linear(h, gate_up, None)), down, None)
        return x + residual

    inputs = [torch.randn(1, hidden, generator=gen).to(dev, dt) for _ in range(3)]
    static_in = inputs[0].clone()
    chain(static_in)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = chain(static_in)
    monkeypatch.setattr(env.settings, "pdl", False)  # the reference: cuBLAS and plain launches
    for x in inputs:
        static_in.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out.float(), chain(x).float(), atol=5e-2, rtol=5e-2)
