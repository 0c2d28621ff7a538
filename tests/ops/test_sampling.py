"""target_probs / sample / compute_logprobs: filters vs a per-row reference, empirical
distributions vs the target, seeded determinism across batch compositions."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from specserve import env
from specserve.ops.logprobs import compute_logprobs
from specserve.ops.sampling import (
    ACCEPT_SALT,
    DRAFT_SALT,
    RESAMPLE_SALT,
    SAMPLE_SALT,
    SamplingTensors,
    sample,
    target_probs,
)
from specserve.sampling_params import SamplingParams


def _chi2_quantile(dof: int, z: float) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at standard-normal score z."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def _reference_probs(row: list[float], p: SamplingParams) -> list[float]:
    """One row, plain Python in float64: the semantics target_probs documents."""
    vocab = len(row)
    if p.greedy:
        best = max(range(vocab), key=lambda i: (row[i], -i))
        return [1.0 if i == best else 0.0 for i in range(vocab)]
    x = [v / p.temperature for v in row]
    order = sorted(range(vocab), key=lambda i: (-x[i], i))
    keep = set(range(vocab))
    if p.top_k > 0:
        kth = x[order[min(p.top_k, vocab) - 1]]
        keep = {i for i in keep if x[i] >= kth}
    if p.top_p < 1.0:
        z = sum(math.exp(x[i]) for i in keep)
        mass, kept = 0.0, set()
        for i in order:
            if i in keep and mass < p.top_p:
                kept.add(i)
                mass += math.exp(x[i]) / z
        keep = kept
    if p.min_p > 0.0:
        best = max(x[i] for i in keep)
        keep = {i for i in keep if x[i] - best >= math.log(p.min_p)}
    z = sum(math.exp(x[i]) for i in keep)
    return [math.exp(x[i]) / z if i in keep else 0.0 for i in range(vocab)]


def _tiled(params: SamplingParams, seeds: torch.Tensor, counters: torch.Tensor) -> SamplingTensors:
    """SamplingTensors for many rows sharing one SamplingParams (build() on one row, then tile)."""
    one = SamplingTensors.build([params], [0], [0], "cpu")
    m = seeds.shape[0]
    return replace(
        one,
        temperature=one.temperature.expand(m),
        top_k=one.top_k.expand(m),
        top_p=one.top_p.expand(m),
        min_p=one.min_p.expand(m),
        seed=seeds,
        counter=counters,
    )


MIXED_PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.1),
    SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=1000),  # k > V: no filtering
    SamplingParams(temperature=1.0, top_p=0.01),  # only the top token survives
    SamplingParams(temperature=0.5, top_k=3, top_p=0.5),
]


def test_target_probs_matches_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(MIXED_PARAMS), 40, generator=gen) * 2.5
    t = SamplingTensors.build(MIXED_PARAMS, list(range(10)), [0] * 10, "cpu")
    got = target_probs(logits, t)
    want = torch.tensor(
        [_reference_probs(r, p) for r, p in zip(logits.tolist(), MIXED_PARAMS)],
        dtype=torch.float32,
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got.sum(-1), torch.ones(len(MIXED_PARAMS)))


def test_build_flags_and_greedy_rows_drop_filters() -> None:
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5), SamplingParams(min_p=0.2)]
    t = SamplingTensors.build(params, [2**64 - 1, -3], [4, 5], "cpu")
    assert (t.all_greedy, t.any_greedy, t.any_top_k, t.any_top_p, t.any_min_p) == (
        False,
        True,
        False,
        False,
        True,
    )
    assert t.max_top_k == 0 and t.seed.tolist() == [-1, -3] and t.temperature[0].item() == 0.0
    g = SamplingTensors.build([SamplingParams(temperature=0.0)] * 2, [0, 0], [0, 0], "cpu")
    assert g.all_greedy and not g.any_top_k
    with pytest.raises(ValueError):
        SamplingTensors.build(params, [1], [0, 0], "cpu")


def test_greedy_is_argmax_with_lowest_index_on_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 1.0, 5.0], [0.0, -1.0, 2.0, 1.0]])
    expected = [1, 0, 2]
    for params in (
        [SamplingParams(temperature=0.0)] * 3,  # all-greedy fast path
        [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=1.0)],  # mixed
    ):
        n = len(params)
        rows = torch.cat([logits, torch.randn(n - 3, 4)])
        t = SamplingTensors.build(params, list(range(n)), [0] * n, "cpu")
        probs = target_probs(rows, t)
        assert probs[:3].argmax(-1).tolist() == expected
        assert torch.equal(probs[:3].sum(-1), torch.ones(3)) and (probs[:3] > 0).sum().item() == 3
        assert sample(probs, t)[:3].tolist() == expected


def test_top_p_keeps_minimal_prefix_reaching_p() -> None:
    gen = torch.Generator().manual_seed(1)
    n, vocab = 300, 50
    logits = torch.randn(n, vocab, generator=gen) * 2
    top_p = (torch.rand(n, generator=gen) * 0.98 + 0.01).tolist()
    top_p[0] = 1e-6  # tiny p: still one token
    params = [SamplingParams(temperature=1.0, top_p=p) for p in top_p]
    probs = target_probs(logits, SamplingTensors.build(params, [0] * n, [0] * n, "cpu"))
    full = logits.double().softmax(-1)
    for r in range(n):
        kept = probs[r] > 0
        assert kept.sum() >= 1
        # a prefix of the descending order: every kept token beats every dropped one
        if (~kept).any():
            assert logits[r][kept].min() >= logits[r][~kept].max()
        mass = full[r][kept].sum().item()
        smallest = full[r][kept].min().item()
        assert mass >= top_p[r] - 1e-6, (r, mass, top_p[r])
        assert mass - smallest < top_p[r] + 1e-6, (r, mass, smallest, top_p[r])
    assert (probs[0] > 0).sum().item() == 1


def test_top_k_keeps_ties_and_both_paths_agree() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    t = SamplingTensors.build(
        [SamplingParams(top_k=2), SamplingParams(top_k=0)], [0, 0], [0, 0], "cpu"
    )
    probs = target_probs(logits, t)
    assert (probs[0] > 0).tolist() == [True, True, True, False, False]
    assert (probs[1] > 0).all()
    # the sorted (top-p) path with top_p = 1 must keep exactly what the topk path keeps
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(-3, 4, (64, 30), generator=gen).float()  # many ties
    k = torch.randint(0, 12, (64,), generator=gen)
    params = [SamplingParams(top_k=int(v)) for v in k]
    fast = SamplingTensors.build(params, [0] * 64, [0] * 64, "cpu")
    assert fast.any_top_k and not fast.any_top_p
    sorted_path = replace(fast, any_top_p=True)
    torch.testing.assert_close(target_probs(x, fast), target_probs(x, sorted_path))


def test_min_p_threshold_relative_to_max() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(20, 64, generator=gen) * 3
    params = [SamplingParams(min_p=0.05 * (i + 1)) for i in range(20)]
    probs = target_probs(logits, SamplingTensors.build(params, [0] * 20, [0] * 20, "cpu"))
    full = logits.softmax(-1)
    min_p = torch.tensor([p.min_p for p in params])[:, None]
    want = full >= min_p * full.max(-1, keepdim=True).values
    # off-by-rounding only exactly at the threshold, which random logits do not hit
    assert torch.equal(probs > 0, want)


DIST_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=6),
    SamplingParams(temperature=0.7, top_p=0.85),
    SamplingParams(temperature=1.0, min_p=0.08),
    SamplingParams(temperature=1.2, top_k=12, top_p=0.9, min_p=0.02),
]


@pytest.mark.parametrize(
    "params", DIST_CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}"
)
def test_empirical_distribution_matches_target(params: SamplingParams) -> None:
    vocab, m = 24, 60_000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(4)) * 1.5
    # half the draws vary the seed, half vary the counter of one seed: both must be fair
    seeds = torch.cat([torch.arange(m // 2), torch.full((m // 2,), 987654321)])
    counters = torch.cat([torch.zeros(m // 2, dtype=torch.int64), torch.arange(m // 2)])
    t = _tiled(params, seeds, counters)
    # end to end: filters + sampler vs the plain-Python reference distribution
    p = torch.tensor(_reference_probs(logits[0].tolist(), params), dtype=torch.float64)  # [V]
    ids = sample(target_probs(logits.expand(m, vocab), t), t)  # [m]
    counts = torch.bincount(ids, minlength=vocab).double()

    assert counts[p == 0].sum().item() == 0, "a zero-probability token was sampled"
    expected = p * m
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big & (p > 0)].sum()[None]])
    exp = torch.cat([expected[big], expected[~big & (p > 0)].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    chi2 = ((obs - exp) ** 2 / exp).sum().item()
    dof = max(obs.numel() - 1, 1)
    # z = 3.72: false-alarm rate ~1e-4 per case
    assert chi2 < _chi2_quantile(dof, 3.72), (chi2, dof)
    tv = 0.5 * (counts / m - p).abs().sum().item()
    assert tv < 0.015, tv


def test_seeded_rows_ignore_batch_composition() -> None:
    gen = torch.Generator().manual_seed(5)
    vocab = 100
    logits = torch.randn(len(MIXED_PARAMS), vocab, generator=gen)
    seeds = list(range(1000, 1000 + len(MIXED_PARAMS)))
    counters = [3, 4, 5, 0, 1, 2, 9, 9, 9, 1]
    t = SamplingTensors.build(MIXED_PARAMS, seeds, counters, "cpu")
    base = sample(target_probs(logits, t), t)
    assert torch.equal(base, sample(target_probs(logits, t), t))  # deterministic

    # each row again, in a different batch: new neighbours, other params, other position
    others = torch.randn(7, vocab, generator=gen)
    other_params = [SamplingParams(temperature=1.5, top_p=0.5)] * 7
    for r in range(len(MIXED_PARAMS)):
        rows = torch.cat([others[:4], logits[r : r + 1], others[4:]])
        params = other_params[:4] + [MIXED_PARAMS[r]] + other_params[4:]
        tb = SamplingTensors.build(
            params, [7] * 4 + [seeds[r]] + [8] * 3, [0] * 4 + [counters[r]] + [0] * 3, "cpu"
        )
        assert sample(target_probs(rows, tb), tb)[4].item() == base[r].item()


def test_salts_are_distinct_and_sampling_is_scale_invariant() -> None:
    assert len({SAMPLE_SALT, ACCEPT_SALT, RESAMPLE_SALT, DRAFT_SALT}) == 4
    n, vocab = 2000, 50
    probs = torch.softmax(torch.randn(n, vocab, generator=torch.Generator().manual_seed(6)), -1)
    t = _tiled(SamplingParams(temperature=1.0), torch.arange(n), torch.zeros(n, dtype=torch.int64))
    a = sample(probs, t)
    # unnormalised input (power-of-two scale: exact in float) gives the very same tokens
    assert torch.equal(a, sample(probs * 4.0, t))
    b = sample(probs, t, salt=RESAMPLE_SALT)
    assert (a != b).float().mean().item() > 0.5  # independent draws mostly differ


def test_logprobs_match_log_softmax() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(12, 33, generator=gen) * 4
    logits[0, 5] = float("-inf")  # a masked token: logprob -inf, worst rank
    logits[1, :] = 0.0  # all tied: every token rank 1
    ids = torch.randint(0, 33, (12,), generator=gen)
    ids[0] = 5
    res = compute_logprobs(logits, ids, 4)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(res.token_logprob, ref.gather(1, ids[:, None])[:, 0])
    want_rank = [1 + sum(v > ref[r, ids[r]].item() for v in ref[r].tolist()) for r in range(12)]
    assert res.token_rank.tolist() == want_rank
    assert res.token_rank[0].item() == 33 and res.token_rank[1].item() == 1
    top = ref.topk(4, -1)
    torch.testing.assert_close(res.top_logprobs, top.values)
    torch.testing.assert_close(ref.gather(1, res.top_ids), top.values)
    assert res.top_ids.shape == (12, 4) and res.top_ids.dtype == torch.int64

    none = compute_logprobs(logits, ids, 0)
    assert none.top_ids.shape == (12, 0) and none.top_logprobs.shape == (12, 0)
    assert compute_logprobs(logits, ids, 100).top_ids.shape == (12, 33)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    gen = torch.Generator().manual_seed(8)
    n, vocab = 64, 4096
    logits = torch.randn(n, vocab, generator=gen) * 3
    params = [MIXED_PARAMS[i % len(MIXED_PARAMS)] for i in range(n)]
    t_cpu = SamplingTensors.build(params, list(range(n)), list(range(n)), "cpu")
    t_gpu = SamplingTensors.build(params, list(range(n)), list(range(n)), "cuda")
    p_cpu = target_probs(logits, t_cpu)
    p_gpu = target_probs(logits.cuda(), t_gpu)
    torch.testing.assert_close(p_gpu.cpu(), p_cpu, rtol=1e-4, atol=1e-6)
    # the same probs give the same tokens (the noise is bit-identical; log may differ by an ulp)
    same = sample(p_cpu.cuda(), t_gpu).cpu() == sample(p_cpu, t_cpu)
    assert same.float().mean().item() > 0.99


def _mixed_rows(seed: int, n: int = 48, vocab: int = 1500) -> torch.Tensor:
    """Peaked rows (a cut among few tokens), flat rows (a cut past the candidates) and rows of
    few distinct values (ties straddling the cut and the candidates' edge)."""
    gen = torch.Generator().manual_seed(seed)
    peaked = torch.randn(n // 3, vocab, generator=gen) * 6
    flat = torch.randn(n // 3, vocab, generator=gen) * 0.05
    ties = torch.randint(-4, 3, (n - 2 * (n // 3), vocab), generator=gen).float() * 1.5
    return torch.cat([peaked, flat, ties])[torch.randperm(n, generator=gen)]


@pytest.mark.parametrize("seed", range(3))
def test_cpu_top_p_from_candidates_is_the_full_sort(seed: int, monkeypatch) -> None:
    from specserve.ops import sampling

    x = _mixed_rows(seed, n=60, vocab=6000)
    n = x.shape[0]
    gen = torch.Generator().manual_seed(100 + seed)
    top_p = torch.rand(n, generator=gen) * 0.99 + 0.005
    top_p[:3] = torch.tensor([1.0, 1e-6, 0.999999])
    probs = x.softmax(dim=-1)
    proved: dict[int, int] = {}
    cut_among = sampling._cut_among

    def spy(*args):
        done, cols = cut_among(*args)
        proved[args[3]] = int(done.sum())
        return done, cols

    monkeypatch.setattr(sampling, "_cut_among", spy)
    got = sampling._top_p_candidates(x, probs, top_p)
    assert torch.equal(got, sampling._top_p_sorted(x, probs, top_p))
    # every way was taken: each candidate size proved some rows, the full sort took the rest
    assert all(proved.get(k, 0) > 0 for k in sampling.TOP_P_CANDIDATES), proved
    assert 0 < int((top_p < 1).sum()) - sum(proved.values()) < n // 3


def test_cpu_top_k_top_p_keeps_what_the_sorted_definition_keeps() -> None:
    from specserve.ops import sampling

    x = _mixed_rows(7)
    n = x.shape[0]
    gen = torch.Generator().manual_seed(8)
    top_k = torch.randint(0, 400, (n,), generator=gen)
    top_p = torch.rand(n, generator=gen) * 0.9 + 0.05
    got = sampling._apply_top_k_top_p(x, top_k, top_p)
    desc, order = x.sort(dim=-1, descending=True, stable=True)
    masked = x.masked_fill(x < sampling._kth_threshold(desc, top_k), float("-inf"))
    assert torch.equal(got, sampling._top_p_sorted(masked, masked.softmax(-1), top_p, order))


@pytest.mark.parametrize("salt", [SAMPLE_SALT, RESAMPLE_SALT])
def test_filtered_rows_race_as_the_dense_race(salt: int) -> None:
    """Top-p rows (zeros outside the kept set): sample()'s torch race is the dense race exactly;
    the compiled CPU race (tests/ops/test_cpu_race.py for its near-tie bound) agrees here."""
    from specserve.ops import cpu_race
    from specserve.ops.random import hashed_uniform

    x = _mixed_rows(3, n=90, vocab=3000)
    x = x[x.std(dim=-1) > 1.0]  # peaked and tied rows: their top-p sets are small
    n = x.shape[0]
    params = [SamplingParams(temperature=0.9, top_p=0.3 + 0.01 * i, seed=i) for i in range(n)]
    t = SamplingTensors.build(params, [p.seed for p in params], list(range(n)), "cpu")
    probs = target_probs(x, t)
    u = hashed_uniform(t.seed, t.counter, salt, probs.shape[1])
    dense = (probs / u.log().neg()).argmax(dim=-1)
    with env.override(fused_ops=False):
        assert torch.equal(sample(probs, t, salt), dense)
    kernel = cpu_race.race(probs, t.seed, t.counter, salt)
    assert kernel is None or torch.equal(kernel, dense)
