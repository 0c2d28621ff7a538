"""A CUDA-graph backend for CPU tests: warms a body up, "captures" it by running it once more
with host syncs forbidden in the speculation package's own code (what a real capture refuses,
and what would bake a value of the capture into every replay), and replays by rerunning it.
Syncs in the ops are left alone: their CPU branches read host values that their CUDA branches
do not (ops/attention.py's slots_all_valid); the CUDA tests cover those."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import torch

# Tensor methods that read a device value on the host (a sync on CUDA)
_SYNCS = ("item", "tolist", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")
# code whose syncs are refused
_CHECKED = ("/specserve/speculative/", "/specserve/runner/device_split.py")


def _ours() -> bool:
    return any(c in sys._getframe(2).f_code.co_filename for c in _CHECKED)


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    saved = {name: getattr(torch.Tensor, name) for name in _SYNCS}
    getitem = torch.Tensor.__getitem__

    def refuse(name: str) -> Callable[..., None]:
        def call(self, *args, **kwargs):
            if _ours():
                raise AssertionError(f"host sync inside a captured body: Tensor.{name}")
            return saved[name](self, *args, **kwargs)

        return call

    def checked_getitem(self, idx):
        parts = idx if isinstance(idx, tuple) else (idx,)
        if _ours() and any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            raise AssertionError("host sync inside a captured body: boolean-mask indexing")
        return getitem(self, idx)

    try:
        for name in _SYNCS:
            setattr(torch.Tensor, name, refuse(name))
        torch.Tensor.__getitem__ = checked_getitem
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        torch.Tensor.__getitem__ = getitem


class FakeGraphs:
    """Warms up and "captures" (sync-free) like CudaGraphBackend; a replay reruns the body."""

    def __init__(self) -> None:
        self.captured = 0
        self.replays = 0

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        fn()
        with no_host_sync():
            fn()
        self.captured += 1

        def replay() -> None:
            self.replays += 1
            fn()

        return replay


def on_buckets(llm, drafted: bool) -> None:
    """Route an overlapped CPU engine's steps through the bucket layout on fake graphs, its
    forward inline (no worker thread) as on CUDA: decode/verify steps in the decode buckets,
    steps with prompt chunks in the mixed ones. drafted: device-drafted steps sample and
    draft in the graph tail (runner/graph_tail.py); else no step samples there."""
    from specserve import env

    eng = llm.engine
    eng._worker = None
    dd = eng.device_drafting
    with env.override(graph_tail=drafted):
        eng.runner.init_cuda_graphs(
            eng.config.max_num_seqs, 1 + dd.k, eng.max_model_len, progress=False,
            backend=FakeGraphs(), drafting=dd.tail_drafting() if drafted else None,
            max_mixed_rows=eng.max_num_batched_tokens,
        )  # fmt: skip
