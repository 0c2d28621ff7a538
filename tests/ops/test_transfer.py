"""Host <-> device transfer helpers on CPU (the CUDA side runs under the sync guard in
tests/gpu/test_overlap.py)."""

import numpy as np
import torch

from specserve.ops.transfer import Readback, designed_sync, h2d
from specserve.runner.timeline import StepTimeline


def test_h2d_keeps_values_and_dtype() -> None:
    cpu = torch.device("cpu")
    assert h2d([1, -2, 3], torch.int64, cpu).tolist() == [1, -2, 3]
    assert h2d(np.arange(4, dtype=np.int32), torch.int64, cpu).dtype == torch.int64
    assert h2d([], torch.float32, cpu).shape == (0,)
    assert h2d([0.5], torch.float32, cpu).tolist() == [0.5]


def test_readback_returns_the_tensors_on_cpu() -> None:
    a, b = torch.arange(3), torch.tensor([[1.5, 2.5]])
    rb = Readback([a, b])
    assert rb.ready()
    got = rb.wait()
    assert torch.equal(got[0], a) and torch.equal(got[1], b)
    with designed_sync():  # a no-op without CUDA
        pass


def test_timeline_is_off_without_cuda() -> None:
    tl = StepTimeline(torch.device("cpu"))
    tl.start()
    tl.begin("decode")
    tl.end()
    s = tl.summary("decode")
    assert not tl.enabled and s.num_steps == 0 and s.idle_fraction == 0.0
