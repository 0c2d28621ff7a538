"""A deferred step's grammar rows filled while the ledger of the step in flight still runs.

Under overlap a step whose requests have grammars is deferred (engine/launch.py): its masks need
the tokens of the step in flight, so they are filled after that step's ledger, and everything
from the readback to the sampling queued is on the host's critical path. But a request's mask
needs only its own tokens: once the ledger has pushed them, its row can be filled while the
ledger goes on with the others. xgrammar's batched fill runs without the GIL, so chunks of rows
are filled in a background thread, overlapping the ledger's Python work; finish() waits for
them and the plan fills only what is left (requests with drafts, requests not ready).

The masks are the same as filled after the ledger: a request's matcher is not touched again by
the ledger once its tokens are pushed, and a request that stopped is never handed over (its
rows are discarded anyway). A ledger that fails midway waits for the fills before the step is
rolled back (wait()), so no fill reads a matcher that is advanced again later.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from specserve.ops.transfer import pinned_empty
from specserve.structured.matcher import fill_step_rows

CHUNK = 16  # requests per background fill: a few chunks overlap the ledger, each one call
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(1, thread_name_prefix="specserve-mask")
    return _POOL


class MaskPrefill:
    def __init__(self, seqs: list[Any], drafts: list[list[int]], device: torch.device) -> None:
        """seqs, drafts: the deferred step's sampling requests in layout order."""
        self.first_row: dict[int, int] = {}  # id(request) -> its row, grammar and no drafts
        row, width = 0, 0
        for s, d in zip(seqs, drafts):
            if s.grammar is not None and not d:
                self.first_row[id(s)] = row
                width = s.grammar.width
            row += len(d) + 1
        # [total_q, W] int32 laid out by logit row, pinned on CUDA (grammar_bitmask's layout)
        self.bits = pinned_empty((row, width), torch.int32, device) if self.first_row else None
        self.filled: set[int] = set()  # id(request) of the rows filled or being filled
        self._pending: list[Any] = []
        self._futures: list[Future] = []

    def ready(self, seq: Any) -> None:
        """The ledger has pushed seq's tokens and it goes on: its row may be filled."""
        if id(seq) in self.first_row and id(seq) not in self.filled:
            self.filled.add(id(seq))
            self._pending.append(seq)
            if len(self._pending) >= CHUNK:
                self._submit()

    def _submit(self) -> None:
        seqs, self._pending = self._pending, []
        grammars = [s.grammar for s in seqs]
        rows = [self.first_row[id(s)] for s in seqs]
        self._futures.append(_pool().submit(self._fill, grammars, rows))

    def _fill(self, grammars: list[Any], rows: list[int]) -> None:
        t0 = time.perf_counter()
        fill_step_rows(grammars, [[] for _ in grammars], rows, self.bits)
        grammars[0].stats.background_seconds += time.perf_counter() - t0

    def finish(self) -> None:
        """The ledger is done: the last rows filled, every fill waited for (its error raised)."""
        if self._pending:
            self._submit()
        self.wait(raise_errors=True)

    def wait(self, raise_errors: bool = False) -> None:
        futures, self._futures = self._futures, []
        error = None
        for f in futures:
            e = f.exception()  # waits
            error = error or e
        if error is not None and raise_errors:
            raise error
