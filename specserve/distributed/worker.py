"""A tensor-parallel worker process (ranks 1 .. tp-1), spawned by rank 0's engine.

It owns one shard of the model and of the KV cache and does what rank 0 tells it down its pipe,
in order: take its weights, build its runner, capture CUDA graphs, replay each step's forward.
It holds no scheduler and samples nothing. The pipe is also its lifeline: when rank 0 goes away
(exit, crash, SIGKILL) the pipe closes and the worker exits, so no worker outlives its engine.
On any failure it sends the error up the pipe (rank 0 names it in its own error) and exits.
"""

from __future__ import annotations

import os
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch


def worker_main(
    rank: int,
    world_size: int,
    port: int,
    conn: Connection,
    device: str,
    timeout_s: float,
    num_threads: int,
) -> None:
    try:
        _serve(rank, world_size, port, conn, torch.device(device), timeout_s, num_threads)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # rank 0 is gone: nothing to report to
    except BaseException as e:
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        print(f"specserve tensor-parallel rank {rank}: {traceback.format_exc()}", file=sys.stderr)
        try:
            conn.send(("error", detail))
        except Exception:
            pass
        sys.stderr.flush()
        os._exit(1)
    # no interpreter teardown: destroying an NCCL communicator whose collectives were captured
    # in CUDA graphs can hang (pytorch#115388); the process has nothing left to flush
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve(
    rank: int,
    world_size: int,
    port: int,
    conn: Connection,
    device: torch.device,
    timeout_s: float,
    num_threads: int,
) -> None:
    from specserve.distributed.group import TPGroup, make_store
    from specserve.distributed.layers import build_shard
    from specserve.distributed.runner import replay_step
    from specserve.runner.model_runner import ModelRunner

    if device.type == "cpu":
        torch.set_num_threads(num_threads)
    else:
        torch.cuda.set_device(device)
    store = make_store(rank, port, world_size, timeout_s)
    msg = conn.recv()
    if msg[0] == "stop":  # rank 0 gave up before sharding (e.g. sizes it cannot split)
        return
    _, cfg, plan, dtype, names = msg
    conn.send(("ok",))  # alive and on its device: rank 0 may block in the rendezvous now
    group = TPGroup.create(store, rank, world_size, device, timeout_s)
    model = build_shard(cfg, plan, rank, group, dtype, device)
    params = dict(model.named_parameters())
    buf = bytearray()
    with torch.no_grad():
        for name in names:
            dst = params[name].data.view(-1).view(torch.uint8)  # [bytes]
            if len(buf) < dst.numel():
                buf = bytearray(dst.numel())
            n = conn.recv_bytes_into(buf)
            dst.copy_(torch.frombuffer(buf, dtype=torch.uint8, count=n))
    del buf
    conn.send(("ok",))
    runner: ModelRunner | None = None
    while True:
        msg: Any = conn.recv()
        kind = msg[0]
        if kind == "step":
            replay_step(runner, msg[1], group)
        elif kind == "runner":
            runner = ModelRunner(model, *msg[1], device=device, **msg[2])
            runner.sample_tail = False  # rank 0 samples (eagerly, as TPModelRunner does)
            conn.send(("ok",))
        elif kind == "graphs":
            runner.init_cuda_graphs(*msg[1], progress=False)
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown tensor-parallel command {kind!r}")
