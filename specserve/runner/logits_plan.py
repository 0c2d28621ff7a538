"""The host's half of logits processing: which (row, token) pairs of a step get a logit bias, a
whitelist or a ban, read from the requests at launch (device half: ops/logits_processing.py).

Every row a request samples from gets the processing, verify rows included: row j of a request
sees its output tokens followed by the j drafts before it, exactly the tokens it would have seen
had those drafts been emitted one step at a time. So the processed target distribution of each
verify row is the one plain decoding samples from, and speculation stays lossless.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from specserve.engine.sequence import Sequence
from specserve.ops.logits_processing import LogitsProcessing
from specserve.ops.transfer import h2d


def bad_word_bans(words: Seq[Seq[int]], output: Seq[int], drafts: Seq[int]) -> list[list[int]]:
    """Tokens banned at each of the len(drafts) + 1 rows (vLLM's rule): a word's last token is
    banned at a row whose past tokens (output, then the drafts before the row) end with the
    word's other tokens; a one-token word is banned everywhere; a word longer than the past
    plus one token cannot match yet."""
    longest = max((len(w) for w in words), default=1) - 1
    # only the last `longest` output tokens can take part in a match
    tail = list(output[-longest:]) if longest > 0 else []
    n_out = len(output)
    bans: list[list[int]] = []
    for j in range(len(drafts) + 1):
        past = tail + list(drafts[:j])  # the end of the tokens before row j
        row: list[int] = []
        for w in words:
            k = len(w) - 1
            if k > n_out + j:
                continue
            if k == 0 or past[len(past) - k :] == list(w[:k]):
                row.append(w[-1])
        bans.append(row)
    return bans


def plan_logits_processing(
    seqs: list[Sequence], drafts: list[list[int]], device: torch.device
) -> LogitsProcessing | None:
    """Flat row/column lists over the step's verify layout (request i owns rows
    ftp[i] .. ftp[i] + len(drafts[i])). None when no request asks for any of it."""
    if not any(s.params.has_logits_processing for s in seqs):
        return None
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_vals: list[float] = []
    allow_rows: list[int] = []
    allow_ids: list[list[int]] = []
    ban_rows: list[int] = []
    ban_cols: list[int] = []
    row = 0
    for seq, d in zip(seqs, drafts):
        p = seq.params
        n = len(d) + 1
        if p.logit_bias:
            cols, vals = list(p.logit_bias), list(p.logit_bias.values())
            for j in range(n):
                bias_rows.extend([row + j] * len(cols))
                bias_cols.extend(cols)
                bias_vals.extend(vals)
        if p.allowed_token_ids is not None:
            allow_rows.extend(range(row, row + n))
            allow_ids.extend([p.allowed_token_ids] * n)
        if p.bad_words_token_ids:
            assert not seq.num_pending, "bad_words need every output token on the host"
            out = seq.token_ids[seq.num_prompt_tokens :]
            for j, banned in enumerate(bad_word_bans(p.bad_words_token_ids, out, d)):
                if p.allowed_token_ids is not None and set(p.allowed_token_ids) <= set(banned):
                    # a row of -inf has no token to sample: the request ends here, alone
                    raise ValueError(
                        f"{seq.request_id}: bad_words ban every token allowed_token_ids permits"
                    )
                ban_rows.extend([row + j] * len(banned))
                ban_cols.extend(banned)
        row += n

    def i64(x: list[int] | np.ndarray) -> torch.Tensor:
        return h2d(x, torch.int64, device)

    bias = allowed = banned = None
    if bias_rows:
        bias = (i64(bias_rows), i64(bias_cols), h2d(bias_vals, torch.float32, device))
    if allow_rows:
        width = max(len(a) for a in allow_ids)
        ids = np.full((len(allow_ids), width), -1, dtype=np.int64)
        for i, a in enumerate(allow_ids):
            ids[i, : len(a)] = a
        allowed = (i64(allow_rows), i64(ids))
    if ban_rows:
        banned = (i64(ban_rows), i64(ban_cols))
    if bias is None and allowed is None and banned is None:
        return None
    return LogitsProcessing(bias, allowed, banned)
