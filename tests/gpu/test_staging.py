"""Uploads through the pinned staging ring (ops/staging.py) while the device is busy: every
device tensor holds the values its upload had, though the ring laps many times over copies
still queued behind a long kernel, and no upload waits for the device.

    pytest -m gpu tests/gpu/test_staging.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve import env
from specserve.ops import staging
from specserve.ops.transfer import h2d, h2d_packed

pytestmark = pytest.mark.gpu


def test_uploads_behind_a_busy_stream_keep_their_values(cuda, monkeypatch):
    if cuda.type != "cuda":
        pytest.skip("needs a CUDA device (pinned memory)")
    monkeypatch.setattr(staging, "CAPACITY", 16384)  # small: it laps every ~10 uploads
    monkeypatch.setattr(staging, "_RINGS", {})
    rng = np.random.default_rng(0)
    sent, got = [], []
    with env.override(pinned_staging=True):
        torch.cuda.set_sync_debug_mode("error")  # an upload that waited would raise
        try:
            for i in range(300):
                if i % 50 == 0:
                    torch.cuda._sleep(50_000_000)  # ~tens of ms: the copies queue behind it
                a = rng.integers(-(2**40), 2**40, size=int(rng.integers(0, 200)))
                b = rng.random(int(rng.integers(1, 50))).astype(np.float32)
                sent.append((a, b))
                got.append((h2d(a, torch.int64, cuda), *h2d_packed([(b, torch.float32)], cuda)))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    ring = staging._RINGS[torch.cuda.current_device()]
    assert ring.buf.is_pinned()
    for (a, b), (da, db) in zip(sent, got):
        assert np.array_equal(da.cpu().numpy(), a) and np.array_equal(db.cpu().numpy(), b)
