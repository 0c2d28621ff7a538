"""The one-row GEMV and the rows kernel of 2 to MAX_ROWS rows (specserve.ops.gemv / triton_gemv)
and PDL launches, against F.linear; a row's result independent of the other rows, to the bit;
the GLU epilogue (silu-and-mul) against the plain launch and the separate kernel, to the bit.

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
@pytest.mark.parametrize("whole_k", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_gemv_matches_linear(pdl_cuda, n, k, dtype, whole_k, rows, monkeypatch) -> None:
    """Either way of reading K (the whole slice before the wait where K is small, or split K
    tiles) gives F.linear's values, and the same sums call after call."""
    monkeypatch.setattr(env.settings, "gemv_whole_k", whole_k)
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(pdl_cuda, dtype)
    x = torch.randn(rows, k, generator=gen).to(pdl_cuda, dtype)
    want = F.linear(x.float(), w.float())
    assert gemv.gemv_eligible(x, w, None)
    first = gemv.linear(x, w, None)
    assert first.shape == (rows, n) and first.dtype == dtype
    _close(first, want)
    again = gemv.linear(x, w, None)  # the split-K counters are back at zero: the same sum
    assert torch.equal(first, again)
    plan = gemv._plan(n, k, pdl_cuda, m=rows)
    assert int(plan.count.sum()) == 0
    if rows == 1:
        assert (plan.whole_k > 0) == (whole_k and k <= gemv.WHOLE_K_MAX)


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (576, 1536), (13, 1000)])
def test_a_rows_result_does_not_depend_on_the_other_rows(pdl_cuda, n, k) -> None:
    """Every row count from 2 to MAX_ROWS: each row's output is the same bits (a verify row's
    logits do not depend on how many rows its step verifies), for the GLU too; close to the
    one-row GEMV's (a different summation order)."""
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(pdl_cuda, torch.bfloat16)
    x = torch.randn(gemv.MAX_ROWS, k, generator=gen).to(pdl_cuda, torch.bfloat16)
    full = gemv.gemv(x, w)
    glu = gemv.gemv_glu(x, w) if n % 2 == 0 else None
    for rows in range(2, gemv.MAX_ROWS):
        assert torch.equal(gemv.gemv(x[:rows], w), full[:rows]), rows
        assert glu is None or torch.equal(gemv.gemv_glu(x[:rows], w), glu[:rows]), rows
    shuffled = gemv.gemv(x.flip(0), w).flip(0)  # other rows' values around each row
    assert torch.equal(shuffled, full)
    _close(torch.cat([gemv.gemv(x[m : m + 1], w) for m in range(4)]), full[:4])
    assert int(gemv._plan(n, k, pdl_cuda, m=2).count.sum()) == 0


# [2I, K]: Llama-3.1-8B and SmolLM2 gate_up (K split 1 and 4), partial tiles in I and K
GLU_SHAPES = [(28672, 4096), (3072, 576), (200, 300), (26, 1000)]


@pytest.mark.parametrize("two_i,k", GLU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("whole_k", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_glu_gemv_equals_the_gemv_then_silu_and_mul(
    pdl_cuda, two_i, k, dtype, whole_k, rows, monkeypatch
) -> None:
    """One launch with silu-and-mul in the epilogue: bit for bit what the GEMV of the stacked
    weight followed by the fused silu-and-mul kernel gives."""
    monkeypatch.setattr(env.settings, "gemv_whole_k", whole_k)
    gen = torch.Generator().manual_seed(two_i + k)
    w = (torch.randn(two_i, k, generator=gen) / k**0.5).to(pdl_cuda, dtype)
    x = torch.randn(rows, k, generator=gen).to(pdl_cuda, dtype)
    assert gemv.glu_eligible(x, w)
    want = fused.silu_and_mul(gemv.gemv(x, w))
    got = gemv.gemv_glu(x, w)
    assert got.shape == (rows, two_i // 2) and got.dtype == dtype
    assert torch.equal(got, want)
    assert torch.equal(gemv.gemv_glu(x, w), got)  # counters back at zero: the same sums again
    assert int(gemv._plan(two_i // 2, k, pdl_cuda, paired=True, m=rows).count.sum()) == 0
    full = F.linear(x.float(), w.float())
    _close(got, F.silu(full[:, : two_i // 2]) * full[:, two_i // 2 :])


@torch.inference_mode()  # as the engine runs: under autograd the MLP keeps the torch ops
def test_the_mlp_runs_one_glu_gemv_up_to_max_rows(pdl_cuda, monkeypatch) -> None:
    from specserve.model.layers import GatedMLP

    torch.manual_seed(0)
    mlp = GatedMLP(256, 768).to(pdl_cuda, torch.bfloat16)
    x = torch.randn(1, 256, device=pdl_cuda, dtype=torch.bfloat16)
    calls = []
    glu = gemv.gemv_glu
    monkeypatch.setattr("specserve.model.layers.gemv_glu", lambda *a: calls.append(1) or glu(*a))
    got = mlp(x)
    assert calls == [1]
    want = mlp.down_proj(fused.silu_and_mul(mlp.gate_up_proj(x)))
    assert torch.equal(got, want)
    mlp(x.expand(gemv.MAX_ROWS, -1).contiguous())
    assert calls == [1, 1]
    mlp(x.expand(gemv.MAX_ROWS + 1, -1).contiguous())  # past it: the projection and silu-and-mul
    monkeypatch.setattr(env.settings, "fused_ops", False)
    mlp(x)
    assert calls == [1, 1]


@pytest.mark.parametrize("model", ["dummy:tiny", "dummy:smollm2-135m"])
def test_decoding_with_the_epilogues_equals_separate_kernels(pdl_cuda, model, monkeypatch) -> None:
    """Whole runs, graphs and overlap as served: the same tokens and logprobs, to the bit, with
    the GEMV epilogue (one-row steps) as with the separate silu-and-mul kernel."""
    from specserve import LLM, SamplingParams
    from specserve.model import layers

    calls: list[int] = []
    real = layers.gemv_glu
    monkeypatch.setattr(layers, "gemv_glu", lambda *a: calls.append(1) or real(*a))
    prompts = [[7 + (31 * i) % 40000 for i in range(n)] for n in (5, 40, 130)]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = []
    for epilogues in (True, False):
        with env.override(gemv_epilogues=epilogues):
            llm = LLM(model, dtype="bfloat16", max_num_seqs=1, max_model_len=512,
                      kv_cache_memory_gb=0.5, progress=False)  # fmt: skip
            outs = llm.generate(prompts, sp, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        del llm
        if epilogues:  # captured into the graphs (and run by eager one-row steps)
            assert calls
            calls.clear()
    assert not calls
    assert runs[0] == runs[1]


def test_up_to_max_rows_without_bias_take_the_gemv(pdl_cuda, monkeypatch) -> None:
    w = torch.randn(64, 32, device=pdl_cuda, dtype=torch.bfloat16)
    x1 = torch.randn(1, 32, device=pdl_cuda, dtype=torch.bfloat16)
    assert gemv.gemv_eligible(x1, w, None)
    rows = x1.expand(gemv.MAX_ROWS, -1).contiguous()
    assert gemv.gemv_eligible(rows, w, None)
    assert not gemv.gemv_eligible(torch.cat([rows, x1]), w, None)  # past MAX_ROWS: cuBLAS
    with env.override(gemv_rows=False):
        assert gemv.gemv_eligible(x1, w, None)
        assert not gemv.gemv_eligible(rows[:2], w, None)
    assert not gemv.gemv_eligible(x1, w, torch.zeros(64, device=pdl_cuda, dtype=w.dtype))
    assert not gemv.gemv_eligible(x1.float(), w.float(), None)  # fp32: cuBLAS
    assert not gemv.gemv_eligible(x1.cpu(), w.cpu(), None)
    monkeypatch.setattr(env.settings, "gemv", False)
    assert not gemv.gemv_eligible(x1, w, None)


@pytest.mark.parametrize("rows", [1, 5])
def test_a_pdl_chain_in_a_cuda_graph_matches_eager_launches(pdl_cuda, rows, monkeypatch) -> None:
    """A layer chain of one row (the GEMV) or five (the rows kernel), every kernel launched with
    PDL (fused norms, the linears, the GLU epilogue), captured in a CUDA graph and replayed with new inputs: the same values as the same
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
            if gemv.glu_eligible(h, gate_up):
                a = gemv.gemv_glu(h, gate_up)
            else:
                a = fused.silu_and_mul(gemv.linear(h, gate_up, None))
            x = gemv.linear(a, down, None)
        return x + residual

    inputs = [torch.randn(rows, hidden, generator=gen).to(dev, dt) for _ in range(3)]
    static_in = inputs[0].clone()
    chain(static_in)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = chain(static_in)
    monkeypatch.setattr(env.settings, "pdl", False)  # the reference: cuBLAS, silu-and-mul, no PDL
    for x in inputs:
        static_in.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out.float(), chain(x).float(), atol=5e-2, rtol=5e-2)
