"""split_rows on the device: captured in a CUDA graph with the total a device tensor, each replay
splits the total the host wrote before it, as the CPU reference does."""

from __future__ import annotations

import pytest
import torch

from specserve.runner.device_split import split_rows

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_rows_replays_in_a_cuda_graph():
    dev = torch.device("cuda")
    n, k = 64, 4
    surv = torch.zeros(n, k, device=dev)
    total = torch.zeros((), dtype=torch.int64, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as capture needs
        for _ in range(3):
            split_rows(surv, total)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = split_rows(surv, total)
    gen = torch.Generator().manual_seed(0)
    for t in (0, 1, 17, 100, 256, 300):
        conf = torch.rand(n, k, generator=gen)
        conf[torch.rand(n, k, generator=gen) < 0.2] = 0.0  # some drafts surely wrong
        conf[: n // 4] = 0.5  # ties across requests and positions
        host = conf.cumprod(1)
        surv.copy_(host)
        total.fill_(t)
        graph.replay()
        assert out.cpu().tolist() == split_rows(host, t).tolist()
