"""One request's grammar state: advanced for real only by the tokens the ledger emits; advanced
through a step's drafts (then rolled back) to check them and to fill one bitmask row per verify
row.

Row j of a request's verify rows is the distribution of the token after its output and the j
drafts before the row, so its mask is the matcher's state after those drafts: exactly the mask
plain decoding would apply had the drafts been emitted one step at a time. With every row masked
so, rejection sampling verifies against the masked target distribution and stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class MaskStats:
    """Host time spent filling grammar bitmasks (one engine's backend)."""

    steps: int = 0  # steps with at least one grammar row
    rows: int = 0
    seconds: float = 0.0

    def record(self, rows: int, seconds: float) -> None:
        self.steps += 1
        self.rows += rows
        self.seconds += seconds


_BATCH: Any = None  # one xgrammar.BatchGrammarMatcher: its thread pool fills many rows at once


def _fill(matchers: list[Any], bitmask: torch.Tensor, rows: list[int]) -> None:
    """bitmask[rows[i]] = the mask of matchers[i], in one call that xgrammar spreads over its
    threads: at 64 requests one at a time costs ~12 us a row on one core."""
    global _BATCH
    if len(matchers) == 1:
        matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        return
    if _BATCH is None:
        import xgrammar

        _BATCH = xgrammar.BatchGrammarMatcher("auto")
    _BATCH.batch_fill_next_token_bitmask(matchers, bitmask, rows)


def fill_step_rows(
    grammars: list[RequestGrammar],
    drafts: list[list[int]],
    firsts: list[int],
    bitmask: torch.Tensor,  # [R, W] int32
) -> None:
    """bitmask[firsts[i] + j] = the mask of grammars[i] after drafts[i][:j], for j = 0 ..
    len(drafts[i]): RequestGrammar.fill_rows for every request at once, one batched fill per
    draft depth (a step without drafts: one call for all its rows) and one batched accept of
    the drafts between depths. The matchers are left as they were. A row the ledger filled
    already (RequestGrammar.finished, a complete grammar) is copied, not filled again."""
    import xgrammar

    batch = xgrammar.BatchGrammarMatcher
    accepted = [0] * len(grammars)
    live = list(range(len(grammars)))  # requests whose row `depth` is reached
    depth = 0
    while live:
        fill = []
        for i in live:
            g = grammars[i]
            if depth == 0 and g.cached_row:
                bitmask[firsts[i]] = g._scratch[0]
            else:
                fill.append(i)
        if fill:
            _fill([grammars[i].m for i in fill], bitmask, [firsts[i] + depth for i in fill])
        stepping = [i for i in live if depth < len(drafts[i])]
        live = []
        if stepping:
            ms = [grammars[i].m for i in stepping]
            ok = batch.batch_accept_token(ms, [drafts[i][depth] for i in stepping])
            for i, m, a in zip(stepping, ms, ok):
                accepted[i] += a
                if a and not m.is_terminated():
                    live.append(i)
                    continue
                # past a rejected draft or a stop token: never reached (that draft is
                # rejected, or the request stops there), but never empty either
                at = firsts[i] + depth
                bitmask[at + 1 : firsts[i] + len(drafts[i]) + 1] = bitmask[at]
        depth += 1
    back = [(g.m, n) for g, n in zip(grammars, accepted) if n]
    if back:
        batch.batch_rollback([m for m, _ in back], [n for _, n in back])


class GrammarRejected(ValueError):
    """A token the grammar does not allow reached the ledger (a bug, or a request whose other
    bans left its mask empty): the request ends alone."""


class RequestGrammar:
    def __init__(
        self, matcher: Any, width: int, stop_ids: list[int], stats: MaskStats | None = None
    ) -> None:
        self.m = matcher  # xgrammar.GrammarMatcher
        self.width = width  # int32 words per bitmask row
        self.stop_ids = stop_ids
        self.stats = stats if stats is not None else MaskStats()
        self._scratch = torch.zeros(1, width, dtype=torch.int32)
        # _scratch holds the mask of the matcher's state as it stands (finished() filled it):
        # the next step's first row, copied instead of filled twice
        self.cached_row = False
        self._terminating = frozenset(matcher.stop_token_ids)  # the matcher's own stop tokens

    # -- the ledger ---------------------------------------------------------------------------
    def advance(self, token: int) -> bool:
        """Accept an emitted token. True when the grammar is now finished (the request stops)."""
        self.cached_row = False
        if not self.m.accept_token(token):
            raise GrammarRejected(f"token {token} is not allowed by the request's grammar")
        if token in self._terminating:
            return True  # an accepted stop token terminates the matcher (no query needed)
        # any other token leaves it running (only a stop token terminates it)
        return self.m.is_completed() and self._only_stop_follows()

    def finished(self) -> bool:
        """Terminated (a stop token accepted), or complete with nothing but a stop token able to
        follow: the next token would be EOS with probability 1, so the request ends now."""
        if self.m.is_terminated():
            return True
        return self.m.is_completed() and self._only_stop_follows()

    def _only_stop_follows(self) -> bool:
        # complete (a value closed; more may follow, e.g. digits of a number): the full mask
        # tells, and it is the next step's first row, so it is kept for that (cached_row)
        self.m.fill_next_token_bitmask(self._scratch, 0)
        rest = self._scratch.clone()
        for s in self.stop_ids:
            rest[0, s // 32] &= ~(1 << (s % 32))
        self.cached_row = bool(rest.any())
        return not self.cached_row

    # -- drafts -------------------------------------------------------------------------------
    def valid_prefix(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar accepts (the matcher is left as it was)."""
        n = 0
        for t in drafts:
            if self.m.is_terminated() or not self.m.accept_token(t):
                break
            n += 1
        if n:
            self.m.rollback(n)
        return n

    def fill_rows(self, bitmask: torch.Tensor, first: int, drafts: list[int]) -> None:
        """bitmask[first + j] = the mask after drafts[:j], for j = 0 .. len(drafts); the
        matcher is left as it was. A row past a draft the grammar rejects, or past a stop token,
        is never reached (that draft is rejected, or the request stops there): it gets the
        previous row's mask so that no row is empty."""
        accepted = 0
        live = True
        for j in range(len(drafts) + 1):
            if live:
                self.m.fill_next_token_bitmask(bitmask, first + j)
            else:
                bitmask[first + j] = bitmask[first + j - 1]
            if j < len(drafts) and live:
                if self.m.accept_token(drafts[j]):
                    accepted += 1
                    live = not self.m.is_terminated()
                else:
                    live = False
        if accepted:
            self.m.rollback(accepted)

    def allows(self, bitmask: torch.Tensor, row: int, token: int) -> bool:
        return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)
