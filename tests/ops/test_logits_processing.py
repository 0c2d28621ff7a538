"""apply_logits_processing and bad_word_bans against plain per-row Python references."""

from __future__ import annotations

import math
import random

import torch

from specserve.ops.logits_processing import LogitsProcessing, apply_logits_processing
from specserve.runner.logits_plan import bad_word_bans


def _reference(logits, bias, allowed, banned):
    """bias: {row: {tok: b}}, allowed: {row: [ids]}, banned: {row: [ids]}."""
    out = []
    for r, row in enumerate(logits):
        row = [x + bias.get(r, {}).get(t, 0.0) for t, x in enumerate(row)]
        if r in allowed:
            row = [x if t in allowed[r] else -math.inf for t, x in enumerate(row)]
        for t in banned.get(r, []):
            row[t] = -math.inf
        out.append(row)
    return out


def _case(rng: random.Random, n: int, vocab: int):
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    bias, allowed, banned = {}, {}, {}
    for r in range(n):
        if rng.random() < 0.5:
            bias[r] = {
                t: rng.uniform(-100, 100)
                for t in rng.sample(range(vocab), rng.randint(1, min(4, vocab)))
            }
        if rng.random() < 0.4:
            allowed[r] = rng.sample(range(vocab), rng.randint(1, vocab - 1))
        if rng.random() < 0.5:
            banned[r] = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]  # repeats too
    return logits, bias, allowed, banned


def _inputs(bias, allowed, banned) -> LogitsProcessing:
    def i64(x):
        return torch.tensor(x, dtype=torch.int64)

    b = a = k = None
    if bias:
        rows = [r for r, m in bias.items() for _ in m]
        cols = [t for m in bias.values() for t in m]
        vals = [v for m in bias.values() for v in m.values()]
        b = (i64(rows), i64(cols), torch.tensor(vals, dtype=torch.float32))
    if allowed:
        width = max(len(v) for v in allowed.values())
        a = (i64(list(allowed)), i64([v + [-1] * (width - len(v)) for v in allowed.values()]))
    if banned:
        k = (
            i64([r for r, v in banned.items() for _ in v]),
            i64([t for v in banned.values() for t in v]),
        )
    return LogitsProcessing(b, a, k)


def test_matches_the_reference_and_leaves_the_input_alone() -> None:
    rng = random.Random(0)
    for _ in range(30):
        n, vocab = rng.randint(1, 6), rng.randint(2, 40)
        logits, bias, allowed, banned = _case(rng, n, vocab)
        before = logits.clone()
        got = apply_logits_processing(logits, _inputs(bias, allowed, banned))
        want = torch.tensor(_reference(logits.tolist(), bias, allowed, banned))
        assert torch.equal(logits, before)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        finite = ~torch.isinf(want)
        torch.testing.assert_close(got[finite], want[finite], rtol=0, atol=1e-4)


def test_rows_without_processing_are_untouched() -> None:
    logits = torch.randn(4, 10)
    proc = _inputs({1: {3: 5.0}}, {2: [0, 1]}, {1: [7]})
    got = apply_logits_processing(logits, proc)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[3], logits[3])
    assert got[2, 2:].eq(-math.inf).all() and torch.equal(got[2, :2], logits[2, :2])


def _bans_reference(words, output, drafts):
    rows = []
    for j in range(len(drafts) + 1):
        past = list(output) + list(drafts[:j])
        rows.append(
            [
                w[-1]
                for w in words
                if len(w) - 1 <= len(past)
                and (len(w) == 1 or past[len(past) - len(w) + 1 :] == w[:-1])
            ]
        )
    return rows


def test_bad_word_bans_match_the_reference() -> None:
    rng = random.Random(1)
    for _ in range(300):
        vocab = rng.randint(2, 5)  # few ids: prefixes match often
        words = [
            [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            for _ in range(rng.randint(1, 3))
        ]
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        drafts = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
        assert bad_word_bans(words, output, drafts) == _bans_reference(words, output, drafts)


def test_bad_word_bans_cases() -> None:
    words = [[7], [1, 2], [1, 2, 3]]
    # one-token words everywhere; [1, 2] bans 2 after a 1; [1, 2, 3] bans 3 after 1, 2 (the
    # second row: its past is the output then the draft 2)
    assert bad_word_bans(words, [5, 1], [2, 4]) == [[7, 2], [7, 3], [7]]
    # a word cannot match across the start of the output
    assert bad_word_bans([[1, 2]], [], []) == [[]]
