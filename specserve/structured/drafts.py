"""Drafts checked by a request's grammar before verification.

Drafts after the first one the grammar rejects are dropped: verification would reject that one
for certain (its masked target probability is 0), so nothing after it can be emitted.

The rejected draft itself is kept when the drafter has a distribution q (a draft model, EAGLE):
exact rejection sampling resamples a rejected position from norm(max(p - q, 0)), and dropping
the draft instead would sample that position from p, conditioned on the draft having been
invalid: not the target distribution. With a one-hot q (n-gram) the residual of a draft whose
p is 0 is p itself, so the rejected draft goes too and saves its row.
"""

from __future__ import annotations

from specserve.engine.sequence import Sequence


def grammar_keep(seq: Sequence, drafts: list[int], keep_rejected: bool) -> int:
    """How many of a request's drafts to verify (all of them without a grammar)."""
    g = seq.grammar
    if g is None or not drafts:
        return len(drafts)
    n = g.valid_prefix(drafts)
    return min(len(drafts), n + 1) if keep_rejected and n < len(drafts) else n


def truncate_drafts(
    seqs: list[Sequence],
    proposals: list[tuple[list[int], list[float]]],
    keep_rejected: bool,
) -> list[tuple[list[int], list[float]]]:
    """The drafter's proposals (drafts, confidences) cut where each request's grammar says."""
    if all(s.grammar is None for s in seqs):
        return proposals
    out = []
    for s, (d, c) in zip(seqs, proposals):
        k = grammar_keep(s, d, keep_rejected)
        out.append((d[:k], c[:k]) if k < len(d) else (d, c))
    return out
