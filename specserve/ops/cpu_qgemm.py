"""GEMM over integer-block weights on the CPU (cpu_qgemm.cpp): W = d q + m per 32 inputs, q int8.

A GGUF's Q4_1 and Q8_0 tensors are such blocks; dequantized to fp32 they cost 4 bytes a weight
a step, as blocks 1 byte (plus 12 bytes of d, m and sum q per 16 x 32). Activations are split
into three bytes on a per-block grid of 2^-23 of the block's largest |x|, the dot products are
exact integer sums (AVX512-VNNI, or AMX tiles for chunks of 16 rows), and one fp32 fold scales
them: an fp32-grade product (tests/ops/test_cpu_qgemm.py compares its error against fp64 with
F.linear's) whose row results depend on nothing but the row, on either path.

Against the fp32 panels on a 2-core Xeon (AMX), the default model's linears streamed from DRAM
(tools/cpu_gemm_ab.py): 2.1x at 1 row, 1.9x at 16 rows, 1.35x at 64 rows.

Built on first use by ops/cpu_build.py; `kernel()` is None where it cannot be built or where the
integer dot products would be emulated (no AVX512-VNNI): callers keep the fp32 panels.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from specserve import env
from specserve.ops import cpu_build, cpu_gemm

_SOURCE = Path(__file__).with_name("cpu_qgemm.cpp")
_ABI_VERSION = 1
LANES, BLOCK = 16, 32
# AMX takes a chunk of 16 rows (its tiles as tall as the chunk) from this many rows on: below
# it the vectors are faster. Paired, 9 repeats (`tools/cpu_gemm_ab.py --rows 1,2,3,4,5,6,8,12,16
# --amx-rows 1`, the Xeon; benchmarks/cpu/cpu_gemm_amx_rows_xeon.json), speedup over the panels,
# vectors / AMX: 3 rows 2.36x / 2.08x, 4 rows 2.02x / 2.01x (level), 5 rows 1.77x [1.71, 1.79] /
# 1.99x [1.93, 2.06], 6 rows 1.62x / 1.94x. Both give the same bits: only speed moves.
AMX_MIN_ROWS = 5

Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q [N, K] int, d, m [N, K / 32] fp32


def _setup(lib: ctypes.CDLL) -> None:
    if lib.specserve_cpu_qgemm_version() != _ABI_VERSION:
        raise RuntimeError("cpu_qgemm library has a different ABI version")
    cpu_gemm.declare(lib.specserve_cpu_qgemm)
    lib.specserve_cpu_qgemm_use_amx.argtypes = [ctypes.c_int]
    lib.specserve_cpu_qgemm_use_amx(AMX_MIN_ROWS if env.settings.cpu_amx == "auto" else 0)


_kernel = cpu_build.LazyKernel(_SOURCE, _setup, "fp32 panels")


def library() -> ctypes.CDLL | None:
    """The built library, whatever the CPU (tests reach the emulated path through it)."""
    return _kernel.get()


def kernel() -> ctypes.CDLL | None:
    """The library where its integer dot products are instructions, else None."""
    lib = _kernel.get()
    return lib if lib is not None and lib.specserve_cpu_qgemm_native() else None


def packable(n: int, k: int) -> bool:
    return n % LANES == 0 and k % BLOCK == 0


def pack(blocks: Blocks) -> torch.Tensor:  # -> [bytes] uint8, cpu_qgemm.cpp's layout
    q, d, m = blocks
    n, k = q.shape
    if not packable(n, k) or int(q.min()) < -128 or int(q.max()) > 127:
        raise ValueError(f"blocks of shape {tuple(q.shape)} cannot be packed")
    nt, nb = n // LANES, k // BLOCK
    tiles = q.to(torch.int8).view(nt, LANES, nb, 8, 4).permute(0, 2, 3, 1, 4).contiguous()

    def per_tile(a: torch.Tensor) -> torch.Tensor:  # [N, K/32] -> [N/16][K/32][16] bytes
        return a.reshape(nt, LANES, nb).permute(0, 2, 1).contiguous().view(-1).view(torch.uint8)

    start = q.reshape(n, nb, BLOCK).sum(-1, dtype=torch.int32) * -128  # Ph's starting value
    parts = [tiles.view(-1).view(torch.uint8), per_tile(d.float()), per_tile(m.float())]
    return torch.cat([*parts, per_tile(start)])


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:  # -> W [N, K] fp32
    nt, nb = n // LANES, k // BLOCK
    tiles = packed[: n * k].view(torch.int8).view(nt, nb, 8, LANES, 4)
    q = tiles.permute(0, 3, 1, 2, 4).reshape(n, k).float()
    fp = packed[n * k :].view(torch.float32)

    def per_row(a: torch.Tensor) -> torch.Tensor:  # [N/16][K/32][16] -> [N, K]
        a = a.view(nt, nb, LANES).permute(0, 2, 1).reshape(n, nb)
        return a.repeat_interleave(BLOCK, dim=1)

    return per_row(fp[: n * nb]) * q + per_row(fp[n * nb : 2 * n * nb])


def gemm(
    lib: ctypes.CDLL,
    x: torch.Tensor,  # [M, K] fp32, last dim contiguous
    packed: torch.Tensor,  # pack()'s bytes
    bias: torch.Tensor | None,  # [N] fp32
    n: int,
) -> torch.Tensor:  # [M, N]
    return cpu_gemm.call(lib.specserve_cpu_qgemm, x, packed, bias, n)
