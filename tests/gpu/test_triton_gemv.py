"""The few-row GEMV (specserve.ops.linear / triton_gemv) against F.linear and silu_and_mul.

    pytest -m gpu tests/gpu/test_triton_gemv.py                       # needs CUDA, or:
    TRITON_INTERPRET=1 pytest -m gpu tests/gpu/test_triton_gemv.py    # kernel on the CPU

Both accumulate in fp32, in different orders: results agree to bf16 rounding of the output
(checked against a float64 product of the same inputs, where the kernel must be at least as
close as cuBLAS is, up to one ulp).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from specserve.ops import fused, linear
from tests.gpu.conftest import interpreting

DTYPE = torch.bfloat16


@pytest.fixture
def set_gemv(cuda: torch.device, monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
    def set_(on: bool) -> None:
        monkeypatch.setenv(linear.ENV_SWITCH, "1" if on else "0")
        if cuda.type != "cuda":  # interpreter: CPU tensors, follow the switch
            monkeypatch.setattr(linear, "_enabled", lambda x: on)
            monkeypatch.setattr(fused, "_enabled", lambda x: False)

    return set_


@pytest.fixture
def gemv_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = linear._kernels
    monkeypatch.setattr(linear, "_kernels", lambda: calls.append(1) or real())
    return calls


def _randn(*shape: int, device: torch.device, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=DTYPE)


def _ulp(x: torch.Tensor) -> torch.Tensor:  # bf16 spacing at |x|: 8 bits of mantissa
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


def _check(got: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor) -> None:
    err, ref_err = (got.double() - exact).abs(), (ref.double() - exact).abs()
    slack = 2 * _ulp(exact) if interpreting() else _ulp(exact)  # interpreter: truncating casts
    assert bool((err <= ref_err + slack + 1e-6).all()), float((err - ref_err).max())


SHAPES = [(96, 64), (384, 256), (4096 + 64, 512)]  # (N, K): tiny, SmolLM2-ish, a wide slab
if not interpreting():
    SHAPES += [(6144, 4096), (4096, 4096), (28672, 4096)]  # the 8B's qkv, o, gate_up


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_matches_f_linear(cuda, set_gemv, gemv_calls, m, n, k) -> None:
    set_gemv(True)
    x = _randn(m, k + 32, device=cuda, seed=m)[:, :k]  # a row slice: the row stride is honoured
    w = _randn(n, k, device=cuda, seed=n + k, scale=k**-0.5)
    got = linear.linear(x, w)
    assert len(gemv_calls) == 1 and got.shape == (m, n) and got.dtype == DTYPE
    _check(got, F.linear(x, w), x.double() @ w.double().T)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize(
    "n,inter", [(64, 128), (576, 1536)] + ([] if interpreting() else [(4096, 14336)])
)
def test_gated_gemv_folds_silu_and_mul(cuda, set_gemv, gemv_calls, m, n, inter) -> None:
    set_gemv(True)
    gate_up = _randn(m, 2 * inter, device=cuda, seed=m, scale=2.0)
    w = _randn(n, inter, device=cuda, seed=n, scale=inter**-0.5)
    got = linear.gated_linear(gate_up, w)
    assert len(gemv_calls) == 1
    act = fused.silu_and_mul_reference(gate_up)  # the activation, rounded as the model rounds it
    if not interpreting():
        # the kernel's activation is silu_and_mul's bit for bit: the same product as F.linear's
        _check(got, F.linear(act, w), act.double() @ w.double().T)
    else:
        torch.testing.assert_close(got, F.linear(act, w), atol=3e-2, rtol=4e-2)


@pytest.mark.gpu
def test_dispatch_falls_back_to_f_linear(cuda, set_gemv, gemv_calls) -> None:
    set_gemv(True)
    w = _randn(64, 128, device=cuda, seed=0)
    many = _randn(linear.GEMV_MAX_ROWS + 1, 128, device=cuda, seed=1)
    torch.testing.assert_close(linear.linear(many, w), F.linear(many, w))  # too many rows
    odd_k = _randn(64, 100, device=cuda, seed=2)
    linear.linear(_randn(1, 100, device=cuda, seed=3), odd_k)  # K not a multiple of 64
    bias = _randn(64, device=cuda, seed=4)
    linear.linear(_randn(1, 128, device=cuda, seed=5), w, bias)  # bias: cuBLAS epilogue
    assert gemv_calls == []
    set_gemv(False)
    linear.linear(_randn(1, 128, device=cuda, seed=6), w)
    assert gemv_calls == []
    set_gemv(True)
    assert linear.linear(_randn(0, 128, device=cuda, seed=7), w).shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3])
def test_model_decode_rows_through_the_gemv(cuda, set_gemv, gemv_calls, rows) -> None:
    """A 2-layer model's decode rows: GEMV path vs $SPECSERVE_GEMV=0 (cuBLAS), same logits up to
    bf16 rounding; every projection of every layer took the GEMV (qkv, o, gate_up, down)."""
    from specserve.model.forward_context import KVCache
    from tests.gpu.test_triton_fused import _tiny_model
    from tests.model.harness import build_ctx

    model, cfg = _tiny_model(cuda, DTYPE, qk_norm=False)
    shape = (8, 16, cfg.num_key_value_heads, cfg.head_dim)
    gen = torch.Generator().manual_seed(0)
    history = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))] * 2
    ctx = build_ctx([1] * rows, [9 + i for i in range(rows)], [[1 + i] for i in range(rows)], 16)
    for f in ("query_lens", "cu_query_lens", "context_lens", "block_tables", "slot_mapping"):
        setattr(ctx, f, getattr(ctx, f).to(cuda))
    ids = torch.randint(0, cfg.vocab_size, (rows,), generator=gen).to(cuda)
    positions = torch.tensor([8 + i for i in range(rows)], device=cuda)

    def run() -> torch.Tensor:
        caches = [KVCache(k.to(cuda, DTYPE), v.to(cuda, DTYPE)) for k, v in history]
        return model.compute_logits(model(ids, positions, caches, ctx))

    set_gemv(False)
    ref = run()
    set_gemv(True)
    got = run()
    assert len(gemv_calls) == 4 * cfg.num_hidden_layers
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=3e-2)
