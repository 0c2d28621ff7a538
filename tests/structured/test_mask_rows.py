"""The step's grammar rows filled for all requests at once (fill_step_rows: one batched fill per
draft depth, batched accepts between) equal each request's rows filled alone, rejected drafts,
stop tokens and a mask kept from the ledger included; masks applied by the byte table equal the
bit-by-bit reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specserve.env import override
from specserve.ops.logits_processing import apply_bitmask_, bitmask_disallowed
from specserve.runner.logits_plan import grammar_bitmask
from specserve.structured.backend import GrammarBackend
from specserve.structured.matcher import fill_step_rows
from specserve.structured.params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"k": {"enum": ["ab", "cd"]}, "n": {"type": "integer"}},
    "required": ["k", "n"],
    "additionalProperties": False,
}
TEXT = '{"k": "cd", "n": 7}'


@pytest.fixture(scope="module")
def backend(default_tokenizer):
    return GrammarBackend(default_tokenizer, 49152 + 40, [2])


def _matcher(backend, tokens, any_ws=False):
    g = backend.matcher(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=not any_ws))
    for t in tokens:
        g.advance(t)
    return g


def _alone(g, drafts, width):
    want = torch.zeros(len(drafts) + 1, width, dtype=torch.int32)
    g.fill_rows(want, 0, drafts)
    return want


def test_batched_rows_equal_rows_filled_alone(backend, default_tokenizer):
    ids = default_tokenizer.encode(TEXT, add_special_tokens=False)
    bad = default_tokenizer.encode("zzz", add_special_tokens=False)[0]
    w = backend.bitmask_width
    cases = [  # (tokens emitted, drafts)
        ([], ids[:3]),  # all accepted
        (ids[:2], [ids[2], bad, ids[3]]),  # rejected in the middle: rows after it repeat
        (ids[:4], []),  # no drafts
        (ids, [2, 5]),  # complete: EOS drafted (terminates), the row after repeats
        (ids[:1], [bad]),  # rejected first
        (ids[:3], ids[3:7]),
    ]
    grammars = [_matcher(backend, t) for t, _ in cases]
    drafts = [d for _, d in cases]
    firsts, row = [], 1  # row 0 belongs to a request without a grammar
    for d in drafts:
        firsts.append(row)
        row += len(d) + 1
    bits = torch.zeros(row, w, dtype=torch.int32)
    fill_step_rows(grammars, drafts, firsts, bits)
    assert not bits[0].any()  # rows of no entry untouched
    for g, d, f, (t, _) in zip(grammars, drafts, firsts, cases):
        assert torch.equal(bits[f : f + len(d) + 1], _alone(g, d, w))
        # each matcher is left where it was: a fresh one fed the same tokens fills the same
        assert torch.equal(_alone(g, [], w), _alone(_matcher(backend, t), [], w))


def test_a_mask_kept_by_the_ledger_is_the_next_first_row(backend, default_tokenizer):
    """A complete grammar that may go on (more digits): finished() fills its mask to decide,
    keeps it, and the step's fill copies it; the next token drops it."""
    spec = StructuredOutputsParams(regex="[0-9]+")
    one, two = (default_tokenizer.encode(c, add_special_tokens=False)[0] for c in "12")
    g = backend.matcher(spec)
    assert not g.advance(one) and g.cached_row  # complete, more digits may follow
    fresh = backend.matcher(spec)
    fresh.m.accept_token(one)
    w = backend.bitmask_width
    bits = torch.zeros(2, w, dtype=torch.int32)
    fill_step_rows([g, fresh], [[], []], [0, 1], bits)
    assert torch.equal(bits[0], bits[1]) and bits[0, two // 32] & (1 << (two % 32))


def test_a_kept_mask_goes_with_the_next_token(backend, default_tokenizer):
    """regex a|abc: complete after "a" (mask kept), not after "ab": the fill is the new state's."""
    spec = StructuredOutputsParams(regex="a|abc")
    a, b, c = (default_tokenizer.encode(x, add_special_tokens=False) for x in "abc")
    assert len(a) == len(b) == len(c) == 1
    g = backend.matcher(spec)
    assert not g.advance(a[0]) and g.cached_row
    assert not g.advance(b[0]) and not g.cached_row
    bits = torch.zeros(1, backend.bitmask_width, dtype=torch.int32)
    fill_step_rows([g], [[]], [0], bits)
    ref = backend.matcher(spec)
    for t in (a[0], b[0]):
        ref.m.accept_token(t)
    assert torch.equal(bits, _alone(ref, [], backend.bitmask_width))
    assert bits[0, c[0] // 32] & (1 << (c[0] % 32))


def test_grammar_bitmask_lays_rows_out_by_logit_row(backend, default_tokenizer):
    ids = default_tokenizer.encode(TEXT, add_special_tokens=False)
    w = backend.bitmask_width
    seqs = [
        SimpleNamespace(grammar=_matcher(backend, ids[:n]), params=SimpleNamespace(
            allowed_token_ids=None)) for n in (1, 3)
    ]  # fmt: skip
    entries = [(seqs[0], [ids[1]], 2), (seqs[1], [], 5)]  # rows 0, 1, 4: other requests
    bits = grammar_bitmask(entries, torch.device("cpu"))
    assert bits.shape == (6, w)
    assert torch.equal(bits[2:4], _alone(seqs[0].grammar, [ids[1]], w))
    assert torch.equal(bits[5:6], _alone(seqs[1].grammar, [], w))


@pytest.mark.parametrize("vocab", [96, 100, 130])
@pytest.mark.parametrize("every", [False, True])
def test_byte_table_mask_equals_the_bitwise_reference(vocab, every):
    gen = torch.Generator().manual_seed(vocab)
    words = 3  # 96 tokens: vocab 100 and 130 have ids past the bitmask (never allowed)
    bits = torch.randint(-(2**31), 2**31 - 1, (4, words), dtype=torch.int32, generator=gen)
    bits[1] = 0  # a row that allows nothing
    bits[2] = -1  # a row that allows everything it covers
    logits = torch.randn(4, vocab, generator=gen)
    logits[0, 5] = -0.0
    rows = None if every else torch.tensor([0, 2, 3])
    with override(grammar_mask_op="torch"):
        out = apply_bitmask_(logits.clone(), rows, bits)
    masked = range(4) if every else (0, 2, 3)
    ban = bitmask_disallowed(bits, vocab)
    for r in range(4):
        if r in masked:
            want = logits[r].masked_fill(ban[r], float("-inf"))
        else:
            want = logits[r]
        assert torch.equal(out[r], want)


@pytest.mark.parametrize("every", [False, True])
def test_masks_with_bias_and_bans_equal_the_reference_order(every):
    """Every row masked (the copy and the mask's add fused) or some: the same logits as bias
    first, then each mask set to -inf, in bf16 logits as a model returns them."""
    from specserve.ops.logits_processing import LogitsProcessing, apply_logits_processing

    gen = torch.Generator().manual_seed(1)
    n, vocab = 3, 70
    bits = torch.randint(-(2**31), 2**31 - 1, (n, 3), dtype=torch.int32, generator=gen)
    logits = torch.randn(n, vocab, generator=gen).to(torch.bfloat16)
    bias = (torch.tensor([0, 2]), torch.tensor([5, 9]), torch.tensor([1.5, -2.0]))
    banned = (torch.tensor([1]), torch.tensor([7]))
    rows = None if every else torch.tensor([0, 2])
    out = apply_logits_processing(logits, LogitsProcessing(bias, None, banned, (rows, bits)))
    want = logits.float()
    want[0, 5] += 1.5
    want[2, 9] -= 2.0
    want[1, 7] = float("-inf")
    ban = bitmask_disallowed(bits, vocab)
    for r in range(n) if every else (0, 2):
        want[r] = want[r].masked_fill(ban[r], float("-inf"))
    assert out.dtype == torch.float32 and torch.equal(out, want)


def test_an_accepted_stop_token_finishes_the_grammar(backend, default_tokenizer):
    """advance() answers from the token for a stop token; the matcher agrees it terminated."""
    a = default_tokenizer.encode("a", add_special_tokens=False)[0]
    g = backend.matcher(StructuredOutputsParams(regex="a|abc"))
    assert not g.advance(a)  # complete, "bc" may follow
    assert g.advance(2) and g.m.is_terminated()
