"""The host's half of logits processing: which (row, token) pairs of a step get a logit bias, a
whitelist or a ban, read from the requests at launch (device half: ops/logits_processing.py).

Every row a request samples from gets the processing, verify rows included: row j of a request
sees its output tokens followed by the j drafts before it, exactly the tokens it would have seen
had those drafts been emitted one step at a time. So the processed target distribution of each
verify row is the one plain decoding samples from, and speculation stays lossless.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

import numpy as np
import torch

from specserve.engine.sequence import Sequence
from specserve.ops.logits_processing import LogitsProcessing
from specserve.ops.transfer import h2d, pinned_empty, upload_pinned
from specserve.structured.matcher import fill_step_rows


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
    grammar_rows: list[int] = []
    grammar_seqs: list[tuple[Sequence, list[int], int]] = []  # (request, drafts, first row)
    row = 0
    for seq, d in zip(seqs, drafts):
        p = seq.params
        n = len(d) + 1
        if seq.is_finished:
            # it ended in the ledger of the step before (a deferred plan: StepSampler.complete):
            # its rows are discarded. Nothing is built for them: checked against a complete
            # grammar, its allowed ids could fail the step of all the others
            row += n
            continue
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
        if seq.grammar is not None:
            assert not seq.num_pending, "a grammar needs every output token on the host"
            grammar_seqs.append((seq, d, row))
            grammar_rows.extend(range(row, row + n))
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
    bitmask = None
    if grammar_rows:
        bits = upload_pinned(grammar_bitmask(grammar_seqs, device), device)
        # every row masked (a batch of grammar requests): no index to upload or gather by
        bitmask = (None if len(grammar_rows) == row else i64(grammar_rows), bits)
    if bias is None and allowed is None and banned is None and bitmask is None:
        return None
    return LogitsProcessing(bias, allowed, banned, bitmask)


def grammar_bitmask(
    entries: list[tuple[Sequence, list[int], int]], device: torch.device | None = None
) -> torch.Tensor:
    """[R, W] int32 host bitmask laid out by logit row (R = the last grammar row + 1; pinned
    for a CUDA `device`, so the upload copies it once, asynchronously): for each (request,
    drafts, first row), one row per verify row, its matcher advanced through the drafts before
    the row, then rolled back. Rows of no entry are left unset (the sampler never reads them).
    A request whose allowed_token_ids leave a row of its grammar nothing to sample ends here,
    alone."""
    t0 = time.perf_counter()
    first = entries[0][0].grammar
    rows = max(start + len(d) + 1 for _, d, start in entries)
    bits = pinned_empty((rows, first.width), torch.int32, device)  # [R, W]
    grammars = [seq.grammar for seq, _, _ in entries]
    fill_step_rows(grammars, [d for _, d, _ in entries], [s for _, _, s in entries], bits)
    for seq, d, start in entries:
        allowed = seq.params.allowed_token_ids
        if allowed is not None:
            g = seq.grammar
            for j in range(len(d) + 1):
                if not any(g.allows(bits, start + j, t) for t in allowed):
                    raise ValueError(
                        f"{seq.request_id}: no token allowed_token_ids permits fits the grammar"
                    )
    first.stats.record(sum(len(d) + 1 for _, d, _ in entries), time.perf_counter() - t0)
    return bits
