"""apply_penalties against a plain per-row, per-token Python reference."""

from __future__ import annotations

import torch

from specserve.ops.penalties import apply_penalties, token_counts


def _reference(
    logits: list[list[float]],
    prompt: list[list[int]],
    output: list[list[int]],
    presence: list[float],
    frequency: list[float],
    repetition: list[float],
) -> list[list[float]]:
    result = []
    for r, row in enumerate(logits):
        prompt_ids = {t for t in prompt[r] if t >= 0}
        counts: dict[int, int] = {}
        for t in output[r]:
            if t >= 0:
                counts[t] = counts.get(t, 0) + 1
        new_row = []
        for tok, x in enumerate(row):
            if tok in prompt_ids or tok in counts:
                x = x / repetition[r] if x > 0 else x * repetition[r]
            c = counts.get(tok, 0)
            x -= frequency[r] * c
            if c > 0:
                x -= presence[r]
            new_row.append(x)
        result.append(new_row)
    return result


def _padded(rows: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64).reshape(
        len(rows), width
    )


def _random_case(gen: torch.Generator, n: int, vocab: int, lp: int, lo: int):
    logits = torch.randn(n, vocab, generator=gen) * 3
    prompt, output = [], []
    for _ in range(n):
        plen = int(torch.randint(0, lp + 1, (1,), generator=gen))
        olen = int(torch.randint(0, lo + 1, (1,), generator=gen))
        # small id range on outputs so repeats (count > 1) are common
        prompt.append(torch.randint(0, vocab, (plen,), generator=gen).tolist())
        output.append(torch.randint(0, min(vocab, 8), (olen,), generator=gen).tolist())
    presence = (torch.rand(n, generator=gen) * 4 - 2).tolist()
    frequency = (torch.rand(n, generator=gen) * 4 - 2).tolist()
    repetition = (torch.rand(n, generator=gen) * 1.5 + 0.5).tolist()
    return logits, prompt, output, presence, frequency, repetition


def _run(logits, prompt, output, presence, frequency, repetition, lp, lo) -> torch.Tensor:
    return apply_penalties(
        logits,
        _padded(prompt, lp),
        _padded(output, lo),
        torch.tensor(presence),
        torch.tensor(frequency),
        torch.tensor(repetition),
    )


def test_matches_reference_on_random_batches() -> None:
    gen = torch.Generator().manual_seed(0)
    for n, vocab, lp, lo in [(1, 5, 3, 3), (7, 16, 10, 12), (16, 40, 0, 20), (5, 30, 25, 0)]:
        case = _random_case(gen, n, vocab, lp, lo)
        got = _run(*case, lp, lo)
        want = torch.tensor(_reference(case[0].tolist(), *case[1:]))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_neutral_rows_unchanged_and_input_not_modified() -> None:
    logits = torch.tensor([[1.0, -2.0, 3.0, 0.0], [0.5, 0.5, -0.5, 2.0]])
    before = logits.clone()
    out = apply_penalties(
        logits,
        torch.tensor([[0, 1], [2, -1]]),
        torch.tensor([[1, 1, 3], [-1, -1, -1]]),
        torch.tensor([0.0, 0.0]),
        torch.tensor([0.0, 0.0]),
        torch.tensor([1.0, 1.0]),
    )
    assert torch.equal(logits, before)
    assert torch.equal(out, before)


def test_worked_example() -> None:
    # token 0: prompt only -> repetition only; token 1: output twice; token 2: unseen;
    # token 3: output once, negative logit (multiplied by the penalty).
    logits = torch.tensor([[2.0, 4.0, 1.0, -1.0]])
    out = apply_penalties(
        logits,
        torch.tensor([[0, -1]]),
        torch.tensor([[1, 3, 1, -1]]),
        presence=torch.tensor([0.5]),
        frequency=torch.tensor([0.25]),
        repetition=torch.tensor([2.0]),
    )
    expected = torch.tensor([[1.0, 4.0 / 2 - 0.5 - 0.5, 1.0, -2.0 - 0.25 - 0.5]])
    torch.testing.assert_close(out, expected)


def test_empty_token_matrices_and_bf16_logits() -> None:
    logits = torch.randn(3, 11).to(torch.bfloat16)
    empty = torch.empty(3, 0, dtype=torch.int64)
    out = apply_penalties(logits, empty, empty, torch.ones(3), torch.ones(3), torch.full((3,), 1.3))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, logits.float())


def test_token_counts_ignores_padding() -> None:
    counts = token_counts(torch.tensor([[2, 2, -1, 0], [-1, -1, -1, -1]]), 4)
    assert counts.tolist() == [[1, 0, 2, 0], [0, 0, 0, 0]]
