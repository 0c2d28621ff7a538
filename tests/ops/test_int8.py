"""Int8 linear kernels (specserve.ops.int8) against dequantized references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.ops.int8 import (
    INT8PACK_MAX_ROWS,
    QMAX,
    dequantize,
    dynamic_int8_linear,
    quantize_activations,
    quantize_per_row,
    weight_only_linear,
)


def _weights(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes: per-row scales must follow them
    return torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 64), seed=st.integers(0, 2**16))
def test_per_row_quantization_error_is_at_most_half_a_step(n: int, k: int, seed: int) -> None:
    w = _weights(n, k, seed)
    q, scale = quantize_per_row(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (n,)
    assert int(q.abs().max()) <= QMAX
    err = (dequantize(q, scale) - w).abs()
    # half a step, plus float32 rounding of w / scale and q * scale (a few ulps of |w|): a
    # quotient a hair from x.5 may round either way
    eps = torch.finfo(torch.float32).eps
    assert (err <= scale[:, None] / 2 + 4 * eps * (w.abs() + scale[:, None])).all()


def test_zero_rows_quantize_to_zero() -> None:
    w = torch.zeros(3, 8)
    w[1] = 1.0
    q, scale = quantize_per_row(w)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert not q[0].any() and not q[2].any()


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What weight-only int8 computes: bf16 activations times the dequantized weights."""
    q, scale = quantize_per_row(w)
    return F.linear(x.to(torch.bfloat16).float(), dequantize(q, scale))


def _args(w: torch.Tensor):
    q, scale = quantize_per_row(w)
    return q, q.to(torch.bfloat16), scale, torch.ones(w.shape[0], dtype=torch.bfloat16)


@pytest.mark.parametrize("rows", [0, 1, 3, INT8PACK_MAX_ROWS, INT8PACK_MAX_ROWS + 1, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_linear_matches_dequantized_reference(rows: int, dtype) -> None:
    w = _weights(48, 96, seed=rows)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(7)).to(dtype)
    y = weight_only_linear(x, *_args(w))
    assert y.shape == (rows, 48) and y.dtype == dtype
    ref = _reference(x, w)
    # one bf16 rounding of each output (relative 2^-8 with the accumulation), bf16 x if asked
    tol = 8e-3 * ref.abs().amax(dim=1, keepdim=True).clamp_min(1e-6)
    assert ((y.float() - ref).abs() <= tol).all()


def test_weight_only_rows_do_not_depend_on_the_batch_up_to_int8pack_rows() -> None:
    """A request's row gives the same bits alone or beside others (one kernel up to
    INT8PACK_MAX_ROWS rows): a verify step's anchor row equals the plain step's."""
    w = _weights(64, 128, seed=3)
    x = torch.randn(INT8PACK_MAX_ROWS, 128, generator=torch.Generator().manual_seed(1))
    args = _args(w)
    together = weight_only_linear(x, *args)
    for i in range(x.shape[0]):
        assert torch.equal(weight_only_linear(x[i : i + 1], *args)[0], together[i])


def test_weight_only_kernels_agree_but_for_rare_last_bits() -> None:
    """Rows through int8pack_mm (<= INT8PACK_MAX_ROWS at once) and through the bf16 GEMM give
    the same bf16 products up to the order of fp32 sums: a verify step's rows match a plain
    step's but for a rare last bit."""
    w = _weights(512, 576, seed=9)
    x = torch.randn(4 * INT8PACK_MAX_ROWS, 576, generator=torch.Generator().manual_seed(3))
    args = _args(w)
    gemm = weight_only_linear(x, *args)
    pack = torch.cat([weight_only_linear(c, *args) for c in x.split(INT8PACK_MAX_ROWS)])
    differ = gemm != pack
    assert float(differ.float().mean()) < 1e-3
    ulp = 2**-7 * pack.abs()  # one bf16 ulp of the product, at most
    assert ((gemm - pack).abs() <= ulp).all()


@pytest.mark.parametrize("rows", [0, 1, 5, 33])
def test_dynamic_int8_linear_is_exact_integer_arithmetic(rows: int) -> None:
    w = _weights(40, 72, seed=rows)
    x = torch.randn(rows, 72, generator=torch.Generator().manual_seed(2)) * 3
    q, scale = quantize_per_row(w)
    y = dynamic_int8_linear(x, q.t(), scale)
    assert y.shape == (rows, 40)
    xq, sx = quantize_activations(x)
    assert xq.dtype == torch.int8 and (xq.int().abs() <= QMAX).all()
    # integer products summed in float64 are exact here (|acc| < 2^53)
    acc = xq.double() @ q.double().t()
    assert torch.allclose(y.double(), acc * sx.double() * scale.double(), rtol=1e-6, atol=0)
    # and close to the full-precision product: both operands carry half a step of error
    ref = F.linear(x, w)
    tol = 0.03 * ref.abs().amax(dim=1, keepdim=True).clamp_min(1e-6)
    assert ((y - ref).abs() <= tol).all()


def test_dynamic_int8_rows_do_not_depend_on_the_batch() -> None:
    w = _weights(32, 64, seed=5)
    q, scale = quantize_per_row(w)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(4))
    together = dynamic_int8_linear(x, q.t(), scale)
    for i in (0, 7, 19):
        assert torch.equal(dynamic_int8_linear(x[i : i + 1], q.t(), scale)[0], together[i])
