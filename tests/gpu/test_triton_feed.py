"""The Triton kernels of a device-drafted step's bookkeeping (runner/triton_feed.py) against
their torch reference (runner/device_feed.py, golden_device.py), bit for bit.

    pytest -m gpu tests/gpu/test_triton_feed.py                        # CUDA (skips without)
    TRITON_INTERPRET=1 pytest -m gpu tests/gpu/test_triton_feed.py     # CPU, Triton interpreter
"""

from __future__ import annotations

import random

import pytest
import torch

from specserve.engine.slots import DraftSlotPool
from specserve.runner.device_feed import (
    DraftFeed,
    advance_slots,
    drafted_rows,
    feed_verify_rows,
)
from specserve.sample.layout import build_layout

pytestmark = pytest.mark.gpu

SLOTS, K, V, WIDTH = 12, 4, 1000, 40


@pytest.fixture
def device(cuda: torch.device) -> torch.device:
    pytest.importorskip("triton")
    return cuda


def _step(seed: int, device: torch.device):
    """A random pool and step: requests on distinct slots (one slotless, verifying nothing),
    each with 0..K draft rows fed from its slot, some shifted by the step in flight."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    pool = DraftSlotPool(SLOTS, K, V, store_q=False, device=torch.device("cpu"))
    pool.draft_ids.copy_(torch.randint(-1, V, pool.draft_ids.shape, generator=g))
    pool.draft_conf.copy_(torch.rand(pool.draft_conf.shape, generator=g))
    pool.rejected[1:] = torch.randint(0, K + 1, (SLOTS,), generator=g)
    pool.seq_len[1:] = torch.randint(50, 90, (SLOTS,), generator=g)
    gold = pool.ensure_gold(WIDTH)
    gold.copy_(torch.randint(0, V, gold.shape, generator=g))
    for s in range(1, SLOTS + 1):  # each golden sequence ends somewhere (-1 after)
        gold[s, rng.randrange(WIDTH // 2, WIDTH + 1) :] = -1
    slots = rng.sample(range(1, SLOTS + 1), rng.randrange(4, SLOTS)) + [0]
    rng.shuffle(slots)
    drafts = [0 if s == 0 else rng.randrange(0, K + 1) for s in slots]
    shifted = [s != 0 and rng.random() < 0.6 for s in slots]
    first = slots.index(0) - 1  # a real request with every draft row, shifted
    drafts[first], shifted[first] = K, True
    at, row_shift, counter = [], [], []
    for s, d, sh in zip(slots, drafts, shifted):
        at += [s * K + j + 1 for j in range(d)] + [0]
        row_shift += [s if sh else 0] * (d + 1)
        n = rng.randrange(0, WIDTH + 4)
        counter += [n + j for j in range(d + 1)]
    t = len(at)
    i64 = dict(dtype=torch.int64)
    feed = DraftFeed(
        torch.tensor(at, **i64),
        torch.tensor(row_shift, **i64),
        torch.tensor([s if sh else 0 for s, sh in zip(slots, shifted)], **i64),
        torch.tensor([rng.randrange(40, 80) for _ in slots], **i64),
    )
    seqlens = torch.tensor([d + 1 for d in drafts], **i64)
    layout = build_layout(seqlens, t, max(drafts))
    accepted = torch.tensor([rng.randrange(0, d + 1) for d in drafts], **i64)
    host_drafts = torch.tensor([rng.randrange(0, V) for _ in range(t)], **i64)
    counter_t = torch.tensor(counter, **i64)
    slots_t = torch.tensor(slots, **i64)
    moved = [pool, feed, layout, accepted, host_drafts, counter_t, slots_t]
    return [_to(x, device) for x in moved]


def _to(x, device):
    if isinstance(x, DraftSlotPool):
        for name in ("draft_ids", "draft_conf", "seq_len", "rejected", "gold"):
            setattr(x, name, getattr(x, name).to(device))
        x.device = device
        return x
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return type(x)(*[_to(v, device) if isinstance(v, torch.Tensor) else v for v in x])


def _clone_pool(pool: DraftSlotPool) -> DraftSlotPool:
    twin = DraftSlotPool(SLOTS, K, V, store_q=False, device=pool.device)
    for name in ("draft_ids", "draft_conf", "seq_len", "rejected", "gold"):
        setattr(twin, name, getattr(pool, name).clone())
    return twin


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("golden", [False, True])
def test_feed_rows_equal_the_torch_reference(device, seed, golden):
    from specserve.runner import triton_feed

    pool, feed, layout, _, host_drafts, counter, slots = _step(seed, device)
    gold = (layout.row_to_req, slots) if golden else None
    ref = feed_verify_rows(counter.cpu(), host_drafts.cpu(), _to(feed, "cpu"), _cpu(pool), gold and tuple(x.cpu() for x in gold))  # fmt: skip
    got = triton_feed.feed_rows(
        counter, host_drafts, feed.draft_at, feed.row_shift, pool.rejected,
        pool.flat_draft_ids, None if gold is None else (*gold, pool.gold),
    )  # fmt: skip
    for r, g in zip(ref[:2], got[:2]):
        assert torch.equal(r, g.cpu())
    assert (got[2] is None) == (not golden)
    if golden:
        assert torch.equal(ref[2], got[2].cpu())
        assert (ref[2] == -1).any() and (ref[2] >= 0).any()  # both sides of the table's end
    assert (feed.draft_at > 0).any() and (feed.row_shift > 0).any()
    # each output starts 16-byte aligned whatever T is: the verification's kernels are
    # specialised on their pointers' alignment (a new variant would compile mid-run)
    assert all(x.data_ptr() % 16 == 0 for x in got if x is not None)


def _cpu(pool: DraftSlotPool) -> DraftSlotPool:
    return _to(_clone_pool(pool), torch.device("cpu"))


@pytest.mark.parametrize("seed", range(6))
def test_drafted_and_advance_equal_the_torch_reference(device, seed):
    from specserve.runner import triton_feed

    pool, feed, layout, accepted, host_drafts, _, slots = _step(seed, device)
    # the drafts the rows checked: the pool's where fed, -1 now and then (an absent draft)
    draft_ids = torch.where(feed.draft_at > 0, pool.flat_draft_ids[(feed.draft_at - 1).clamp_min(0)], host_drafts)  # fmt: skip
    ref_pool = _cpu(pool)
    cpu_feed, cpu_layout = _to(feed, "cpu"), _to(layout, "cpu")
    count, conf = drafted_rows(cpu_layout, draft_ids.cpu(), cpu_feed, ref_pool.draft_conf)
    seq_len = advance_slots(cpu_layout, slots.cpu(), accepted.cpu(), cpu_feed, ref_pool)
    got = triton_feed.drafted_and_advance(
        layout.seqlens_q, layout.ftp, draft_ids, layout.is_verify, feed.draft_at,
        pool.draft_conf.view(-1), feed.anchor_pos, feed.req_shift, accepted, slots,
        pool.rejected, pool.seq_len, K + 1,
    )  # fmt: skip
    for r, g in zip((count, conf, seq_len), got):
        assert torch.equal(r, g.cpu()), (r, g)
    assert all(x.data_ptr() % 16 == 0 for x in got)  # whatever R is (alignment: see above)
    assert torch.equal(ref_pool.rejected, pool.rejected.cpu())
    assert torch.equal(ref_pool.seq_len, pool.seq_len.cpu())
    assert int(count.sum()) > 0 and float(conf.sum()) > 0  # the case is not empty


@pytest.mark.parametrize("seed", range(6))
def test_golden_drafts_equal_the_torch_reference(device, seed):
    from specserve.runner import triton_feed
    from specserve.speculative.golden_device import GoldenDeviceDrafter

    pool, _, _, _, _, _, slots = _step(seed, device)
    slots = slots[slots > 0]
    g = torch.Generator().manual_seed(seed)
    coins = (torch.rand(pool.gold.shape, generator=g) < 0.6).to(device)
    prompt_len = torch.randint(0, 30, (SLOTS + 1,), generator=g).to(device)
    seq_len = (prompt_len[slots] + torch.randint(0, WIDTH + 3, slots.shape, generator=g).to(device))  # fmt: skip
    ref_pool = _cpu(pool)
    drafter = GoldenDeviceDrafter(ref_pool, 0.6, V, seed=0)
    drafter.coins = coins.cpu()
    drafter.draft(slots.cpu(), seq_len.cpu(), prompt_len.cpu())
    triton_feed.golden_drafts(
        slots, seq_len, prompt_len, pool.gold, coins, pool.draft_ids, pool.draft_conf, V, 0.6
    )
    assert torch.equal(ref_pool.draft_ids, pool.draft_ids.cpu())
    assert torch.equal(ref_pool.draft_conf, pool.draft_conf.cpu())
    written = ref_pool.draft_ids[slots.cpu()]
    assert (written == -1).any() and (written >= 0).any()
