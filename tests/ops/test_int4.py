"""Int4 kernels (specserve.ops.int4) against dequantized fp32 references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.ops.int4 import (
    GROUP,
    INT4PACK_MAX_ROWS,
    dequantize,
    int4_kernels_available,
    int4_linear,
    pack,
    quantize_groups,
)


def _weights(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes, off centre: groups need their own scale and zero
    return (torch.randn(n, k, generator=g) + 0.3) * torch.logspace(-3, 1, n)[:, None]


def test_this_torch_has_the_kernels_with_the_expected_layout() -> None:
    assert int4_kernels_available()


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 40),
    groups=st.integers(1, 4),
    extra=st.integers(0, 31),
    seed=st.integers(0, 2**16),
)
def test_group_quantization_error_is_at_most_half_a_step(
    n: int, groups: int, extra: int, seed: int
) -> None:
    k = groups * GROUP - extra  # K need not be a multiple of 32: zero-padded
    w = _weights(n, k, seed)
    q, scale, zero = quantize_groups(w)
    kp = -(-k // GROUP) * GROUP
    assert q.shape == (n, kp) and scale.shape == zero.shape == (kp // GROUP, n)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    # scale and zero are bf16 values already (the kernel's), q chosen against them
    assert torch.equal(scale, scale.bfloat16().float()) and torch.equal(
        zero, zero.bfloat16().float()
    )
    err = (dequantize(q, scale, zero)[:, :k] - w).abs()
    step = scale.t().repeat_interleave(GROUP, dim=1)[:, :k]
    # half a step, unless the bf16 zero moved an end of the range out of reach (by <= 2^-8 zero)
    slack = zero.abs().t().repeat_interleave(GROUP, dim=1)[:, :k] * 2**-8
    assert (err <= step / 2 * (1 + 1e-5) + slack + 1e-7).all()


def test_constant_groups_are_exact() -> None:
    w = torch.full((2, 64), 0.25)
    w[1, 32:] = 0.0
    q, scale, zero = quantize_groups(w)
    assert torch.isfinite(scale).all()
    assert torch.equal(dequantize(q, scale, zero), w)


def _reference(x: torch.Tensor, q, scale, zero) -> torch.Tensor:
    """What the kernel computes: bf16 x times the dequantized weights."""
    return F.linear(x.to(torch.bfloat16).float(), dequantize(q, scale, zero))


@pytest.mark.parametrize("rows", [0, 1, 3, INT4PACK_MAX_ROWS, INT4PACK_MAX_ROWS + 1, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_matches_dequantized_reference(rows: int, dtype: torch.dtype) -> None:
    w = _weights(48, 96, seed=rows)
    q, scale, zero = quantize_groups(w)
    packed, sz = pack(q, scale, zero)
    wide = dequantize(q, scale, zero).bfloat16()
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(7)).to(dtype)
    y = int4_linear(x, packed, sz, wide)
    assert y.shape == (rows, 48) and y.dtype == dtype
    ref = _reference(x, q, scale, zero)
    # one bf16 rounding of each output (relative 2^-8 with the fp32 accumulation order)
    tol = 8e-3 * ref.abs().amax(dim=1, keepdim=True).clamp_min(1e-6)
    assert ((y.float() - ref).abs() <= tol).all()
    # and a wrong layout (transposed groups, forgotten zero point) would be far off
    if rows:
        assert not torch.allclose(F.linear(x.float(), dequantize(q, zero, scale)), ref, atol=0.1)


def test_a_row_does_not_depend_on_the_batch() -> None:
    """Verify rows and plain decode rows of a request must give the same bits (lossless greedy
    speculation): up to INT4PACK_MAX_ROWS rows the kernel's rows are independent."""
    q, scale, zero = quantize_groups(_weights(64, 128, seed=3))
    packed, sz = pack(q, scale, zero)
    wide = dequantize(q, scale, zero).bfloat16()
    x = torch.randn(INT4PACK_MAX_ROWS, 128, generator=torch.Generator().manual_seed(1))
    together = int4_linear(x, packed, sz, wide)
    for i in range(INT4PACK_MAX_ROWS):
        assert torch.equal(int4_linear(x[i : i + 1], packed, sz, wide)[0], together[i])
