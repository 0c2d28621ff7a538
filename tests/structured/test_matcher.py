"""The grammar state of one request and the bitmask op: one bitmask row per verify row equals
the mask of a matcher advanced through the drafts before the row; the matcher is left as it
was; rows past a rejected draft or a stop token are never empty; the packed layout unpacks to
the allowed tokens; drafts are cut after the first the grammar rejects."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specserve.ops.logits_processing import (
    LogitsProcessing,
    apply_logits_processing,
    bitmask_disallowed,
)
from specserve.structured.backend import GrammarBackend
from specserve.structured.drafts import truncate_drafts
from specserve.structured.params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"k": {"enum": ["ab", "cd"]}, "n": {"type": "integer", "minimum": 0,
                   "maximum": 9}},
    "required": ["k", "n"],
    "additionalProperties": False,
}  # fmt: skip


@pytest.fixture(scope="module")
def backend(default_tokenizer):
    return GrammarBackend(default_tokenizer, 49152 + 40, [2])  # model vocab past the tokenizer's


@pytest.fixture(scope="module")
def tok(default_tokenizer):
    return default_tokenizer


def _spec():
    return StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)


def _allowed(bits: torch.Tensor, row: int, vocab: int) -> set[int]:
    return set((~bitmask_disallowed(bits[row : row + 1], vocab)[0]).nonzero().flatten().tolist())


def test_rows_are_the_masks_after_the_drafts(backend, tok):
    text_ids = tok.encode('{"k": "ab", "n": 3}', add_special_tokens=False)
    g = backend.matcher(_spec())
    g.advance(text_ids[0])
    drafts = text_ids[1:4]
    bits = torch.zeros(len(drafts) + 1, backend.bitmask_width, dtype=torch.int32)
    g.fill_rows(bits, 0, drafts)
    vocab = 49192
    for j in range(len(drafts) + 1):
        ref = backend.matcher(_spec())
        for t in [text_ids[0], *drafts[:j]]:
            ref.advance(t)
        want = torch.zeros(1, backend.bitmask_width, dtype=torch.int32)
        ref.m.fill_next_token_bitmask(want, 0)
        assert torch.equal(bits[j], want[0])
        assert drafts[j] in _allowed(bits, j, vocab) if j < len(drafts) else True
    # the matcher is where it was: the next real token is still the second one
    assert not g.m.is_terminated() and g.valid_prefix(text_ids[1:]) == len(text_ids) - 1
    assert all(t < 49152 for t in _allowed(bits, 0, vocab))  # padded ids never allowed


def test_rows_past_a_rejected_draft_or_a_stop_are_not_empty(backend, tok):
    ids = tok.encode('{"k": "cd", "n": 7}', add_special_tokens=False)
    g = backend.matcher(_spec())
    bad = tok.encode("zzz", add_special_tokens=False)[0]
    bits = torch.zeros(3, backend.bitmask_width, dtype=torch.int32)
    g.fill_rows(bits, 0, [ids[0], bad])
    assert torch.equal(bits[2], bits[1]) and bits[1].any()
    for t in ids[:-1]:
        g.advance(t)
    assert g.advance(ids[-1])  # complete, only EOS could follow: finished
    g2 = backend.matcher(_spec())
    for t in ids:
        g2.m.accept_token(t)
    bits = torch.zeros(3, backend.bitmask_width, dtype=torch.int32)
    g2.fill_rows(bits, 0, [2, 5])  # EOS drafted: the row after it repeats the EOS row
    assert _allowed(bits, 0, 49192) == {2} and torch.equal(bits[1], bits[0])


def test_drafts_cut_after_the_first_rejected(backend, tok):
    ids = tok.encode('{"k": "ab", "n": 1}', add_special_tokens=False)
    bad = tok.encode("zzz", add_special_tokens=False)[0]
    seq = SimpleNamespace(grammar=backend.matcher(_spec()))
    props = [(ids[:2] + [bad] + ids[2:4], [0.9, 0.8, 0.7, 0.6, 0.5])]
    assert truncate_drafts([seq], props, keep_rejected=False) == [(ids[:2], [0.9, 0.8])]
    assert truncate_drafts([seq], props, keep_rejected=True) == [(ids[:2] + [bad], [0.9, 0.8, 0.7])]
    plain = SimpleNamespace(grammar=None)
    assert truncate_drafts([plain], props, keep_rejected=False) == props


@pytest.mark.parametrize("vocab", [60, 64, 70])
def test_bitmask_unpacks_to_the_allowed_tokens(vocab):
    g = torch.Generator().manual_seed(0)
    allowed = [sorted(torch.randperm(min(vocab, 64), generator=g)[:9].tolist()) for _ in range(3)]
    bits = torch.zeros(3, 2, dtype=torch.int32)
    for r, toks in enumerate(allowed):
        for t in toks:
            word = bits[r, t // 32].item() | (1 << (t % 32))
            bits[r, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    ban = bitmask_disallowed(bits, vocab)
    for r, toks in enumerate(allowed):
        assert set((~ban[r]).nonzero().flatten().tolist()) == set(toks)
    logits = torch.randn(5, vocab)
    by_row = torch.full((5, 2), 0x5555, dtype=torch.int32)  # rows 0 and 2: never read
    by_row[[1, 3, 4]] = bits
    out = apply_logits_processing(
        logits, LogitsProcessing(None, None, None, (torch.tensor([1, 3, 4]), by_row))
    )
    assert torch.equal(out[[0, 2]], logits[[0, 2]])  # rows without a grammar untouched
    for r, row in zip(range(3), (1, 3, 4)):
        keep = torch.isfinite(out[row]).nonzero().flatten().tolist()
        assert keep == allowed[r] and torch.equal(out[row, keep], logits[row, keep])
    every = apply_logits_processing(logits[:3], LogitsProcessing(None, None, None, (None, bits)))
    for r in range(3):  # rows None: every row masked by its own bits row
        keep = torch.isfinite(every[r]).nonzero().flatten().tolist()
        assert keep == allowed[r] and torch.equal(every[r, keep], logits[r, keep])


def test_batched_first_rows_equal_one_at_a_time(backend, tok):
    """grammar_bitmask fills the rows of requests without drafts in one multithreaded xgrammar
    call: the same bits as each matcher alone, in the rows the layout gives them."""
    from specserve.runner.logits_plan import grammar_bitmask

    text_ids = tok.encode('{"k": "cd", "n": 7}', add_special_tokens=False)
    grammars = []
    for n in range(6):  # requests at different points of the same schema
        g = backend.matcher(_spec())
        for t in text_ids[:n]:
            g.advance(t)
        grammars.append(g)
    seqs = [
        SimpleNamespace(grammar=g, params=SimpleNamespace(allowed_token_ids=None)) for g in grammars
    ]
    drafts = [[], text_ids[2:4], [], [], text_ids[4:5], []]
    starts, row = [], 0
    for d in drafts:
        starts.append(row)
        row += len(d) + 1
    bits = grammar_bitmask(list(zip(seqs, drafts, starts)))
    for g, d, start in zip(grammars, drafts, starts):
        want = torch.zeros(len(d) + 1, backend.bitmask_width, dtype=torch.int32)
        g.fill_rows(want, 0, d)
        assert torch.equal(bits[start : start + len(d) + 1], want)
