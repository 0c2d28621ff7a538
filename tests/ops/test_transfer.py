"""Host <-> device transfer helpers on CPU (the CUDA side runs under the sync guard in
tests/gpu/test_overlap.py)."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.ops.transfer import Readback, designed_sync, h2d, h2d_packed, packed_views
from specserve.runner.timeline import StepTimeline


def test_h2d_keeps_values_and_dtype() -> None:
    cpu = torch.device("cpu")
    assert h2d([1, -2, 3], torch.int64, cpu).tolist() == [1, -2, 3]
    assert h2d(np.arange(4, dtype=np.int32), torch.int64, cpu).dtype == torch.int64
    assert h2d([], torch.float32, cpu).shape == (0,)
    assert h2d([0.5], torch.float32, cpu).tolist() == [0.5]


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([torch.int64, torch.int32, torch.float32, torch.bool]),
            st.integers(0, 3),
            st.integers(1, 3),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_packed_views_are_the_arrays(specs) -> None:
    """Any mix of dtypes and shapes (empty ones too) comes back equal through one buffer."""
    rng = np.random.default_rng(len(specs))
    arrays = [(rng.integers(-9, 9, size=(n, w)).astype(np.float64) > 0 if d is torch.bool
               else rng.integers(-9, 9, size=(n, w)), d) for d, n, w in specs]  # fmt: skip
    got = packed_views(arrays, lambda buf: buf.clone())
    want = h2d_packed(arrays, torch.device("cpu"))
    for g, w, (a, d) in zip(got, want, arrays):
        assert g.dtype == d and g.shape == a.shape
        assert torch.equal(g, w) and torch.equal(g, torch.as_tensor(a, dtype=d))
    # each view 16-byte aligned whatever the lengths before it (Triton specialises on that)
    base = got[0].data_ptr()
    assert all((g.data_ptr() - base) % 16 == 0 for g in got if g.numel())


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
