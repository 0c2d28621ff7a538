"""A pinned staging ring for host -> device uploads: one pinned buffer allocated once, reused.

Why: an upload from pageable memory synchronises the stream before it starts (transfer.py), so
each step's small arrays are staged in pinned memory. `Tensor.pin_memory()` takes a fresh
pinned block per call, and torch's host allocator often ends in `cudaHostAlloc`, which can cost
more than a small model's whole step on the device (`tools/profile_step.py --mixed` shows it).
Here each upload takes the next free bytes of the ring instead.

A region is handed out only if no copy still reading it is pending: each copy records an event
behind it, and the region of an event not yet complete is never rewritten. When the ring has no
such room (it lapped a copy still queued behind a long step, or the upload is larger than a
quarter of it), `stage` returns None and the caller pins a block of its own, as before: the
ring never waits for the device.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

ALIGN = 16  # every region starts on a 16-byte boundary (Triton specialises on alignment)


class _Event(Protocol):
    def query(self) -> bool: ...


class StagingRing:
    def __init__(
        self,
        buf: torch.Tensor,  # [capacity] uint8, pinned on CUDA
        event: Callable[[], _Event],  # a recorded event behind the copy just issued
    ) -> None:
        self.buf, self.capacity, self._event = buf, buf.numel(), event
        self._head = 0
        self._pending: deque[tuple[int, int, _Event]] = deque()  # (start, end, event), in order
        self._lock = threading.Lock()

    def stage(self, nbytes: int) -> tuple[int, int] | None:
        """A free region [start, end) of at least nbytes, or None (the caller pins its own)."""
        n = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        if n > self.capacity // 4:
            return None
        with self._lock:
            while self._pending and self._pending[0][2].query():  # copies done, oldest first
                self._pending.popleft()
            a = self._head if self._head + n <= self.capacity else 0
            b = a + n
            if any(s < b and a < e for s, e, _ in self._pending):
                return None  # a copy still reads it: never wait for the device
            self._head = b
            return a, b

    def issued(self, region: tuple[int, int]) -> None:
        """The copy from `region` is queued: its bytes stay untouched until it has run."""
        with self._lock:
            self._pending.append((*region, self._event()))


_RINGS: dict[int, StagingRing] = {}
CAPACITY = 16 << 20  # bytes: a step uploads kilobytes, so the ring laps after thousands of steps


def ring(device: torch.device) -> StagingRing:
    """The device's ring, its pinned buffer allocated on first use."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    r = _RINGS.get(index)
    if r is None:
        buf = torch.empty(CAPACITY, dtype=torch.uint8, pin_memory=True)

        def event() -> torch.cuda.Event:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(index))
            return ev

        r = _RINGS[index] = StagingRing(buf, event)
    return r
