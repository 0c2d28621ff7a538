"""Prompt logprobs (vLLM's `prompt_logprobs`): the logprob of each prompt token given its prefix,
plus the top-N, scored on the prefill's own rows.

Row p of a prefill (the one fed prompt token p) predicts prompt token p + 1, so a request that
asks gets logits for its prompt rows 0 .. P-2 as well as its sampling row, over however many
chunks its prefill takes; requests that do not ask cost nothing. Like sample logprobs (and
vLLM's default "raw_logprobs" mode) they are of the RAW model logits: no temperature, bias,
whitelist, bad words or penalties. The scheduler does not serve such a request's prompt from the
prefix cache (vLLM neither): cached rows have no hidden states to score.

Each chunk's results start their copy to the host as soon as they are computed (pinned memory,
one event): the ledger reads them with the request's first output, after the step that
finished the prompt, without waiting for steps queued after that one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from specserve.engine.outputs import LOGPROB_FLOOR, Logprob
from specserve.ops.logprobs import compute_logprobs
from specserve.ops.transfer import Readback

# rows scored per lm_head call: bounds the [rows, V] fp32 logits a long chunk materialises
SCORE_ROWS = 512


class PromptLogprobs:
    """One request's prompt logprobs, accumulated over its prefill chunks (Sequence state)."""

    def __init__(self, num_top: int, prompt_token_ids: list[int]) -> None:
        self.num_top = num_top
        self.prompt_token_ids = prompt_token_ids
        self.delivered = False  # result() was taken (with the first output): score no more
        self._parts: list[tuple[int, Readback]] = []  # (first row, its results on their way)

    @property
    def last_row(self) -> int:
        """Rows [0, last_row) predict a prompt token (the last prompt row predicts output 0)."""
        return len(self.prompt_token_ids) - 1

    def take_rows(self, start: int, num_tokens: int) -> range:
        """The prompt rows to score among the positions [start, start + num_tokens) a step
        feeds. A row fed again before the first output (recompute after a preemption, a step
        re-run after a failure) is scored again and its newest scores count; none after."""
        if self.delivered:
            return range(0)
        return range(start, max(start, min(start + num_tokens, self.last_row)))

    def add(self, first_row: int, parts: list[torch.Tensor]) -> None:
        self._parts.append((first_row, Readback(parts)))

    def result(self, decode: Callable[[int], str | None]) -> list[dict[int, Logprob] | None]:
        """vLLM's shape: one entry per prompt token, None for the first; entry i holds prompt
        token i (its logprob and rank) and the top-N, logprobs clamped to LOGPROB_FLOOR."""
        self.delivered = True
        n_prompt = len(self.prompt_token_ids)
        out: list[dict[int, Logprob] | None] = [None] * n_prompt
        names: dict[int, str | None] = {}

        def name(tok: int) -> str | None:
            if tok not in names:
                names[tok] = decode(tok)
            return names[tok]

        for first, readback in self._parts:
            lp, ranks, top_ids, top_lps = (x.tolist() for x in readback.wait())
            for i in range(len(lp)):
                pos = first + i + 1  # the prompt token row first + i predicts
                tok = self.prompt_token_ids[pos]
                entry = {tok: Logprob(_clamp(lp[i]), ranks[i], name(tok))}
                for rank, (tid, v) in enumerate(zip(top_ids[i], top_lps[i]), start=1):
                    if tid not in entry:
                        entry[tid] = Logprob(_clamp(v), rank, name(tid))
                out[pos] = entry
        missing = [i for i in range(1, n_prompt) if out[i] is None]
        assert not missing, f"prompt rows never scored: {missing[:8]}"
        return out


def _clamp(lp: float) -> float:
    return lp if lp > LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN fails the test too


class PromptRows(NamedTuple):
    """A step's prompt rows to score."""

    rows: torch.Tensor  # [S] int64, rows among the step's T rows
    targets: torch.Tensor  # [S] int64, the prompt token each row predicts
    num_top: int  # largest top-N among the requests
    spans: list[tuple[PromptLogprobs, int, int]]  # (request state, first prompt row, count)


def score_prompt_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],  # [n, hidden] -> [n, V] fp32
    hidden: torch.Tensor,  # [T, hidden] final hidden states of the step
    prompt: PromptRows,
) -> None:
    """Logprob, rank and top-N of each prompt row's next prompt token, handed to each request's
    state (results stay on the device; their copy to the host starts here)."""
    chunks = []
    for lo in range(0, prompt.rows.shape[0], SCORE_ROWS):
        rows = prompt.rows[lo : lo + SCORE_ROWS]
        logits = compute_logits(hidden[rows])  # [n, V]
        chunks.append(
            compute_logprobs(logits, prompt.targets[lo : lo + SCORE_ROWS], prompt.num_top)
        )
    lp = torch.cat([c.token_logprob for c in chunks])  # [S]
    rank = torch.cat([c.token_rank for c in chunks])  # [S]
    top_ids = torch.cat([c.top_ids for c in chunks])  # [S, num_top]
    top_lps = torch.cat([c.top_logprobs for c in chunks])  # [S, num_top]
    at = 0
    for state, first, count in prompt.spans:
        n = state.num_top
        s = slice(at, at + count)
        state.add(first, [lp[s], rank[s], top_ids[s, :n], top_lps[s, :n]])
        at += count
