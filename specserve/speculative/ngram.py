"""N-gram (prompt lookup) drafter: propose the tokens that followed the most recent earlier
occurrence of the sequence's last n tokens, n from prompt_lookup_max down to prompt_lookup_min.

Incremental: each request keeps a hash index of its n-grams, extended by the tokens appended since
the last call, so a proposal costs O(new tokens * n range), never a rescan of the history.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.engine.sequence import Sequence
from specserve.speculative.acceptance import AcceptanceEstimator


@dataclass
class NgramIndex:
    n_min: int
    n_max: int
    # n -> n-gram -> position right after its most recent occurrence (where its continuation starts)
    tables: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed_until: int = 0  # n-grams ending at positions <= this are indexed

    def update(self, tokens: list[int]) -> None:
        # index n-grams that have a continuation, i.e. end strictly before the last token; the
        # suffix itself is looked up, never found as its own match
        last_end = len(tokens) - 1
        for end in range(max(self.indexed_until + 1, 1), last_end + 1):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.tables.setdefault(n, {})[tuple(tokens[end - n : end])] = end
        self.indexed_until = max(self.indexed_until, last_end)

    def match(self, tokens: list[int]) -> tuple[int, int]:
        """(where the continuation starts, the matched length n), or (-1, 0): no match."""
        self.update(tokens)
        for n in range(min(self.n_max, len(tokens)), self.n_min - 1, -1):
            start = self.tables.get(n, {}).get(tuple(tokens[-n:]))
            if start is not None:
                return start, n
        return -1, 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        start, _ = self.match(tokens)
        return tokens[start : start + k] if start >= 0 else []


class NgramDrafter:
    """Model-free: q is one-hot, so no draft distribution is stored. Its confidence per position
    comes from the acceptance estimator (the verify budget's input), by the matched length: the
    kind of its drafts."""

    has_q = False

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._index: dict[str, NgramIndex] = {}
        self._kind: dict[str, int] = {}  # request -> matched length of its newest drafts
        self.acceptance = AcceptanceEstimator()

    def _match(self, seq: Sequence) -> tuple[int, int]:
        idx = self._index.get(seq.request_id)
        if idx is None:
            idx = self._index[seq.request_id] = NgramIndex(self.n_min, self.n_max)
        return idx.match(seq.token_ids)

    def propose(
        self, seqs: list[Sequence], limits: list[int]
    ) -> list[tuple[list[int], list[float]]]:
        out = []
        for seq, k in zip(seqs, limits):
            start, n = self._match(seq) if k > 0 else (-1, 0)
            drafts = seq.token_ids[start : start + k] if start >= 0 else []
            self._kind[seq.request_id] = n
            out.append((drafts, self.acceptance.confidences(seq.request_id, len(drafts), n)))
        return out

    def observe(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        kind = self._kind.get(seq.request_id, 0)
        self.acceptance.record(seq.request_id, num_drafts, num_accepted, kind)

    def release(self, seq: Sequence) -> None:
        self._index.pop(seq.request_id, None)
        self._kind.pop(seq.request_id, None)
        self.acceptance.release(seq.request_id)

    def plan_confidences(self, seq: Sequence, k: int) -> list[float] | None:
        """The confidences of the drafts it would make now, 0 past them (no match: none)."""
        start, n = self._match(seq)
        avail = 0 if start < 0 else min(k, len(seq.token_ids) - start)
        return self.acceptance.confidences(seq.request_id, avail, n) + [0.0] * (k - avail)
