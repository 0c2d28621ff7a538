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
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch


def h2d(values: Sequence | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A device tensor holding `values`, uploaded without a host sync."""
    cpu = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return cpu
    return cpu.pin_memory().to(device, non_blocking=True)


def pinned_empty(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None
) -> torch.Tensor:
    """An uninitialised host tensor to fill and then upload_pinned to `device`: in pinned memory
    for CUDA (torch's caching host allocator: no allocation once warm, and a block is reused
    only after the copy from it has run), plain otherwise."""
    pin = device is not None and device.type == "cuda"
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def upload_pinned(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A pinned_empty tensor on `device`, copied without a host sync (no staging copy)."""
    if device.type != "cuda":
        return host
    return host.to(device, non_blocking=True)


_NP = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.float32: np.float32,
    torch.bool: np.bool_,
}


def h2d_packed(
    arrays: Sequence[tuple[Sequence | np.ndarray, torch.dtype]], device: torch.device
) -> list[torch.Tensor]:
    """Several small arrays uploaded as one: one pinned staging buffer, one copy, typed views.
    Each upload costs tens of microseconds of host work, which a small model's step cannot
    hide."""
    if device.type != "cuda":
        return [torch.as_tensor(v, dtype=d) for v, d in arrays]
    return packed_views(arrays, lambda buf: buf.to(device, non_blocking=True), pin=True)


def packed_views(
    arrays: Sequence[tuple[Sequence | np.ndarray, torch.dtype]],
    move: Callable[[torch.Tensor], torch.Tensor],
    pin: bool = False,
) -> list[torch.Tensor]:
    """The arrays packed into one uint8 buffer (pinned: written in place, one copy fewer than
    pinning a filled buffer), `move`d, then viewed. Each starts on a 16-byte boundary: Triton
    specialises a kernel on its pointer arguments' 16-byte alignment, so views whose alignment
    followed the arrays' lengths would compile a new variant mid-run."""
    nps = [np.ascontiguousarray(v, dtype=_NP[d]) for v, d in arrays]
    offsets, total = [], 0
    for a in nps:
        offsets.append(total)
        total += -(-a.nbytes // 16) * 16
    buf = torch.zeros(max(total, 16), dtype=torch.uint8, pin_memory=pin)
    host = buf.numpy()
    for a, o in zip(nps, offsets):
        host[o : o + a.nbytes] = a.reshape(-1).view(np.uint8)
    buf = move(buf)
    return [
        buf[o : o + a.nbytes].view(d).view(a.shape) for a, o, (_, d) in zip(nps, offsets, arrays)
    ]


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
