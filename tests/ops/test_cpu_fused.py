"""The compiled CPU elementwise ops (specserve.ops.cpu_fused) through ops/fused.py's dispatchers
against the torch references: rotary + KV write bit for bit, add + RMSNorm and silu-and-mul to
the last bits; padding rows, strided inputs, the threaded row split; autograd keeps torch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve import env
from specserve.model.layers import RotaryEmbedding
from specserve.ops import cpu_build, cpu_fused, fused
from specserve.ops.attention import write_kv
from specserve.ops.forward_context import KVCache

pytestmark = pytest.mark.skipif(cpu_build.compiler() is None, reason="no C++ compiler")


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the row split runs in the 40-row cases
    yield
    torch.set_num_threads(before)


def test_kernel_builds() -> None:
    assert cpu_fused.kernel() is not None


@pytest.mark.parametrize("rows", [0, 1, 5, 40])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(rows: int, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 700, generator=g) * 3
    x = wide[:, 50:626]  # a strided view: rows of stride 700
    residual = torch.randn(rows, 576, generator=g) if with_residual else None
    weight = torch.randn(576, generator=g)
    out, new_res = fused.add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_res = fused.add_rms_norm_reference(x, residual, weight, 1e-5)
    assert torch.equal(new_res, ref_res)  # the add rounds once, as torch's
    torch.testing.assert_close(out, ref_out, rtol=2e-6, atol=2e-6)
    assert out.shape == (rows, 576) and out.is_contiguous()


@pytest.mark.parametrize("rows", [1, 40])
def test_silu_and_mul(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536, generator=g) * 8
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -200.0])
    out = fused.silu_and_mul(gate_up)
    ref = fused.silu_and_mul_reference(gate_up)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-30)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 40),
    heads=st.sampled_from([(9, 3), (4, 4), (8, 1)]),
    head_dim=st.sampled_from([8, 64, 128]),
    cache_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    data=st.data(),
)
def test_rope_write_kv_bit_exact(
    rows: int, heads: tuple[int, int], head_dim: int, cache_dtype: torch.dtype, data: st.DataObject
) -> None:
    """fp32 rows into an fp32 cache, or a bf16 one (kv_cache_dtype) rounded as torch rounds,
    ties to even included."""
    h, hkv = heads
    num_slots = 4 * 64
    slots = data.draw(
        st.lists(st.integers(0, num_slots - 1), min_size=rows, max_size=rows, unique=True)
    )
    pad = data.draw(st.lists(st.booleans(), min_size=rows, max_size=rows))
    slot_mapping = torch.tensor([-1 if p else s for s, p in zip(slots, pad, strict=True)])
    positions = torch.tensor(
        data.draw(st.lists(st.integers(0, 5000), min_size=rows, max_size=rows))
    )
    cos_sin = RotaryEmbedding(head_dim, 10000.0, None, 8192).cos_sin(positions, 5001, torch.float32)
    g = torch.Generator().manual_seed(rows * head_dim)
    qkv = torch.randn(rows, h + 2 * hkv, head_dim, generator=g)
    qkv[:, h + hkv :, :2] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8])  # bf16 ties (V is copied)
    poison = torch.full((4, 64, hkv, head_dim), float("nan"), dtype=cache_dtype)
    cache = KVCache(poison.clone(), poison.clone())
    ref_cache = KVCache(poison.clone(), poison.clone())

    q = fused.rope_write_kv_(qkv.clone(), h, cos_sin, cache, slot_mapping)
    ref_qk = fused.apply_rope(qkv[:, : h + hkv], cos_sin)
    write_kv(ref_qk[:, h:], qkv[:, h + hkv :], ref_cache, slot_mapping)

    assert torch.equal(q, ref_qk[:, :h])
    # equal_nan: slots no row wrote keep their poison; padding rows wrote nothing
    assert torch.equal(cache.k.isnan(), ref_cache.k.isnan())
    assert torch.equal(cache.k.nan_to_num(), ref_cache.k.nan_to_num())
    assert torch.equal(cache.v.nan_to_num(), ref_cache.v.nan_to_num())


def test_fused_ops_off_uses_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> None:
        raise AssertionError("compiled op called")

    monkeypatch.setattr(cpu_fused, "add_rms_norm", refuse)
    monkeypatch.setattr(cpu_fused, "silu_and_mul", refuse)
    x, w = torch.randn(3, 64), torch.randn(64)
    with env.override(fused_ops=False):
        fused.add_rms_norm(x, x, w, 1e-6)
        fused.silu_and_mul(torch.randn(3, 128))


def test_autograd_keeps_torch_ops() -> None:
    # head training differentiates through these layers: the compiled ops record no graph
    x = torch.randn(4, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    out, _ = fused.add_rms_norm(x, None, w, 1e-6)
    fused.silu_and_mul(torch.cat([out, out], -1)).sum().backward()
    assert x.grad is not None and w.grad is not None


@pytest.mark.parametrize("vocab", [1, 15, 16, 49152, 49157])
def test_argmax_matches_torch(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab + 3, generator=g)[:, 3:]  # strided rows
    x[1] = 0.5  # every index ties: the first wins
    x[2, vocab // 2 :] = x[2].max() + 1  # ties in the second half, across lanes
    x[3] = float("-inf")
    x[4, vocab - 1] = float("nan")  # a NaN wins, wherever the maximum is
    x[5, 0] = float("inf")
    x[6, vocab // 3] = float("nan")
    x[6, vocab - 1] = float("nan")
    assert torch.equal(cpu_fused.argmax(x), x.argmax(dim=-1))
    assert cpu_fused.argmax(x[:0]).shape == (0,)


def test_no_compiler_keeps_torch(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    # a machine without a C++ compiler: one warning, then the torch ops, same results
    monkeypatch.setattr(cpu_build, "compiler", lambda: None)
    lazy = cpu_build.LazyKernel(cpu_fused._SOURCE, cpu_fused._setup, "the torch ops")
    monkeypatch.setattr(cpu_fused, "_kernel", lazy)
    x, w = torch.randn(3, 64), torch.randn(64)
    with caplog.at_level("WARNING"):
        out, res = fused.add_rms_norm(x, x, w, 1e-6)
        logits = torch.randn(2, 100)
        ids = cpu_fused.argmax(logits)
    ref_out, ref_res = fused.add_rms_norm_reference(x, x, w, 1e-6)
    assert torch.equal(out, ref_out) and torch.equal(res, ref_res)  # the reference, bit for bit
    assert torch.equal(ids, logits.argmax(-1))
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1
