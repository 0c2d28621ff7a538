"""The integer-block GEMM (specserve.ops.cpu_qgemm): fp32-grade products of d q + m (error
against fp64 within a few times F.linear's), rows independent of the rows beside them, and the
same bits on every path: vectors, AMX tiles, a split between them, and the emulated integer dot
products of a CPU without AVX512-VNNI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.ops import cpu_build, cpu_qgemm

lib = cpu_qgemm.library()
pytestmark = pytest.mark.skipif(lib is None, reason="no C++ compiler")


def _blocks(n: int, k: int, kind: str, seed: int) -> cpu_qgemm.Blocks:
    g = torch.Generator().manual_seed(seed)
    if kind == "q4_1":  # unsigned 4-bit, fp16 d and m
        q = torch.randint(0, 16, (n, k), generator=g)
        d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
        m = (-torch.rand(n, k // 32, generator=g) * 0.15).half().float()
    else:  # q8_0: signed 8-bit, m = 0
        q = torch.randint(-127, 128, (n, k), generator=g)
        d = (torch.rand(n, k // 32, generator=g) * 0.002).half().float()
        m = torch.zeros(n, k // 32)
    return q, d, m


def _dense(blocks: cpu_qgemm.Blocks) -> torch.Tensor:  # [N, K] fp64, the exact d q + m
    q, d, m = (t.double() for t in blocks)
    return d.repeat_interleave(32, 1) * q + m.repeat_interleave(32, 1)


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    # heavy-tailed magnitudes, as hidden states have (a block's values span decades)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g) * torch.exp(2 * torch.randn(rows, k, generator=g))


def _run(x: torch.Tensor, packed: torch.Tensor, n: int, amx_rows: int = 0, library=None,
         bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    library = library or lib
    library.specserve_cpu_qgemm_use_amx(amx_rows)
    try:
        return cpu_qgemm.gemm(library, x, packed, bias, n)
    finally:
        library.specserve_cpu_qgemm_use_amx(cpu_qgemm.AMX_MIN_ROWS)


def _amx() -> bool:
    return bool(lib.specserve_cpu_qgemm_amx_available())


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 5, 16, 23, 64])
def test_products_are_fp32_grade(kind: str, rows: int) -> None:
    n, k = 96, 576
    blocks = _blocks(n, k, kind, rows)
    w64 = _dense(blocks)
    x = _x(rows, k, rows)
    want = x.double() @ w64.T
    scale = x.double().abs() @ w64.abs().T  # the size of the sum's terms: the error's unit
    got = _run(x, cpu_qgemm.pack(blocks), n).double()
    fp32 = F.linear(x, w64.float()).double()
    # the bound by construction: each input within 2^-23 of its block's largest |x|, then
    # fp32 sums over the blocks (one rounding each for the fold's terms)
    amax = x.double().abs().view(rows, k // 32, 32).amax(-1)  # [rows, K/32]
    wsum = w64.abs().view(n, k // 32, 32).sum(-1)  # [N, K/32]
    bound = 2.0**-23 * (amax @ wsum.T) + (k // 32 + 4) * 2.0**-24 * scale
    assert ((got - want).abs() <= bound).all()
    # and in practice near fp32's own GEMM: mean error 5-10e-8 of the terms' size here,
    # F.linear's 2.5-5.5e-8 (a split into two bytes instead of three: ~1e-5)
    err, err_fp32 = ((got - want).abs() / scale).mean(), ((fp32 - want).abs() / scale).mean()
    assert err < 4 * err_fp32, (err, err_fp32)


def test_bias_zero_and_tiny_blocks_and_row_strides() -> None:
    n, k = 32, 128
    blocks = _blocks(n, k, "q4_1", 0)
    w = _dense(blocks)
    x = _x(6, 2 * k, 1)[:, ::2]  # a row stride of 2 K, last dim strided: copied by gemm
    x[0] = 0.0  # every block zero
    x[1, :32] = 1e-35  # a block below 2^-100 counts as zeros
    x[2, 32:64] = torch.finfo(torch.float32).tiny  # the smallest normal: also below
    bias = torch.randn(n)
    got = _run(x, cpu_qgemm.pack(blocks), n, bias=bias).double()
    want = x.double() @ w.T + bias.double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0].float(), bias)
    x[3, 40], x[4, 5] = float("nan"), float("inf")  # as fp32 products: NaN rows
    got = _run(x, cpu_qgemm.pack(blocks), n, bias=bias)
    assert got[3:5].isnan().all() and not got[[0, 1, 2, 5]].isnan().any()


@pytest.mark.parametrize("amx_rows", [0, 1, 12])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(amx_rows: int) -> None:
    if amx_rows and not _amx():
        pytest.skip("no AMX here")
    n, k = 48, 192
    packed = cpu_qgemm.pack(_blocks(n, k, "q8_0", 3))
    x = _x(40, k, 4)
    together = _run(x, packed, n, amx_rows)
    for r in (0, 7, 15, 16, 33, 39):
        assert torch.equal(_run(x[r : r + 1].clone(), packed, n, amx_rows)[0], together[r])
    assert torch.equal(_run(x[5:29].clone(), packed, n, amx_rows), together[5:29])


@pytest.mark.skipif(lib is not None and not lib.specserve_cpu_qgemm_amx_available(),
                    reason="no AMX here")  # fmt: skip
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 12, 15, 16, 20, 28, 64])
def test_amx_tiles_give_the_vector_paths_bits(rows: int) -> None:
    n, k = 64, 1536
    for kind in ("q4_1", "q8_0"):
        packed = cpu_qgemm.pack(_blocks(n, k, kind, rows))
        x = _x(rows, k, rows + 1)
        assert torch.equal(_run(x, packed, n, 1), _run(x, packed, n, 0))


def test_emulated_integer_dot_products_give_the_same_bits() -> None:
    # the library a CPU without AVX512-VNNI (and AMX) builds: vpdpbusd in plain vector code
    emulated = cpu_build.load(
        Path(cpu_qgemm.__file__).with_name("cpu_qgemm.cpp"),
        ("-mno-avx512vnni", "-mno-avxvnni", "-mno-amx-int8", "-mno-amx-tile"),
    )
    cpu_qgemm._setup(emulated)
    assert emulated.specserve_cpu_qgemm_native() == 0
    assert emulated.specserve_cpu_qgemm_amx_available() == 0
    n, k = 32, 256
    for kind, rows in (("q4_1", 1), ("q8_0", 9)):
        packed = cpu_qgemm.pack(_blocks(n, k, kind, 5))
        x = _x(rows, k, 6)
        assert torch.equal(_run(x, packed, n, library=emulated), _run(x, packed, n))


@settings(max_examples=30, deadline=None)
@given(
    tiles=st.integers(1, 4),
    blocks=st.integers(1, 4),
    kind=st.sampled_from(["q4_1", "q8_0"]),
    seed=st.integers(0, 2**16),
)
def test_pack_and_unpack_round_trip(tiles: int, blocks: int, kind: str, seed: int) -> None:
    n, k = 16 * tiles, 32 * blocks
    b = _blocks(n, k, kind, seed)
    # fp32's d q + m: the loader's dequantized weights
    assert torch.equal(cpu_qgemm.unpack(cpu_qgemm.pack(b), n, k), _dense(b).float())


def test_pack_refuses_what_the_kernel_cannot_take() -> None:
    q, d, m = _blocks(32, 64, "q4_1", 0)
    with pytest.raises(ValueError, match="cannot be packed"):
        cpu_qgemm.pack((q[:20], d[:20], m[:20]))  # 20 outputs: not whole tiles of 16
    with pytest.raises(ValueError, match="cannot be packed"):
        cpu_qgemm.pack((q + 200, d, m))  # beyond int8
    assert not cpu_qgemm.packable(16, 48) and cpu_qgemm.packable(16, 64)


def test_kernel_is_the_library_only_with_native_dot_products() -> None:
    native = bool(lib.specserve_cpu_qgemm_native())
    assert (cpu_qgemm.kernel() is not None) == native
    if not _amx():  # asking for AMX where there is none leaves the vectors
        assert lib.specserve_cpu_qgemm_use_amx(12) == 0
