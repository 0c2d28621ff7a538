"""Rejection sampling under a grammar mask is lossless: with drafts drawn from an unmasked q, the
first emitted token of a one-draft step is distributed as the MASKED target p, when drafts are
checked by the grammar as the engine does (structured/drafts.py). Dropping a rejected draft of
a drafter with q (sampling that position from p instead of the residual) is caught."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specserve.ops.logits_processing import LogitsProcessing, apply_logits_processing
from specserve.ops.random import hashed_uniform
from specserve.ops.sampling import DRAFT_SALT, SamplingTensors, target_probs
from specserve.sample.layout import build_layout
from specserve.sample.verify import verify
from specserve.sampling_params import SamplingParams
from specserve.structured.drafts import grammar_keep

N = 120_000
V = 8
ALLOWED = [0, 2, 3, 5, 6]  # the grammar's mask at this position
CHI2_CRIT = 23.5  # df = 4 (five allowed tokens) at p = 1e-4


class _OneTokenGrammar:
    """A grammar whose next token must be one of ALLOWED (valid_prefix as RequestGrammar's)."""

    def valid_prefix(self, drafts: list[int]) -> int:
        n = 0
        for t in drafts:
            if t not in ALLOWED:
                break
            n += 1
            break  # the mask after the first token is not modelled: one draft per request
        return n


def _bits(rows: int) -> torch.Tensor:
    word = sum(1 << t for t in ALLOWED)
    return torch.full((rows, 1), word, dtype=torch.int32)


def _first_tokens(keep_rejected: bool) -> tuple[torch.Tensor, torch.Tensor]:
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(3)
    target_logits = torch.randn(V, generator=g) * 1.5
    draft_logits = torch.randn(V, generator=g) * 1.5
    t1 = SamplingTensors.build([params] * N, list(range(N)), [0] * N, "cpu")
    q1 = target_probs(draft_logits.expand(N, V).contiguous(), t1)  # [N, V]
    u = hashed_uniform(t1.seed, t1.counter, DRAFT_SALT, V)
    drafts = (q1 / -torch.log(u)).argmax(-1).tolist()  # one draft per request, from q
    seq = SimpleNamespace(grammar=_OneTokenGrammar())
    kept = [grammar_keep(seq, [d], keep_rejected) for d in drafts]  # 0 or 1 draft
    seqlens = [1 + k for k in kept]
    total = sum(seqlens)
    rows_seed = [i for i, n in enumerate(seqlens) for _ in range(n)]
    rows_counter = [j for n in seqlens for j in range(n)]
    t = SamplingTensors.build([params] * total, rows_seed, rows_counter, "cpu")
    layout = build_layout(torch.tensor(seqlens), total, 1)
    logits = target_logits.expand(total, V).contiguous()
    proc = LogitsProcessing(None, None, None, (torch.arange(total), _bits(total)))
    masked = apply_logits_processing(logits, proc)  # every row's target is the masked one
    draft_rows, q_rows = [], []
    for d, k in zip(drafts, kept):
        if k:
            draft_rows.append(d)
            q_rows.append(q1[0])
        draft_rows.append(0)
        q_rows.append(torch.zeros(V))
    res = verify(masked, torch.tensor(draft_rows), torch.stack(q_rows), t, layout)
    ftp = torch.tensor([0] + seqlens[:-1]).cumsum(0)
    v = res.verified_token_ids[ftp]
    first = torch.where(v >= 0, v.long(), res.sampled_token_ids)
    p = target_probs(
        apply_logits_processing(
            target_logits.unsqueeze(0),
            LogitsProcessing(None, None, None, (torch.tensor([0]), _bits(1))),
        ),  # fmt: skip
        SamplingTensors.build([params], [0], [0], "cpu"),
    )[0]
    return first, p


def _chi2(first: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(first, minlength=V).double()
    expected = p.double() * N
    assert counts[expected == 0].sum() == 0, "a token the grammar forbids was emitted"
    m = expected > 0
    return float(((counts[m] - expected[m]) ** 2 / expected[m]).sum())


def test_masked_target_is_the_emitted_distribution():
    first, p = _first_tokens(keep_rejected=True)
    assert _chi2(first, p) < CHI2_CRIT


def test_dropping_a_rejected_q_draft_is_caught():
    first, p = _first_tokens(keep_rejected=False)
    assert _chi2(first, p) > CHI2_CRIT


@pytest.mark.parametrize("keep", [True, False])
def test_grammar_keep_counts(keep):
    """For q = one-hot (n-gram) a draft with p = 0 has residual p: dropping it is exact too.
    Simulated by a drafter that always proposes token 1 (outside the mask)."""
    seq = SimpleNamespace(grammar=_OneTokenGrammar())
    assert grammar_keep(seq, [1, 2], keep_rejected=keep) == (1 if keep else 0)
    assert grammar_keep(seq, [2, 1], keep_rejected=keep) == (2 if keep else 1)
    assert grammar_keep(SimpleNamespace(grammar=None), [1, 2], keep) == 2
