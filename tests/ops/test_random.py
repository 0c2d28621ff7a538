"""Counter-based RNG: exact match with a plain-Python reference, batch independence, uniformity."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.ops.random import hashed_bits, hashed_uniform, mix64

U64 = (1 << 64) - 1
GAMMA_U = 0x9E3779B97F4A7C15


def _mix_ref(z: int) -> int:
    """splitmix64 finaliser on a uint64, written independently of the module under test."""
    z &= U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    return z ^ (z >> 31)


def _uniform_ref(seed: int, counter: int, salt: int, col: int) -> float:
    """The documented spec in random.py, with Python uint64 arithmetic."""
    salt_key = _mix_ref((salt + 1) * GAMMA_U)
    key = _mix_ref(_mix_ref((seed & U64) ^ salt_key) + (counter & U64) * GAMMA_U)
    bits = _mix_ref(key + (col + 1) * GAMMA_U)
    return float(2 * (bits >> 41) + 1) * 2.0**-24


def _as_u64(t: torch.Tensor) -> list[int]:
    return [int(v) & U64 for v in t.flatten().tolist()]


def _chi2_quantile(dof: int, z: float) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at standard-normal score z."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def test_mix64_matches_splitmix64_reference_vector() -> None:
    # Published splitmix64 outputs for seed 1234567: output i = mix(seed + (i + 1) * gamma).
    expected = [
        6457827717110365317,
        3203168211198807973,
        9817491932198370423,
        4593380528125082431,
        16408922859458223821,
    ]
    states = [(1234567 + (i + 1) * GAMMA_U) & U64 for i in range(5)]
    signed = torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in states])
    assert _as_u64(mix64(signed)) == expected


def test_matches_python_reference_bit_for_bit() -> None:
    seeds = [0, 1, -1, 42, 2**63 - 1, -(2**63), 123456789012345]
    counters = [0, 1, 7, 2**40, 3, -5, 1000]
    seed_t = torch.tensor(seeds, dtype=torch.int64)
    counter_t = torch.tensor(counters, dtype=torch.int64)
    for salt in (1, 2, 3):
        u = hashed_uniform(seed_t, counter_t, salt, 9)  # [7, 9]
        ref = [[_uniform_ref(s, c, salt, col) for col in range(9)] for s, c in zip(seeds, counters)]
        assert u.dtype == torch.float32
        assert torch.equal(u, torch.tensor(ref, dtype=torch.float32))


def test_deterministic_and_independent_of_batch_composition() -> None:
    gen = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(2**62), 2**62, (64,), generator=gen)
    counters = torch.randint(0, 10_000, (64,), generator=gen)
    full = hashed_uniform(seeds, counters, 1, 50)
    assert torch.equal(full, hashed_uniform(seeds, counters, 1, 50))
    perm = torch.randperm(64, generator=gen)
    assert torch.equal(hashed_uniform(seeds[perm], counters[perm], 1, 50), full[perm])
    # a single row alone, and a narrower width, give the same leading values
    assert torch.equal(hashed_uniform(seeds[5:6], counters[5:6], 1, 50), full[5:6])
    assert torch.equal(hashed_uniform(seeds, counters, 1, 20), full[:, :20])


def test_streams_differ_by_salt_seed_and_counter() -> None:
    s = torch.zeros(1, dtype=torch.int64)
    c = torch.zeros(1, dtype=torch.int64)
    base = hashed_bits(s, c, 1, 16)
    assert not torch.equal(base, hashed_bits(s, c, 2, 16))
    assert not torch.equal(base, hashed_bits(s + 1, c, 1, 16))
    assert not torch.equal(base, hashed_bits(s, c + 1, 1, 16))


def test_never_exactly_zero_or_one() -> None:
    u = hashed_uniform(torch.arange(512), torch.arange(512) * 3, 1, 2048)
    assert u.min().item() > 0.0 and u.max().item() < 1.0
    # the extreme representable values themselves are strictly inside (0, 1) in float32
    lo = torch.tensor(1.0, dtype=torch.float32) * 2.0**-24
    hi = torch.tensor(2.0**24 - 1, dtype=torch.float32) * 2.0**-24
    assert lo.item() > 0.0 and hi.item() < 1.0 and -torch.log(hi).item() > 0.0


def test_uniformity_ks_and_chi_square() -> None:
    n_rows, width = 1024, 1024
    u = hashed_uniform(torch.arange(n_rows), torch.zeros(n_rows, dtype=torch.int64), 1, width)
    x = u.flatten().double().sort().values  # [n]
    n = x.numel()
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = torch.maximum((grid - x).abs(), (x - (grid - 1.0 / n)).abs()).max().item()
    # KS critical value at alpha = 0.001 is 1.95 / sqrt(n)
    assert ks < 1.95 / math.sqrt(n), ks

    bins = 1000
    counts = torch.bincount((u.flatten() * bins).long(), minlength=bins).double()
    expected = n / bins
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    # upper tail at z = 3.72 (p ~ 1e-4), dof = bins - 1
    assert chi2 < _chi2_quantile(bins - 1, 3.72), chi2


def test_no_correlation_between_neighbouring_streams() -> None:
    n = 200_000
    seeds = torch.arange(n)
    counters = torch.zeros(n, dtype=torch.int64)
    a = hashed_uniform(seeds, counters, 1, 2).double()  # [n, 2]
    pairs = [
        (a[:, 0], a[:, 1]),  # adjacent columns
        (a[:-1, 0], a[1:, 0]),  # adjacent seeds
        (a[:, 0], hashed_uniform(seeds, counters + 1, 1, 1)[:, 0].double()),  # next counter
        (a[:, 0], hashed_uniform(seeds, counters, 2, 1)[:, 0].double()),  # other salt
    ]
    for x, y in pairs:
        r = torch.corrcoef(torch.stack([x, y]))[0, 1].item()
        # |r| ~ N(0, 1/n) under independence: 5 sigma
        assert abs(r) < 5 / math.sqrt(x.numel()), r


@pytest.mark.parametrize("salt", [1, 3])
def test_every_kept_bit_is_balanced(salt: int) -> None:
    n = 100_000
    bits = hashed_bits(torch.arange(n), torch.full((n,), 11), salt, 1)[:, 0]  # [n]
    top = (bits >> 41) & ((1 << 23) - 1)
    for b in range(23):
        frac = ((top >> b) & 1).double().mean().item()
        assert abs(frac - 0.5) < 5 * 0.5 / math.sqrt(n), (b, frac)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_bit_for_bit() -> None:
    seeds = torch.randint(-(2**63), 2**63 - 1, (257,), generator=torch.Generator().manual_seed(1))
    counters = torch.arange(257) * 7919
    cpu = hashed_uniform(seeds, counters, 2, 3001)
    gpu = hashed_uniform(seeds.cuda(), counters.cuda(), 2, 3001).cpu()
    assert torch.equal(cpu, gpu)


def test_cpu_slabs_give_the_same_bits(monkeypatch) -> None:
    """hashed_uniform's CPU slab path gives the one-shot values bit for bit."""
    import specserve.ops.random as R

    seed = torch.tensor([0, -1, 2**62, 12345], dtype=torch.int64)
    counter = torch.tensor([0, 5, 9, 2**40], dtype=torch.int64)
    for width in (R._CPU_SLAB - 1, R._CPU_SLAB + 1, 3 * R._CPU_SLAB + 17):
        slabs = R.hashed_uniform(seed, counter, 3, width)
        monkeypatch.setattr(R, "_CPU_SLAB", 10**9)
        whole = R.hashed_uniform(seed, counter, 3, width)
        monkeypatch.undo()
        assert torch.equal(slabs, whole)
