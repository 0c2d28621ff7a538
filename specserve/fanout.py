"""n samples of one prompt: n engine requests, the i-th seeded from the request's seed and i.

Shared by the offline API and the server, so the same seed draws the same n samples in both.
"""

from __future__ import annotations

import copy

from specserve.sampling_params import SamplingParams

SEED_MASK = 2**63 - 1


def derive_seed(seed: int, i: int) -> int:
    """Seed of the i-th sample of a prompt: the request's seed for i = 0 (so n=1 reproduces a
    plain seeded request), a distinct hash of (seed, i) for the others."""
    if i == 0:
        return seed
    x = (seed * 0x9E3779B97F4A7C15 + i * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return x & SEED_MASK


def sample_params(base: SamplingParams) -> list[SamplingParams]:
    """The params of the base.n engine requests of one prompt. Unseeded samples stay unseeded
    (the engine draws each its own seed)."""
    out = [base]
    for i in range(1, base.n):
        sp = copy.copy(base)
        if base.seed is not None:
            sp.seed = derive_seed(base.seed, i)
        out.append(sp)
    return out
