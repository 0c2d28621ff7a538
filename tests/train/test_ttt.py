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


def _tiny_head(vocab: int = 64, draft: int = 64, device: str = "cpu") -> Eagle3Head:
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
    # the target's embedding, shared (not a submodule: the head's .to() leaves it)
    emb = nn.Embedding(vocab, 32).requires_grad_(False).to(device)
    return Eagle3Head(cfg, embed_tokens=emb)


def _synthetic_batch(vocab: int = 64, device: str = "cpu") -> TTTBatch:
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
        aux.reshape(-1, 96).to(device),
        logits.reshape(-1, vocab).to(device),
        torch.logsumexp(logits, -1).reshape(-1).to(device),
        perm[ids].reshape(-1).to(device),
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


def _mixed_prompt_batch(dtype: torch.dtype) -> TTTBatch:
    """Four random sequences of 16 tokens with prompts of 6-11 tokens (a window from row 5)."""
    g = torch.Generator().manual_seed(3)
    seqs = torch.randint(64, (4, 16), generator=g)
    logits = torch.randn(4, 16, 64, generator=g) * 3
    rows = TargetRows(  # draft vocabulary: target ids 0..47
        torch.randn(64, 96, generator=g),
        logits[..., :48].reshape(-1, 48),
        torch.logsumexp(logits, -1).reshape(-1),
        logits.argmax(-1).reshape(-1),
        [16] * 4,
    )
    return TTTBatch.build(seqs.tolist(), [6, 9, 11, 7], rows, dtype)


def test_windowed_unroll_is_the_full_unroll() -> None:
    """Steps after step 0 run on the rows from the shortest prompt on: the same loss, stats and
    gradients as every step on every row (float64 but the attention's float32 softmax: only
    rounding may differ)."""
    batch = _mixed_prompt_batch(torch.float64)
    batch.draft_logits = batch.draft_logits.double()
    batch.logsumexp = batch.logsumexp.double()
    results = []
    for window in (True, False):
        head = _tiny_head(draft=48).double()
        head.t2d[48:] = False  # rows whose target argmax is outside: no cross-entropy
        res = ttt_loss(head, batch, ttt_steps=4, window=window)
        res.loss.backward()
        grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
        results.append((res, grads))
    (a, ga), (b, gb) = results
    assert float(a.loss.detach()) == pytest.approx(float(b.loss.detach()), rel=1e-9)
    assert [s.rows for s in a.steps] == [s.rows for s in b.steps] and a.steps[0].rows > 0
    for sa, sb in zip(a.steps, b.steps):
        assert (sa.ce, sa.bce, sa.acc, sa.label) == pytest.approx((sb.ce, sb.bce, sb.acc, sb.label))
    assert ga.keys() == gb.keys() and len(ga) > 5
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-6, atol=1e-8, msg=n)


def test_a_window_step_sees_the_context_a_full_step_sees() -> None:
    """Head level: a TTT step on rows w.. with q_offset=w gives the full step's rows w..; an
    offset one off does not (the comparison can fail)."""
    head = _tiny_head().double()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(64, (2, 12), generator=g)
    pos = torch.arange(12)[None, :].expand(2, 12)
    step0 = head(ids, torch.randn(2, 12, 96, generator=g, dtype=torch.float64), pos)
    full = head(ids, step0.prenorm, pos + 1, past_kv=[step0.kv])
    w = 5
    win = head(ids[:, w:], step0.prenorm[:, w:], pos[:, w:] + 1, past_kv=[step0.kv], q_offset=w)
    torch.testing.assert_close(win.logits, full.logits[:, w:])
    torch.testing.assert_close(win.kv[0], full.kv[0][:, :, w:])
    off = head(ids[:, w:], step0.prenorm[:, w:], pos[:, w:] + 1, past_kv=[step0.kv], q_offset=w + 1)
    assert not torch.allclose(off.logits, full.logits[:, w:])


def assert_every_parameter_learns(device: str) -> None:
    head = _tiny_head(device=device).to(device)
    res = ttt_loss(head, _synthetic_batch(device=device), ttt_steps=2)
    res.loss.backward()
    trained = {n: p for n, p in head.named_parameters() if p.requires_grad}
    assert {n for n, p in trained.items() if p.grad is None or not p.grad.any()} == set()
    assert any(n.startswith("midlayer.self_attn") for n in trained)


def test_every_parameter_learns_with_the_fused_kernels_on(monkeypatch) -> None:
    """The head's serving path fuses norms and adds into kernels without a backward; under
    autograd the dispatchers must keep the torch ops, or each kernel output cuts the parameters
    before it off the loss (on CUDA only the lm_head learned). Here the kernel path is forced
    on for every tensor, as on CUDA: a dispatcher that took it under autograd would launch a
    Triton kernel on CPU tensors."""
    from specserve.ops import fused

    monkeypatch.setattr(fused, "_enabled", lambda x: True)
    assert_every_parameter_learns("cpu")
