"""The compiled CPU race (ops/cpu_race.py) against torch's race in sample(): the same token
but where two scores agree to within float rounding (checked in float64), and those rare;
torch.argmax's rules exactly where they are defined (ties, zeros, NaN)."""

from __future__ import annotations

import pytest
import torch

from specserve import env
from specserve.ops import cpu_race
from specserve.ops.random import hashed_uniform
from specserve.ops.sampling import RESAMPLE_SALT, SAMPLE_SALT, SamplingTensors, sample
from specserve.sampling_params import SamplingParams

NEAR_TIE = 1e-6  # relative gap of the reference's scores under which two tokens may swap


@pytest.fixture(autouse=True)
def _kernel() -> None:
    if cpu_race._kernel.get() is None:
        pytest.skip("no C++ compiler: the torch race serves")


def _tensors(n: int) -> SamplingTensors:
    params = [SamplingParams(temperature=1.0, seed=7 * i + 1) for i in range(n)]
    return SamplingTensors.build(params, [p.seed for p in params], list(range(3, 3 + n)), "cpu")


def _torch_race(probs: torch.Tensor, t: SamplingTensors, salt: int) -> torch.Tensor:
    u = hashed_uniform(t.seed, t.counter, salt, probs.shape[1])
    return (probs / u.log_().neg_()).argmax(dim=-1)


@pytest.mark.parametrize("vocab", [7, 16, 1000, 20_011])
@pytest.mark.parametrize("salt", [SAMPLE_SALT, RESAMPLE_SALT])
def test_the_race_is_torchs_but_at_float_near_ties(vocab: int, salt: int) -> None:
    gen = torch.Generator().manual_seed(vocab + salt)
    n = 400 if vocab < 5000 else 60
    scale = torch.rand(n, 1, generator=gen) * 8  # flat to peaked rows
    probs = (torch.randn(n, vocab, generator=gen) * scale).softmax(dim=-1)
    probs[::7, : vocab // 2] = 0.0  # some tokens filtered out
    t = _tensors(n)
    got, want = cpu_race.race(probs, t.seed, t.counter, salt), _torch_race(probs, t, salt)
    u = hashed_uniform(t.seed, t.counter, salt, vocab).double()
    scores = probs.double() / -u.log()
    rows = (got != want).nonzero().squeeze(1)
    for r in rows.tolist():
        a, b = scores[r, got[r]].item(), scores[r, want[r]].item()
        assert abs(a - b) <= NEAR_TIE * max(a, b), (r, a, b)
    assert rows.numel() <= max(1, n // 1000)


def test_argmax_rules_ties_zeros_and_nan() -> None:
    t = _tensors(4)
    probs = torch.zeros(4, 50)
    probs[1, 10] = probs[1, 30] = 1.0  # one of two tokens
    probs[2, 5] = float("nan")
    probs[2, 40] = float("nan")
    probs[3, 3] = 1.0
    got = cpu_race.race(probs, t.seed, t.counter, SAMPLE_SALT)
    assert got[0] == 0  # all zero: the first index, as torch.argmax
    assert got[1] in (10, 30) and got[1] == _torch_race(probs, t, SAMPLE_SALT)[1]
    assert got[2] == 5  # the first NaN
    assert got[3] == 3
    # a tie of equal scores goes to the lower column
    assert torch.equal(cpu_race.race(probs[:1], t.seed[:1], t.counter[:1], SAMPLE_SALT), got[:1])


def test_sample_uses_it_for_unfiltered_rows_only() -> None:
    gen = torch.Generator().manual_seed(5)
    n, vocab = 32, 3000
    probs = (torch.randn(n, vocab, generator=gen) * 2).softmax(dim=-1)
    t = _tensors(n)
    with env.override(fused_ops=False):
        want = sample(probs, t)
    got = sample(probs, t)
    assert (got == want).float().mean() > 0.99
    assert torch.equal(got, cpu_race.race(probs, t.seed, t.counter, SAMPLE_SALT))
    with env.override(fused_ops=False):
        assert cpu_race.race(probs, t.seed, t.counter, SAMPLE_SALT) is None


def test_its_noise_is_torchs_within_an_ulp() -> None:
    """-log(u) at every column of a row: the hash exact, the log within one float ulp."""
    for seed, counter in ((1, 0), (-5, 123456), (2**62, 7)):
        want = -hashed_uniform(
            torch.tensor([seed]), torch.tensor([counter]), SAMPLE_SALT, 50_000
        ).log()[0]
        got = cpu_race.noise(seed, counter, SAMPLE_SALT, 50_000)
        ulp = torch.finfo(torch.float32).eps * want.abs()
        assert ((got - want).abs() <= ulp).all()
        exact = (
            -hashed_uniform(torch.tensor([seed]), torch.tensor([counter]), SAMPLE_SALT, 50_000)
            .double()
            .log()[0]
        )
        assert ((got.double() - exact).abs() <= 0.5 * ulp.double()).all()  # rounded once
