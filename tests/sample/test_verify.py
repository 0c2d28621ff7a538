import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.ops.sampling import SamplingTensors
from specserve.sample.layout import build_layout, check_layout
from specserve.sample.verify import prefix_accept, verify
from specserve.sampling_params import SamplingParams


def _layout(seqlens):
    return build_layout(torch.tensor(seqlens), sum(seqlens), max(seqlens) - 1)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=12), st.data())
def test_prefix_acceptance_matches_a_row_by_row_reference(seqlens, data):
    layout = _layout(seqlens)
    check_layout(layout)
    accept = torch.tensor(
        data.draw(st.lists(st.booleans(), min_size=sum(seqlens), max_size=sum(seqlens)))
    )
    accepted, num_acc = prefix_accept(accept, layout)
    row = 0
    for i, s in enumerate(seqlens):
        n = 0
        while n < s - 1 and accept[row + n]:
            n += 1
        assert num_acc[i].item() == n
        assert accepted[row : row + s].tolist() == [j < n for j in range(s)]
        row += s


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=8), st.integers(0, 2**31), st.booleans())
def test_verified_rows_are_a_prefix_then_sentinels(seqlens, seed, greedy):
    """Invariant 2: per request, verified rows read t1..tk, -1, -1 (nothing after a -1)."""
    g = torch.Generator().manual_seed(seed)
    vocab = 5
    total = sum(seqlens)
    logits = torch.randn(total, vocab, generator=g) * 3
    drafts = torch.randint(0, vocab, (total,), generator=g)
    layout = _layout(seqlens)
    params = SamplingParams(temperature=0.0 if greedy else 1.0)
    t = SamplingTensors.build([params] * total, [seed] * total, list(range(total)), "cpu")
    res = verify(logits, drafts, None, t, layout)
    v = res.verified_token_ids.tolist()
    row = 0
    for i, s in enumerate(seqlens):
        rows = v[row : row + s]
        n = res.num_accepted[i].item()
        assert rows[:n] == drafts[row : row + n].tolist()
        assert all(x == -1 for x in rows[n:])
        assert rows[s - 1] == -1  # the last row never verifies
        assert res.final_rows[i].item() == row + n
        if greedy:
            assert res.sampled_token_ids[i].item() == logits[row + n].argmax().item()
        row += s
