"""Counter-based random numbers for sampling and verification.

Why counter-based: a seeded request must draw the same numbers whatever else is in the batch,
whichever row it lands on, and on CPU or GPU. A stateful generator (torch.Generator) gives none
of that. Here every random number is a pure function of (seed, counter, salt, column), so a row
can compute its numbers with no shared state and a Triton kernel can reproduce them bit for bit.

The mixer is splitmix64's finaliser (Steele, Lea & Flood 2014; Vigna's public-domain C code).
All arithmetic is on int64 tensors and relies on two's-complement wrapping for + and *, which
torch (CPU and CUDA) and Triton all do. The one trap is `>>`: on signed int64 it is an
arithmetic shift, so every right shift is masked back to a logical one (`_srl`).

Spec (what a kernel port must match):
    salt_key(salt)    = mix64((salt + 1) * GAMMA)                 (computed once, in Python)
    row_key(s, n, t)  = mix64(mix64(s ^ salt_key(t)) + n * GAMMA)
    bits(s, n, t, c)  = mix64(row_key(s, n, t) + (c + 1) * GAMMA)  (c = column, 0-based)
    u                 = (2 * (bits >>> 41) + 1) * 2**-24           (float32, exact)
so u takes the 2**23 odd multiples of 2**-24: all exactly representable in float32, the
smallest 2**-24 and the largest 1 - 2**-24, never 0 or 1.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def to_int64_bits(x: int) -> int:
    """A Python integer taken mod 2**64, as the int64 with the same bits."""
    x &= _MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


# splitmix64 constants, stored as the signed int64 with the same bit pattern so torch accepts
# them as int64 scalars.
GAMMA = to_int64_bits(0x9E3779B97F4A7C15)
_MUL1 = to_int64_bits(0xBF58476D1CE4E5B9)
_MUL2 = to_int64_bits(0x94D049BB133111EB)

_MANTISSA_BITS = 23  # keep the top 23 bits; 2*m+1 < 2**24 is exact in float32
_INV_2_24 = 2.0**-24


def _srl(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> on int64 sign-extends)."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 bit patterns; a bijection of 64-bit words. Returns a new tensor."""
    z = z ^ _srl(z, 30)
    z.mul_(_MUL1)
    z.bitwise_xor_(_srl(z, 27))
    z.mul_(_MUL2)
    z.bitwise_xor_(_srl(z, 31))
    return z


def mix64_int(x: int) -> int:
    """mix64 on one Python integer (uint64 semantics, returned as int64 bits); for constants."""
    z = x & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return to_int64_bits(z ^ (z >> 31))


def salt_key(salt: int) -> int:
    """Spread a small salt over 64 bits so salts 1, 2, 3 give unrelated streams."""
    return mix64_int((salt + 1) * 0x9E3779B97F4A7C15)


def row_keys(seed: torch.Tensor, counter: torch.Tensor, salt: int) -> torch.Tensor:
    """Per-row stream key from (seed, counter, salt). seed, counter: [N] int64 -> [N] int64."""
    k = mix64(seed.to(torch.int64) ^ salt_key(salt))
    return mix64(k + counter.to(torch.int64) * GAMMA)


def hashed_bits(seed: torch.Tensor, counter: torch.Tensor, salt: int, width: int) -> torch.Tensor:
    """Raw 64-bit words: [N] seeds/counters -> [N, width] int64; [r, c] depends only on
    (seed[r], counter[r], salt, c)."""
    key = row_keys(seed, counter, salt)  # [N]
    cols = torch.arange(1, width + 1, dtype=torch.int64, device=key.device) * GAMMA  # [width]
    return mix64(key[:, None] + cols[None, :])  # [N, width]


# Columns per slab on CPU: the [N, width] int64 temporaries of a whole vocabulary (100 MB at
# N = 256, V = 49152) are page-faulted afresh by every op; slabs that fit in cache are ~10x faster.
_CPU_SLAB = 2048


def hashed_uniform(
    seed: torch.Tensor, counter: torch.Tensor, salt: int, width: int
) -> torch.Tensor:
    """Uniforms strictly inside (0, 1): [N] seeds/counters -> [N, width] float32.

    Element [r, c] is a pure function of (seed[r], counter[r], salt, c): independent of N, of
    the row's position and of the device. Resolution is 2**-23 (values (2m+1) * 2**-24).
    """
    if seed.device.type == "cpu" and width > _CPU_SLAB:
        return _hashed_uniform_slabs(seed, counter, salt, width)
    top = _srl(
        hashed_bits(seed, counter, salt, width), 64 - _MANTISSA_BITS
    )  # [N, width] in [0, 2**23)
    return (top * 2 + 1).to(torch.float32) * _INV_2_24  # [N, width]


def _hashed_uniform_slabs(
    seed: torch.Tensor, counter: torch.Tensor, salt: int, width: int
) -> torch.Tensor:  # [N, width] float32, the same bits as the one-shot path
    key = row_keys(seed, counter, salt)[:, None]  # [N, 1]
    out = torch.empty(key.shape[0], width, dtype=torch.float32)
    shift = 64 - _MANTISSA_BITS
    for c0 in range(0, width, _CPU_SLAB):
        c1 = min(width, c0 + _CPU_SLAB)
        cols = torch.arange(c0 + 1, c1 + 1, dtype=torch.int64) * GAMMA  # [S]
        top = _srl(mix64(key + cols), shift)  # [N, S]
        torch.mul(top.mul_(2).add_(1).to(torch.float32), _INV_2_24, out=out[:, c0:c1])
    return out
