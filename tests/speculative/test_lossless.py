"""Rejection sampling is lossless: the first emitted token of a one-draft step is distributed as
the target p, whatever the draft q, and a biased verifier is caught by the same test."""

import pytest
import torch

import specserve.sample.verify as verify_mod
from specserve.ops.random import hashed_uniform
from specserve.ops.sampling import DRAFT_SALT, SamplingTensors, target_probs
from specserve.sample.layout import build_layout
from specserve.sample.verify import verify
from specserve.sampling_params import SamplingParams

N = 120_000  # requests, one draft each -> 120k draws of the first emitted token
V = 8
# chi-square critical value for df = 7 at p = 1e-4 is 29.88; a correct verifier fails this test
# once in 10,000 runs, seeds are fixed so the outcome is reproducible
CHI2_CRIT = 29.88


def _first_tokens(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    target_logits = torch.randn(V, generator=g) * 1.5
    draft_logits = torch.randn(V, generator=g) * 1.5  # q != p
    logits = target_logits.expand(2 * N, V).contiguous()  # rows: verify, bonus
    seqlens = torch.full((N,), 2, dtype=torch.int64)
    layout = build_layout(seqlens, 2 * N, 1)
    seeds = list(range(N))
    row_seeds = [s for s in seeds for _ in range(2)]
    t = SamplingTensors.build([params] * (2 * N), row_seeds, [0, 1] * N, "cpu")
    # the drafter applies the same filters to its own logits: q = target_probs(draft_logits)
    q = target_probs(draft_logits.expand(2 * N, V).contiguous(), t)
    # draft drawn from q with the drafter's own stream
    u = hashed_uniform(t.seed, t.counter, DRAFT_SALT, V)
    drafts = (q / -torch.log(u)).argmax(-1)
    drafts = torch.stack([drafts[0::2], torch.zeros(N, dtype=torch.int64)], 1).reshape(-1)
    res = verify(logits, drafts, q, t, layout)
    first = torch.where(
        res.verified_token_ids[0::2] >= 0,
        res.verified_token_ids[0::2].long(),
        res.sampled_token_ids,
    )
    p = target_probs(target_logits.unsqueeze(0), SamplingTensors.build([params], [0], [0], "cpu"))[
        0
    ]
    return first, p


def _chi2(first: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(first, minlength=V).double()
    expected = p.double() * N
    assert counts[expected == 0].sum() == 0, "a token outside the target support was emitted"
    m = expected > 0
    return float(((counts[m] - expected[m]) ** 2 / expected[m]).sum())


CASES = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7_topk4": SamplingParams(temperature=0.7, top_k=4),
    "topp0.8": SamplingParams(temperature=1.0, top_p=0.8),
    "minp0.1": SamplingParams(temperature=1.0, min_p=0.1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_emitted_distribution_is_the_target(name):
    first, p = _first_tokens(CASES[name])
    assert _chi2(first, p) < CHI2_CRIT


@pytest.mark.parametrize("bias", ["always_accept", "accept_too_often"])
def test_a_biased_verifier_is_caught(monkeypatch, bias):
    real = verify_mod.hashed_uniform

    def biased(seed, counter, salt, width):
        u = real(seed, counter, salt, width)
        if salt == verify_mod.ACCEPT_SALT:
            return torch.zeros_like(u) if bias == "always_accept" else u * 0.8
        return u

    monkeypatch.setattr(verify_mod, "hashed_uniform", biased)
    first, p = _first_tokens(CASES["t1"])
    assert _chi2(first, p) > CHI2_CRIT


@pytest.mark.parametrize("name", ["t1", "topp0.8"])
def test_absent_device_drafts_keep_the_target_distribution(name):
    """Device drafters lay out rows before their drafts exist: a row whose draft turned out
    absent checks -1. Requests with a one-hot draft, with a -1 after it, or with -1 alone:
    the first emitted token is still distributed as p, and -1 is never accepted."""
    params = CASES[name]
    g = torch.Generator().manual_seed(2)
    target_logits = torch.randn(V, generator=g) * 1.5
    logits = target_logits.expand(3 * N, V).contiguous()  # 3 rows per request
    layout = build_layout(torch.full((N,), 3, dtype=torch.int64), 3 * N, 2)
    row_seeds = [s for s in range(N) for _ in range(3)]
    t = SamplingTensors.build([params] * (3 * N), row_seeds, [0, 1, 2] * N, "cpu")
    real = torch.randint(0, V, (N,), generator=g)
    kind = torch.arange(N) % 3  # 0: draft, -1; 1: -1, -1; 2: draft, draft
    first = torch.where(kind == 1, -1, real)
    second = torch.where(kind == 2, torch.randint(0, V, (N,), generator=g), -1)
    drafts = torch.stack([first, second, torch.zeros(N, dtype=torch.int64)], 1).reshape(-1)
    res = verify(logits, drafts, None, t, layout)
    verified = res.verified_token_ids.view(N, 3)
    assert not (verified[kind == 1] >= 0).any()
    assert not (verified[kind == 0][:, 1] >= 0).any()
    emitted = torch.where(verified[:, 0] >= 0, verified[:, 0].long(), res.sampled_token_ids)
    p = target_probs(target_logits.unsqueeze(0), SamplingTensors.build([params], [0], [0], "cpu"))
    assert _chi2(emitted, p[0]) < CHI2_CRIT


def test_absent_drafts_with_a_draft_q_keep_the_target_distribution():
    """A drafter with q (EAGLE-3 on the device): a row checking -1 has q = 0 there, so it is
    rejected and resamples from max(p - 0, 0) = p; the first token is distributed as p."""
    params = CASES["t1"]
    g = torch.Generator().manual_seed(3)
    target_logits = torch.randn(V, generator=g) * 1.5
    logits = target_logits.expand(2 * N, V).contiguous()
    layout = build_layout(torch.full((N,), 2, dtype=torch.int64), 2 * N, 1)
    t = SamplingTensors.build(
        [params] * (2 * N), [s for s in range(N) for _ in range(2)], [0, 1] * N, "cpu"
    )
    q = torch.softmax(torch.randn(2 * N, V, generator=g), -1)
    drafts = torch.stack([torch.full((N,), -1), torch.zeros(N, dtype=torch.int64)], 1).reshape(-1)
    q = torch.where((drafts >= 0).unsqueeze(1), q, torch.zeros_like(q))
    res = verify(logits, drafts, q, t, layout)
    assert (res.verified_token_ids == -1).all()
    p = target_probs(target_logits.unsqueeze(0), SamplingTensors.build([params], [0], [0], "cpu"))
    assert _chi2(res.sampled_token_ids, p[0]) < CHI2_CRIT
