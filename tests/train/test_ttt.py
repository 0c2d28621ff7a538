"""The TTT unroll's pieces: the soft acceptance label by hand, which rows count at each step,
and a head that learns a synthetic target under the unrolled loss."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve.model.eagle3 import Eagle3Config, Eagle3Head
from specserve.train.capture import TargetRows
from specserve.train.ttt import TTTBatch, acceptance_label, row_mask, shift, ttt_loss


def test_acceptance_label_by_hand() -> None:
    # draft vocabulary = target ids {0, 1, 2} of a 5-token vocabulary
    q = torch.tensor([0.5, 0.3, 0.2])
    p_full = torch.tensor([0.4, 0.4, 0.1, 0.06, 0.04])
    # ||q - p||_1 = 0.1 + 0.1 + 0.1 + (0.06 + 0.04) = 0.4 -> 1 - 0.2
    assert float(acceptance_label(q, p_full[:3])) == pytest.approx(0.8)
    q_full = torch.cat([q, torch.zeros(2)])
    assert float(acceptance_label(q, p_full[:3])) == pytest.approx(
        float(torch.minimum(q_full, p_full).sum())
    )
    # identical distributions on the draft vocabulary: accepted surely
    same = torch.tensor([0.25, 0.75])
    assert float(acceptance_label(same, same)) == pytest.approx(1.0)


def test_rows_that_count() -> None:
    # one sequence of 8 tokens, prompt 3: chains start at rows t >= 2; step i predicts t+2+i
    b = TTTBatch(
        input_ids=torch.zeros(1, 8, dtype=torch.int64),
        aux=torch.zeros(1, 8, 3),
        draft_logits=torch.zeros(1, 8, 2),
        logsumexp=torch.zeros(1, 8),
        greedy=torch.zeros(1, 8, dtype=torch.int64),
        lens=torch.tensor([8]),
        prompt_lens=torch.tensor([3]),
    )
    assert row_mask(b, 0)[0].nonzero().flatten().tolist() == [2, 3, 4, 5]
    assert row_mask(b, 2)[0].nonzero().flatten().tolist() == [2, 3]
    assert shift(torch.tensor([[1, 2, 3]]), 1, -1).tolist() == [[2, 3, -1]]


def _tiny_head(vocab: int = 64, draft: int = 64) -> Eagle3Head:
    cfg = Eagle3Config(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=vocab,
        draft_vocab_size=draft,
        aux_layer_ids=(0, 1, 2),
    )
    torch.manual_seed(0)
    emb = nn.Embedding(vocab, 32).requires_grad_(False)
    return Eagle3Head(cfg, embed_tokens=emb)


def _synthetic_batch(vocab: int = 64) -> TTTBatch:
    """Sequences following x_{t+1} = perm[x_t]; the target is sure of it (logit 6)."""
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(vocab, generator=g)
    seqs = []
    for _ in range(4):
        x = [int(torch.randint(vocab, (1,), generator=g))]
        for _ in range(15):
            x.append(int(perm[x[-1]]))
        seqs.append(x)
    ids = torch.tensor(seqs)
    logits = 6.0 * nn.functional.one_hot(perm[ids], vocab).float()  # [B, L, V]
    aux = torch.randn(4, 16, 96, generator=g)
    rows = TargetRows(
        aux.reshape(-1, 96),
        logits.reshape(-1, vocab),
        torch.logsumexp(logits, -1).reshape(-1),
        perm[ids].reshape(-1),
        [16] * 4,
    )
    return TTTBatch.build(seqs, [4] * 4, rows, torch.float32)


def test_unrolled_loss_trains_the_head() -> None:
    head = _tiny_head()
    batch = _synthetic_batch()
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    first = None
    for _ in range(40):
        res = ttt_loss(head, batch, ttt_steps=3)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
        first = first if first is not None else res
    # rows t in [p - 1, L - 3 - i]: 11, 10, 9 per sequence
    assert [s.rows for s in res.steps] == [4 * 11, 4 * 10, 4 * 9]
    assert float(res.loss.detach()) < 0.5 * float(first.loss.detach())
    assert res.steps[0].acc > 0.9 and res.steps[2].acc > 0.5
    # a sure target: the label tracks the head's own mass on the right token
    assert res.steps[0].label > first.steps[0].label + 0.3
