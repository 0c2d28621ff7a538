"""Fused Triton sample-and-verify against the torch reference (specserve.sample.verify).

    pytest -m gpu tests/gpu/test_triton_verify.py                        # CUDA (skips without)
    TRITON_INTERPRET=1 pytest -m gpu tests/gpu/test_triton_verify.py     # CPU, Triton interpreter

Greedy rows must match exactly (all four outputs, dtypes included). Sampling rows run the same
exponential race on the same random stream, but the kernel skips the softmax's 1/sum and its
exp/log round differently, so a sampled token may differ where two candidates' race scores tie
to within float rounding: every such mismatch must be a near-tie (checked in float64), and they
must stay rare. The interpreter is slow: it gets smaller vocabularies and batches.
"""

from __future__ import annotations

import pytest
import torch

from specserve import env
from specserve.ops.random import hashed_uniform
from specserve.ops.sampling import SAMPLE_SALT, SamplingTensors, sample, target_probs
from specserve.sample.layout import RowLayout, build_layout
from specserve.sample.verify import VerifyResult, verify, verify_reference
from specserve.sampling_params import SamplingParams

from .conftest import interpreting

# A sampled-token mismatch is a float near-tie when the reference's race scores of the two
# tokens are this close (relative, computed in float64); a real bug lands far outside.
NEAR_TIE = 1e-4
MAX_MISMATCH_FRACTION = 1e-3


@pytest.fixture
def device(cuda: torch.device) -> torch.device:
    pytest.importorskip("triton")
    return cuda


def _fused():
    from specserve.sample import triton_verify

    return triton_verify


def _vocabs() -> list[int]:
    # 4099: several chunks with a ragged tail; 49152 / 128256: the real vocabularies.
    return [1000, 4099] if interpreting() else [1000, 4099, 49152]


def _max_reqs() -> int:
    return 12 if interpreting() else 64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _seqlens(g: torch.Generator, num_reqs: int, max_drafts: int) -> list[int]:
    return (torch.randint(0, max_drafts + 1, (num_reqs,), generator=g) + 1).tolist()


def _logits(g: torch.Generator, total: int, vocab: int, *, ties: bool = False) -> torch.Tensor:
    """[total, V] f32. ties: few distinct values (argmax ties everywhere, across chunks).
    A sprinkle of -inf stands for the caller's masks (min_tokens, bad words)."""
    if ties:
        x = torch.randint(0, 4, (total, vocab), generator=g).to(torch.float32)
    else:
        x = torch.randn(total, vocab, generator=g) * 3.0
    return x.masked_fill(torch.rand(total, vocab, generator=g) < 0.01, float("-inf"))


def _tensors(
    g: torch.Generator, seqlens: list[int], temps: list[float], device: torch.device
) -> SamplingTensors:
    """Rows of request i repeat its params and seed, with counters n_i, n_i + 1, ..."""
    params, seeds, counters = [], [], []
    for s, temp in zip(seqlens, temps):
        seed = int(torch.randint(-(2**62), 2**62, (1,), generator=g))
        n_out = int(torch.randint(0, 1000, (1,), generator=g))
        params += [SamplingParams(temperature=temp)] * s
        seeds += [seed] * s
        counters += [n_out + j for j in range(s)]
    return SamplingTensors.build(params, seeds, counters, device)


def _drafts(
    g: torch.Generator,
    logits: torch.Tensor,
    t: SamplingTensors,
    seqlens: list[int],
    forced: torch.Tensor | None,
) -> torch.Tensor:
    """[total_q] int64: per request, each row's draft is the reference's own target token with
    a per-request probability (so acceptance runs from none to all), else a random token."""
    target = sample(target_probs(logits, t), t, SAMPLE_SALT)  # [total_q]
    if forced is not None:
        target = torch.where(forced >= 0, forced, target)
    rate = torch.cat([torch.rand(1, generator=g).expand(s) for s in seqlens])  # [total_q]
    hit = (torch.rand(len(rate), generator=g) < rate).to(target.device)
    rand = torch.randint(0, logits.shape[1], target.shape, generator=g).to(target.device)
    return torch.where(hit, target, rand)


def _layout(seqlens: list[int], device: torch.device) -> RowLayout:
    sq = torch.tensor(seqlens, dtype=torch.int64, device=device)
    return build_layout(sq, sum(seqlens), max(seqlens) - 1)


def _assert_same(got: VerifyResult, want: VerifyResult) -> None:
    for name, a, b in zip(VerifyResult._fields, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape)
        assert torch.equal(a, b), (name, a.tolist(), b.tolist())


def _near_tie(logits_row: torch.Tensor, temp: float, seed, counter, a: int, b: int) -> bool:
    """Whether tokens a and b have race scores p / e within NEAR_TIE of each other (float64)."""
    x = logits_row.double() / temp
    p = torch.softmax(x, dim=0)
    u = hashed_uniform(seed.view(1), counter.view(1), SAMPLE_SALT, x.shape[0])[0].double()
    s = p / -torch.log(u)
    return bool((s[a] - s[b]).abs() <= NEAR_TIE * torch.maximum(s[a], s[b]))


def _compare(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    t: SamplingTensors,
    seqlens: list[int],
    layout: RowLayout,
    forced: torch.Tensor | None = None,
) -> int:
    """Fused vs reference: requests that only hold greedy rows (or whose outputs agree) must be
    identical; a sampling request may differ only through a near-tie at the first row where the
    two disagree. Returns the number of such requests."""
    got = _fused().verify_triton(logits, drafts, t, layout, forced)
    want = verify_reference(logits, drafts, None, t, layout, forced)
    for name, a, b in zip(VerifyResult._fields, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype)
    g_v, w_v = got.verified_token_ids.cpu(), want.verified_token_ids.cpu()
    temps = t.temperature.cpu()
    mismatched = 0
    first = 0
    for i, s in enumerate(seqlens):
        rows = slice(first, first + s)
        same = torch.equal(g_v[rows], w_v[rows]) and all(
            torch.equal(a[i], b[i]) for a, b in zip(got[1:], want[1:])
        )
        if not same:
            assert temps[first] > 0, f"greedy request {i} differs"
            # The first row where they part: its target token differs between the two.
            n = min(int(got.num_accepted[i]), int(want.num_accepted[i]))
            row = first + n
            a = int(got.sampled_token_ids[i]) if int(got.final_rows[i]) == row else int(g_v[row])
            b = int(want.sampled_token_ids[i]) if int(want.final_rows[i]) == row else int(w_v[row])
            assert forced is None or int(forced[row]) < 0, f"forced row {row} differs"
            assert _near_tie(logits[row].cpu(), float(temps[row]), t.seed[row].cpu(),
                             t.counter[row].cpu(), a, b), f"request {i} row {row}: {a} vs {b}"  # fmt: skip
            mismatched += 1
        first += s
    return mismatched


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", _vocabs())
@pytest.mark.parametrize("seed", [0, 1])
def test_all_greedy_is_identical(device, vocab, seed):
    g = _gen(seed)
    for max_drafts in (0, 3, 7):
        seqlens = _seqlens(g, int(torch.randint(1, _max_reqs() + 1, (1,), generator=g)), max_drafts)
        total = sum(seqlens)
        logits = _logits(g, total, vocab).to(device)
        t = _tensors(g, seqlens, [0.0] * len(seqlens), device)
        drafts = _drafts(g, logits, t, seqlens, None)
        layout = _layout(seqlens, device)
        got = _fused().verify_triton(logits, drafts, t, layout)
        _assert_same(got, verify_reference(logits, drafts, None, t, layout))


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", _vocabs())
def test_greedy_rows_verify_a_draft_q_as_the_reference(device, vocab):
    """All-greedy steps with a drafter's q (EAGLE-3, draft model) take the fused kernel: a
    greedy row accepts a draft iff it is the argmax and resamples the argmax, whatever q."""
    g = _gen(vocab + 7)
    seqlens = _seqlens(g, _max_reqs(), 5)
    total = sum(seqlens)
    logits = _logits(g, total, vocab).to(device)
    t = _tensors(g, seqlens, [0.0] * len(seqlens), device)
    drafts = _drafts(g, logits, t, seqlens, None)
    q = torch.softmax(torch.randn(total, vocab, generator=g), -1).to(device)
    layout = _layout(seqlens, device)
    assert _fused().fusable(t, q)
    _assert_same(
        _fused().verify_triton(logits, drafts, t, layout),
        verify_reference(logits, drafts, q, t, layout),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [1000, 4099])
def test_greedy_ties_go_to_the_lowest_index(device, vocab):
    """Four distinct logit values: the maximum repeats within and across chunks."""
    g = _gen(vocab)
    seqlens = _seqlens(g, _max_reqs(), 7)
    logits = _logits(g, sum(seqlens), vocab, ties=True).to(device)
    t = _tensors(g, seqlens, [0.0] * len(seqlens), device)
    drafts = _drafts(g, logits, t, seqlens, None)
    layout = _layout(seqlens, device)
    _assert_same(
        _fused().verify_triton(logits, drafts, t, layout),
        verify_reference(logits, drafts, None, t, layout),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", _vocabs())
@pytest.mark.parametrize("forced", [False, True])
def test_mixed_greedy_and_temperature(device, vocab, forced):
    g = _gen(vocab + forced)
    mismatched = rows = 0
    for _ in range(3):
        seqlens = _seqlens(g, _max_reqs(), 7)
        total = sum(seqlens)
        choices = torch.tensor([0.0, 0.0, 0.3, 0.7, 1.0, 1.5])
        temps = choices[torch.randint(0, 6, (len(seqlens),), generator=g)].tolist()
        logits = _logits(g, total, vocab).to(device)
        t = _tensors(g, seqlens, temps, device)
        gold = None
        if forced:
            tokens = torch.randint(0, vocab, (total,), generator=g)
            gold = torch.where(torch.rand(total, generator=g) < 0.3, tokens, -1).to(device)
        drafts = _drafts(g, logits, t, seqlens, gold)
        mismatched += _compare(logits, drafts, t, seqlens, _layout(seqlens, device), gold)
        rows += total
    assert mismatched <= max(1, MAX_MISMATCH_FRACTION * rows), (mismatched, rows)


@pytest.mark.gpu
@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_plain_decode(device, temp):
    """seqlens all 1: every row is its own request's final row, so sampled_token_ids is each
    row's target token and the near-tie bound applies row by row."""
    g = _gen(7)
    vocab = 4099 if interpreting() else 49152
    num_reqs = 64 if interpreting() else 512
    seqlens = [1] * num_reqs
    logits = _logits(g, num_reqs, vocab).to(device)
    t = _tensors(g, seqlens, [temp] * num_reqs, device)
    drafts = torch.randint(0, vocab, (num_reqs,), generator=g).to(device)
    mismatched = _compare(logits, drafts, t, seqlens, _layout(seqlens, device))
    assert mismatched <= max(1, MAX_MISMATCH_FRACTION * num_reqs)
    if temp == 0.0:
        assert mismatched == 0


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [49152, 128256])
@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_single_request_real_vocab(device, vocab, temp):
    """One request, 7 drafts: all accepted (bonus row), then rejected at each position."""
    g = _gen(vocab)
    seqlens = [8]
    logits = _logits(g, 8, vocab).to(device)
    t = _tensors(g, seqlens, [temp], device)
    layout = _layout(seqlens, device)
    target = sample(target_probs(logits, t), t, SAMPLE_SALT)  # [8]
    positions = [0, 3, 7] if interpreting() else range(8)
    for reject_at in positions:
        drafts = target.clone()
        if reject_at < 7:
            drafts[reject_at] = (target[reject_at] + 1) % vocab
        assert _compare(logits, drafts, t, seqlens, layout) <= 1


@pytest.mark.gpu
def test_padded_row_stride_and_small_batches(device):
    """Logits viewed out of a wider buffer (row stride > V); empty and single-row batches."""
    g = _gen(3)
    vocab = 1000
    seqlens = _seqlens(g, 9, 5)
    total = sum(seqlens)
    wide = _logits(g, total, vocab + 37).to(device)
    logits = wide[:, :vocab]  # stride(0) = V + 37
    temps = [0.0 if i % 2 else 1.0 for i in range(len(seqlens))]
    t = _tensors(g, seqlens, temps, device)
    drafts = _drafts(g, logits, t, seqlens, None)
    assert _compare(logits, drafts, t, seqlens, _layout(seqlens, device)) <= 1
    t1 = _tensors(g, [1], [0.0], device)
    one = _logits(g, 1, vocab).to(device)
    _assert_same(
        _fused().verify_triton(one, one.argmax(-1), t1, _layout([1], device)),
        verify_reference(one, one.argmax(-1), None, t1, _layout([1], device)),
    )


@pytest.mark.gpu
def test_dispatch(device, monkeypatch):
    """verify() takes the kernel only for CUDA tensors and fusable steps, never when disabled."""
    tv = _fused()
    calls = []
    real = tv.verify_triton

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(tv, "verify_triton", spy)
    g = _gen(5)
    seqlens = [3, 1, 2]
    logits = _logits(g, 6, 1000).to(device)
    layout = _layout(seqlens, device)
    drafts = torch.zeros(6, dtype=torch.int64, device=device)
    plain = _tensors(g, seqlens, [0.0, 1.0, 0.5], device)
    filtered = SamplingTensors.build([SamplingParams(top_k=5)] * 6, [1] * 6, range(6), device)
    assert tv.fusable(plain, None)
    assert not tv.fusable(filtered, None)
    assert not tv.fusable(plain, torch.zeros(6, 1000))
    greedy = _tensors(g, seqlens, [0.0, 0.0, 0.0], device)
    assert tv.fusable(greedy, torch.zeros(6, 1000))  # a greedy row's p is one-hot: q is moot

    on_cuda = int(device.type == "cuda")
    verify(logits, drafts, None, plain, layout)
    assert len(calls) == on_cuda
    verify(logits, drafts, None, plain, layout, fused=False)
    verify(logits, drafts, None, filtered, layout)
    verify(logits, drafts, torch.softmax(logits, -1), plain, layout)
    monkeypatch.setattr(env.settings, "fused_verify", False)
    verify(logits, drafts, None, plain, layout)
    assert len(calls) == on_cuda


# --- chunked reduction: phase 1 splits V into chunk_size(V) columns, phase 2 merges them ----


def _chunked(monkeypatch, chunk: int | None, vocab: int) -> int:
    """Set the kernel's chunk (None: the default) and return the one it will use for vocab."""
    tv = _fused()
    if chunk is not None:
        monkeypatch.setattr(tv, "CHUNK", chunk)
    return tv.chunk_size(vocab)


def _spots(vocab: int, chunk: int) -> list[list[int]]:
    """Per row, the columns that hold the row's maximum (several: an exact tie): each chunk's
    first and last column, ties straddling every chunk boundary, ties listed out of order."""
    nc = -(-vocab // chunk)
    rows = [[c * chunk] for c in range(nc)] + [[min((c + 1) * chunk, vocab) - 1] for c in range(nc)]
    rows += [[c * chunk - 1, c * chunk] for c in range(1, nc)]
    rows += [[vocab - 1, min(chunk + 5, vocab - 2), vocab // 2], [vocab - 1, 0]]
    return rows


def _planted(g: torch.Generator, vocab: int, spots: list[list[int]]) -> torch.Tensor:
    """[len(spots) + 3, V] f32: randn background, 50.0 at each row's spots, then an all-zero
    row, an all -inf row and one that is -inf but for its last two columns (tied)."""
    x = torch.randn(len(spots), vocab, generator=g)
    for r, cols in enumerate(spots):
        x[r, cols] = 50.0
    tail = torch.full((1, vocab), float("-inf"))
    tail[0, -2:] = 1.0
    return torch.cat([x, torch.zeros(1, vocab), torch.full((1, vocab), float("-inf")), tail])


@pytest.mark.gpu
@pytest.mark.parametrize(("vocab", "chunk"), [(1000, 64), (1031, 128), (4099, 256), (300, None)])
def test_greedy_argmax_across_chunks(device, monkeypatch, vocab, chunk):
    """The maximum in every chunk, at chunk edges, and tied across chunk boundaries: greedy
    must be torch.argmax exactly (lowest tied column), V not a multiple of the chunk."""
    c = _chunked(monkeypatch, chunk, vocab)
    assert vocab % c != 0 and (chunk is None or -(-vocab // c) > 4)
    spots = _spots(vocab, c)
    logits = _planted(_gen(vocab), vocab, spots).to(device)
    want = torch.tensor([min(s) for s in spots] + [0, 0, vocab - 2])
    assert torch.equal(logits.argmax(-1).cpu(), want)
    n = logits.shape[0]
    # Plain decode: every row is its request's final row, so sampled_token_ids = its argmax.
    t = _tensors(_gen(1), [1] * n, [0.0] * n, device)
    drafts = torch.zeros(n, dtype=torch.int64, device=device)
    got = _fused().verify_triton(logits, drafts, t, _layout([1] * n, device))
    assert torch.equal(got.sampled_token_ids.cpu(), want)
    _assert_same(got, verify_reference(logits, drafts, None, t, _layout([1] * n, device)))
    # Requests of up to 8 rows drafting the argmax: accepted through, then one rejection.
    seqlens = [8] * (n // 8) + ([n % 8] if n % 8 else [])
    drafts = logits.argmax(-1)
    drafts[5] = (drafts[5] + 1) % vocab
    layout = _layout(seqlens, device)
    t = _tensors(_gen(2), seqlens, [0.0] * len(seqlens), device)
    _assert_same(
        _fused().verify_triton(logits, drafts, t, layout),
        verify_reference(logits, drafts, None, t, layout),
    )


@pytest.mark.gpu
@pytest.mark.parametrize(("vocab", "chunk"), [(1000, 64), (4099, 256)])
def test_sampling_race_across_chunks(device, monkeypatch, vocab, chunk):
    """Sampling rows whose mass sits in tied planted columns in different chunks (the race
    decides between chunks by the noise alone) and random rows over many chunks."""
    _chunked(monkeypatch, chunk, vocab)
    g = _gen(vocab + 1)
    spots = _spots(vocab, _fused().chunk_size(vocab))
    planted = _planted(g, vocab, spots)[: len(spots)]  # drop the rows with no finite max
    logits = torch.cat([planted, _logits(g, 16, vocab)]).to(device)
    n = logits.shape[0]
    temps = [[0.5, 1.0, 2.0][i % 3] for i in range(n)]
    t = _tensors(g, [1] * n, temps, device)
    drafts = torch.zeros(n, dtype=torch.int64, device=device)
    assert _compare(logits, drafts, t, [1] * n, _layout([1] * n, device)) <= 1
    # The same rows as requests of up to 8, half greedy, some forced, drafting the reference.
    seqlens = [8] * (n // 8) + ([n % 8] if n % 8 else [])
    t = _tensors(g, seqlens, [[0.0, 0.7][i % 2] for i in range(len(seqlens))], device)
    gold = torch.where(torch.rand(n, generator=g) < 0.2, torch.randint(0, vocab, (n,)), -1)
    gold = gold.to(device)
    drafts = _drafts(g, logits, t, seqlens, gold)
    assert _compare(logits, drafts, t, seqlens, _layout(seqlens, device), gold) <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_single_request_k7_ties_at_full_vocab(device, temp):
    """V = 128256 at the default chunk: one request, 7 drafts, each row's maximum tied across
    a different chunk boundary (greedy: the lower column; sampling: the race between them)."""
    vocab = 128256
    c = _fused().chunk_size(vocab)
    assert c >= 4096 and -(-vocab // c) <= 64 and vocab % c != 0
    spots = [[k * c - 1, k * c] for k in (1, 5, 9, 16, 22, 30)] + [[vocab - 1, 0], [vocab - 1]]
    logits = _planted(_gen(9), vocab, spots)[:8].to(device)  # [8, V]
    seqlens = [8]
    t = _tensors(_gen(10), seqlens, [temp], device)
    layout = _layout(seqlens, device)
    target = sample(target_probs(logits, t), t, SAMPLE_SALT)  # [8]
    if temp == 0.0:
        assert target.tolist() == [min(s) for s in spots]
    for reject_at in (2, 7):
        drafts = target.clone()
        if reject_at < 7:
            drafts[reject_at] = (target[reject_at] + 1) % vocab
        assert _compare(logits, drafts, t, seqlens, layout) <= int(temp > 0)


@pytest.mark.gpu
def test_chunk_size(device):
    """At most MAX_CHUNKS chunks of at least CHUNK columns, except for a small vocabulary."""
    tv = _fused()
    assert tv.chunk_size(128256) == tv.CHUNK == 4096
    assert tv.chunk_size(1000) == 1024
    for vocab in (49152, 128256, 151936, 262144, 1 << 20):
        c = tv.chunk_size(vocab)
        assert c >= tv.CHUNK and c & (c - 1) == 0 and -(-vocab // c) <= tv.MAX_CHUNKS
