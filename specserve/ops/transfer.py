"""Host <-> device transfers that never stall the host on a busy device.

Why: `torch.tensor(xs, device="cuda")` and `.to("cuda")` from pageable memory synchronise the
stream before the copy starts, so under overlap scheduling the host would wait for the step in
flight before it could even hand over the next step's inputs. Staging through pinned memory
makes every upload asynchronous (torch's caching host allocator keeps the pinned block alive
until the copy has run). Downloads go to pinned buffers too, and the host waits on one event at
the one designed synchronisation point of a step (`Readback.wait`).

On CPU both directions are plain tensors: nothing to overlap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch


def h2d(values: Sequence | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A device tensor holding `values`, uploaded without a host sync."""
    cpu = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return cpu
    return cpu.pin_memory().to(device, non_blocking=True)


class Readback:
    """Device tensors copied to pinned host memory in one asynchronous batch; `wait()` blocks
    until the copies (and so everything queued before them) are done and returns host tensors."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        if not tensors or tensors[0].device.type != "cuda":
            self._host = [t.detach() for t in tensors]
            return
        self._host = []
        for t in tensors:
            dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            dst.copy_(t, non_blocking=True)
            self._host.append(dst)
        self._event = torch.cuda.Event()
        self._event.record()

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> list[torch.Tensor]:
        if self._event is not None:
            with designed_sync():
                self._event.synchronize()
            self._event = None
        return self._host


@contextlib.contextmanager
def designed_sync() -> Iterator[None]:
    """Marks the one place a step may wait for the device: the sync guard test runs the engine
    under torch.cuda.set_sync_debug_mode("error"), and this lifts it for the block only."""
    if not torch.cuda.is_available():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)
