"""How many draft rows a request verifies when its drafts live on the device (device drafters).

The host fixes each request's rows (the step's layout) before it knows the drafts: under
overlap the step that drafts them is still in flight. A request whose drafts turn out fewer
than its rows verifies -1 drafts there, which no verification accepts, so the accepted prefix
ends at them (lossless; the rows cost their compute only).

The most rows a request may take: k (or the verify budget's choice for it), capped by its
room.
"""

from __future__ import annotations

from specserve.engine.sequence import Sequence


def draft_rows(seq: Sequence, k: int, row_budget: int, max_model_len: int) -> int:
    """Draft rows for a decode-ready request: k at most, capped so the drafts never push it past
    max_model_len, max_tokens or the step's row budget. Counts the drafts in flight as
    accepted (an upper bound on its tokens), so the room is never overestimated."""
    if seq.params.reads_output_tokens:
        # penalties, bad words, grammars read every token on the host, drafts included: the
        # host never sees a device drafter's drafts, so such a request verifies none
        return 0
    n_tokens = seq.num_tokens + seq.num_pending + seq.num_pending_drafts
    room = min(k, row_budget - 1, max_model_len - n_tokens)
    if seq.params.max_tokens is not None:
        room = min(room, seq.params.max_tokens - (n_tokens - seq.num_prompt_tokens) - 1)
    return max(0, room)
