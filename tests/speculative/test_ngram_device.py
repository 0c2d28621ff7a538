"""The n-gram matcher on the device (ngram_device.py): the host index's proposals, its history,
and the confidences its drafts carry."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.engine.slots import DraftSlotPool
from specserve.sample.layout import build_layout
from specserve.speculative.ngram import NgramIndex
from specserve.speculative.ngram_device import NgramDeviceDrafter


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=4),
    st.integers(1, 3),
    st.integers(3, 5),
)
def test_device_ngram_proposes_what_the_host_index_proposes(histories, n_min, n_max):
    """Low-entropy histories (tokens 0..3) so most suffixes match somewhere."""
    k, width = 4, 48
    pool = DraftSlotPool(len(histories), k, 8, False, torch.device("cpu"))
    drafter = NgramDeviceDrafter(pool, n_min, n_max, width)
    slots = torch.arange(1, len(histories) + 1)
    for s, h in zip(slots.tolist(), histories):
        drafter.admit(s, torch.tensor(h))
    lens = torch.tensor([len(h) for h in histories])
    drafter.verified.fill_(10.0)  # a different rate per kind
    drafter.accepted.copy_(torch.arange(n_max + 1.0).unsqueeze(1).expand(-1, k))
    drafter.draft(slots, lens, max(len(h) for h in histories))
    for s, h in zip(slots.tolist(), histories):
        want = NgramIndex(n_min, n_max).propose(h, k)
        got = [t for t in pool.draft_ids[s].tolist() if t >= 0]
        assert got == want, (h, got, want)
        assert pool.draft_ids[s, len(got) :].eq(-1).all()
        # the kind of its drafts: the length of the match that proposed them, whose rates
        # its drafts carry (0 where it has none)
        kind = NgramIndex(n_min, n_max).match(h)[1]
        assert int(drafter.kind[s]) == kind
        want_conf = drafter.rates()[kind, : len(got)].tolist() + [0.0] * (k - len(got))
        assert pool.draft_conf[s].tolist() == want_conf


def test_device_ngram_history_appends_the_emitted_tokens():
    """A step's accepted drafts and sampled token land at the request's next positions."""
    pool = DraftSlotPool(2, 3, 50, False, torch.device("cpu"))
    drafter = NgramDeviceDrafter(pool, 1, 3, 16)
    drafter.admit(1, torch.tensor([5, 6, 7]))
    drafter.admit(2, torch.tensor([9, 9]))
    layout = build_layout(torch.tensor([3, 1]), 4, 2)
    verified = torch.tensor([8, -1, -1, -1], dtype=torch.int32)  # request 1 accepted one draft
    sampled = torch.tensor([11, 12])
    accepted = torch.tensor([1, 0])
    seq_len = torch.tensor([5, 3])  # 3 + 1 accepted + 1 sampled; 2 + 1
    drafter.append(torch.tensor([1, 2]), layout, verified, sampled, accepted, seq_len)
    assert drafter.history[1, :5].tolist() == [5, 6, 7, 8, 11]
    assert drafter.history[2, :3].tolist() == [9, 9, 12]
