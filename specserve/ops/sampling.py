"""Batched sampling: logits -> filtered distribution -> token, for N sample rows at once.

Two pure functions so the speculative verifier can reuse them:
  target_probs(logits, t) is the exact distribution a row samples from. Called on target logits
      it gives p, on draft logits q; rejection sampling needs both from the same definition.
  sample(probs, t) draws from it with an exponential race keyed by (seed, counter, salt), so a
      seeded row draws the same token whatever the batch, and a GPU kernel can match it.

No Python loop over rows and no host sync: the per-batch Python flags in SamplingTensors
(computed once in build(), from Python values) pick the fast paths instead of tensor checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.ops.random import hashed_uniform, to_int64_bits
from specserve.ops.transfer import h2d
from specserve.sampling_params import SamplingParams

# Salts give independent random streams for the same (seed, counter). The verifier draws its
# accept uniform and its residual resample from streams distinct from plain sampling, and a
# drafter that samples must not reuse the target's stream either (its q would be correlated
# with the target's draw, breaking the exactness argument of rejection sampling).
SAMPLE_SALT = 1
ACCEPT_SALT = 2
RESAMPLE_SALT = 3
DRAFT_SALT = 4


@dataclass
class SamplingTensors:
    """Per-row sampling parameters for one step (one row per sampled or verified position)."""

    temperature: torch.Tensor  # [N] float32; 0 -> greedy row
    top_k: torch.Tensor  # [N] int32; 0 -> off
    top_p: torch.Tensor  # [N] float32; 1 -> off
    min_p: torch.Tensor  # [N] float32; 0 -> off
    seed: torch.Tensor  # [N] int64 (bit pattern of the request seed mod 2**64)
    counter: torch.Tensor  # [N] int64; index of the output token this row would produce
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_top_k: int  # largest top_k over sampling rows; sizes torch.topk without a host sync

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        counters: Sequence[int],
        device: torch.device | str,
    ) -> SamplingTensors:
        """One row per entry of params (a request with k verify rows repeats its params k+1
        times, with counters n, n+1, ..., n+k). Filters on greedy rows are dropped so the
        any_* flags only wake up for rows that actually sample."""
        if not (len(params) == len(seeds) == len(counters)):
            raise ValueError(
                f"params/seeds/counters lengths differ: {len(params)}, {len(seeds)}, {len(counters)}"
            )
        greedy = [p.greedy for p in params]
        temperature = [0.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        top_k = [0 if g else int(p.top_k) for p, g in zip(params, greedy)]
        top_p = [1.0 if g else float(p.top_p) for p, g in zip(params, greedy)]
        min_p = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]

        dev = torch.device(device)

        def f32(xs: list[float]) -> torch.Tensor:
            return h2d(xs, torch.float32, dev)

        return cls(
            temperature=f32(temperature),
            top_k=h2d(top_k, torch.int32, dev),
            top_p=f32(top_p),
            min_p=f32(min_p),
            # Seeds may be any Python int (negative, or >= 2**63); keep their low 64 bits.
            seed=h2d([to_int64_bits(s) for s in seeds], torch.int64, dev),
            counter=h2d(list(counters), torch.int64, dev),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p),
            any_min_p=any(m > 0.0 for m in min_p),
            max_top_k=max(top_k, default=0),
        )


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N, V] float32 one-hot at argmax (ties -> lowest index, torch.argmax's rule).
    scatter_ rather than F.one_hot: the latter validates indices with a host sync on CUDA."""
    idx = logits.argmax(dim=-1, keepdim=True)  # [N, 1]
    return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(
        1, idx, 1.0
    )


def _kth_threshold(desc: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """The k-th largest value per row, or -inf where top_k == 0 (off).

    desc [N, K] values sorted descending (K >= every active top_k, or clamped) -> [N, 1].
    Filtering with `x < kth` keeps ties with the k-th value, so the kept set is a function of
    the values alone (no dependence on how a sort orders equal values).
    """
    k = top_k.to(torch.int64).clamp(1, desc.shape[1])  # [N]
    kth = desc.gather(1, (k - 1)[:, None])  # [N, 1]
    return torch.where((top_k > 0)[:, None], kth, float("-inf"))


def _apply_top_k(x: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Top-k without a full-vocab sort: topk of the largest requested k, then a threshold."""
    k_max = min(max_top_k, x.shape[1])
    desc = x.topk(k_max, dim=-1).values  # [N, k_max]
    return x.masked_fill(x < _kth_threshold(desc, top_k), float("-inf"))  # [N, V]


def _top_p_keep(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[N, M] probabilities in descending token order -> [N, M] bool, a prefix per row: a token
    is kept iff the mass strictly before it is < top_p. The exclusive mass is taken from the
    same running sum (not cum - probs), so it is exactly the value the previous position saw."""
    cum = sorted_probs.cumsum(dim=-1)  # [N, M]
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # [N, M]
    p = top_p[:, None]  # [N, 1]
    # Rows with top_p >= 1 keep everything: float cumsum can reach 1.0 before the tail ends.
    return (before < p) | (p >= 1.0)


# CPU top-p looks for each row's cut among its 256 largest logits, then among 4,096 for the
# rows whose cut lies further, before sorting the whole vocabulary for what is left (exact at
# every stage). On 2 cores, 64 rows of 49k tokens: topk(256) ~5 ms, topk(4096) ~25 ms with
# its sorts, the full sort ~110 ms.
TOP_P_CANDIDATES = (256, 4096)


def _top_p_candidates(x: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """_top_p_sorted, searched among each row's largest candidates first: the same result.
    Works on a [N, V] keep mask and indexes whole rows only where it must: each [N, V] float
    temporary costs milliseconds of page faults at 64 rows of 49k tokens."""
    n, v = x.shape
    keep = (top_p >= 1.0)[:, None].expand(n, v).clone()  # [N, V] bool
    flat = keep.view(-1)
    rows = (top_p < 1.0).nonzero().squeeze(1)  # [n] rows still open
    for k in TOP_P_CANDIDATES:
        if rows.numel() == 0 or k >= v:
            break
        everyone = rows.numel() == n
        xs, ps = (x, probs) if everyone else (x[rows], probs[rows])
        done, cols = _cut_among(xs, ps, top_p[rows], k)  # [n] bool, [n, k] kept ids or -1
        at = rows[done, None] * v + cols[done]
        flat[at[cols[done] >= 0]] = True
        rows = rows[~done]
    if rows.numel():
        xs, ps = x[rows], probs[rows]
        order = xs.sort(dim=-1, descending=True, stable=True).indices  # [n, V]
        kept = _top_p_keep(ps.gather(1, order), top_p[rows])
        at = rows[:, None] * v + order
        flat[at[kept]] = True
    return x.masked_fill(~keep, float("-inf"))


def _cut_among(
    x: torch.Tensor,  # [n, V]
    probs: torch.Tensor,  # [n, V]
    top_p: torch.Tensor,  # [n]
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([n] bool: the rows whose cut the k largest candidates prove, [n, k] their kept token
    ids, -1 past the cut)."""
    vals, idx = x.topk(k, dim=-1)  # [n, k], descending; which ids tie the k-th value: any
    # the stable descending order of the candidates: by value, ties to the lower id
    idx, perm = idx.sort(dim=-1)
    vals, perm = vals.gather(1, perm).sort(dim=-1, descending=True, stable=True)
    idx = idx.gather(1, perm)
    keep = _top_p_keep(probs.gather(1, idx), top_p)  # [n, k], a prefix per row
    n_keep = keep.sum(dim=-1)  # [n] >= 1
    last = vals.gather(1, (n_keep - 1)[:, None]).squeeze(1)  # [n] value of the last kept
    # Every token above the k-th value is a candidate, in the full sort's order, with the
    # same probabilities and running sum: the cut is the full sort's when it falls inside the
    # candidates and every kept one is above the k-th value.
    done = (n_keep < k) & (last > vals[:, -1])
    return done, idx.masked_fill(~keep, -1)


def _apply_top_k_top_p(
    x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k (optional), then top-p over the probabilities renormalised after it: token i of
    the descending order (stable: among equal values the lower id first, so the kept set is
    deterministic when a tie straddles the cut) is kept iff the mass strictly before it is
    < top_p; the first token always is. The probabilities are the row's softmax in vocabulary
    order, read in sorted order, so a prefix of the order has the running sum the whole order
    has: the CPU searches the cut among the largest candidates first (a full sort costs ~2 ms
    per 49k-token row there). CUDA sorts: no data-dependent host sync, graph-capturable (the
    top-k threshold comes from the sort, not from a host-known largest k)."""
    if x.device.type == "cpu":
        k_max = 0 if top_k is None else int(top_k.max())
        if k_max > 0:
            x = _apply_top_k(x, top_k, k_max)
        return _top_p_candidates(x, x.softmax(dim=-1), top_p)
    desc, order = x.sort(dim=-1, descending=True, stable=True)  # [N, V] each
    if top_k is not None:
        # masked tokens sit after every kept one in this order, so it stays a valid order
        x = x.masked_fill(x < _kth_threshold(desc, top_k), float("-inf"))
    return _top_p_sorted(x, x.softmax(dim=-1), top_p, order)


def _top_p_sorted(
    x: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor, order: torch.Tensor | None = None
) -> torch.Tensor:
    """The cut over the full descending order (`order`: x's stable sort, else sorted here)."""
    if order is None:
        order = x.sort(dim=-1, descending=True, stable=True).indices  # [N, V]
    keep = _top_p_keep(probs.gather(1, order), top_p)
    return x.masked_fill(~torch.empty_like(keep).scatter_(1, order, keep), float("-inf"))


def _apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens with prob >= min_p * max prob, tested in the log domain as
    x - max(x) >= log(min_p). Scale-invariant, so it does not matter that earlier filters
    left the row unnormalised. min_p == 0 gives log 0 = -inf: keeps everything."""
    row_max = x.max(dim=-1, keepdim=True).values  # [N, 1]
    log_min_p = min_p.log()[:, None]  # [N, 1]
    return x.masked_fill((x - row_max) < log_min_p, float("-inf"))  # [N, V]


def target_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The exact distribution each row samples from: [N, V] logits -> [N, V] float32 probs.

    Sampling rows: logits / temperature, then top-k, top-p, min-p (in that order, as in HF;
    vLLM applies min-p first, which differs only when top-p and min-p are combined), then
    softmax over the survivors. Greedy rows (temperature 0): one-hot at argmax of the logits.
    Pure in (logits, params), so the same call gives the target p and the draft q.
    A sampling row whose logits are all -inf comes out NaN; callers must not mask everything.
    """
    logits = logits.to(torch.float32)
    if t.all_greedy:
        return _one_hot_argmax(logits)
    greedy = t.temperature <= 0.0  # [N]
    # Greedy rows get temperature 1 here only to stay finite; they are replaced below.
    temp = torch.where(greedy, 1.0, t.temperature)  # [N]
    x = logits / temp[:, None]  # [N, V]
    if t.any_top_p:
        x = _apply_top_k_top_p(x, t.top_k if t.any_top_k else None, t.top_p)
    elif t.any_top_k:
        x = _apply_top_k(x, t.top_k, t.max_top_k)
    if t.any_min_p:
        x = _apply_min_p(x, t.min_p)
    probs = x.softmax(dim=-1)  # [N, V]
    if t.any_greedy:
        probs = torch.where(greedy[:, None], _one_hot_argmax(logits), probs)
    return probs


def sample(probs: torch.Tensor, t: SamplingTensors, salt: int = SAMPLE_SALT) -> torch.Tensor:
    """Draw one token per row: [N, V] probs -> [N] int64.

    Exponential race: token = argmax_i probs[i] / E_i with E_i = -log(u_i) i.i.d. Exp(1), u from
    hashed_uniform(seed, counter, salt, V). P(token = i) = probs[i] / sum(probs), so probs need
    not be normalised (the verifier can pass max(p - q, 0) directly, with RESAMPLE_SALT).
    Zero-probability tokens score 0 and lose to any positive one. Greedy rows take argmax(probs)
    (their probs are one-hot). If a row is all zeros, token 0 comes out; callers must not do that.
    """
    greedy_ids = probs.argmax(dim=-1)  # [N]
    if t.all_greedy:
        return greedy_ids
    ids = None
    if probs.device.type == "cpu":
        from specserve.ops import cpu_race

        ids = cpu_race.race(probs, t.seed, t.counter, salt)
    if ids is None:
        u = hashed_uniform(t.seed, t.counter, salt, probs.shape[1])  # [N, V] in (0, 1)
        exp_noise = u.log_().neg_()  # [N, V], E = -log u > 0 since u < 1
        ids = (probs.to(torch.float32) / exp_noise).argmax(dim=-1)  # [N]
    if t.any_greedy:
        ids = torch.where(t.temperature <= 0.0, greedy_ids, ids)
    return ids
