"""The pinned staging ring (ops/staging.py), on the CPU with events the test completes: no
region is rewritten while a copy from it is pending, and the ring never waits."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.ops.staging import ALIGN, StagingRing


class Copy:
    """A queued copy: it reads its region's bytes when the test lets it run (complete)."""

    def __init__(self, ring: StagingRing, region: tuple[int, int], want: bytes) -> None:
        self.ring, self.region, self.want, self.done = ring, region, want, False

    def query(self) -> bool:
        return self.done

    def run(self) -> None:
        a = self.region[0]
        got = bytes(self.ring.buf[a : a + len(self.want)].tolist())
        assert got == self.want, "a region was rewritten before its copy ran"
        self.done = True


def make_ring(capacity: int) -> tuple[StagingRing, list[Copy]]:
    copies: list[Copy] = []
    ring = StagingRing(torch.zeros(capacity, dtype=torch.uint8), lambda: copies[-1])
    return ring, copies


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("stage"), st.integers(0, 100)),
            st.tuples(st.just("run"), st.integers(1, 4)),
        ),
        max_size=60,
    )
)
def test_no_region_is_rewritten_while_its_copy_is_pending(ops):
    ring, copies = make_ring(256)
    pending: list[Copy] = []
    for i, (op, n) in enumerate(ops):
        if op == "run":  # the device runs the oldest copies (one stream: in order)
            for c in pending[:n]:
                c.run()
            del pending[:n]
            continue
        region = ring.stage(n)
        if region is None:
            # only when a pending copy holds the room, or the upload is too large
            assert n > 64 or pending
            continue
        a, b = region
        assert a % ALIGN == 0 and 0 <= a and b <= 256 and b - a >= n
        want = bytes((i + j) % 251 for j in range(n))
        ring.buf[a : a + n] = torch.tensor(list(want), dtype=torch.uint8)
        copies.append(Copy(ring, region, want))
        ring.issued(region)
        pending.append(copies[-1])
    for c in pending:
        c.run()


def test_the_ring_reuses_its_bytes_once_the_copies_have_run():
    ring, copies = make_ring(256)
    seen = set()
    for _ in range(40):
        region = ring.stage(48)
        assert region is not None
        copies.append(Copy(ring, region, b""))
        ring.issued(region)
        copies[-1].done = True
        seen.add(region)
    assert len(seen) == 256 // 48  # laps over the same regions


def test_a_pending_copy_sends_the_upload_to_its_own_block():
    ring, copies = make_ring(256)
    regions = []
    for _ in range(256 // 64):
        regions.append(ring.stage(64))
        copies.append(Copy(ring, regions[-1], b""))
        ring.issued(regions[-1])
    assert ring.stage(16) is None  # all four regions still being copied: no wait, no reuse
    copies[0].done = True
    assert ring.stage(16) == (0, 16)
    assert ring.stage(65) is None  # more than a quarter of the ring
