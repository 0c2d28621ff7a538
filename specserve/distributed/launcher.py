"""Rank 0's side of tensor parallelism: start the workers, shard the model, watch the workers.

Rank 0 is the engine's own process: it keeps the scheduler, the ledger, the sampler and any
drafter, and runs its shard of every forward; ranks 1 .. tp-1 are processes it spawns itself
(torch.multiprocessing, spawn: no torchrun). The model is loaded once, on rank 0's host memory,
and each worker gets its slices down its pipe: no loader runs twice, a GGUF cache is written
once, dummy weights are the same on every rank, and the full model never has to fit one GPU
(only the host). Device per rank: the CPU (gloo), or cuda:base + rank (NCCL).

A worker that dies is found before the next step is sent (its exit status) or by the collective
it leaves hanging (gloo reports the closed peer at once; every collective also has a timeout,
$SPECSERVE_TP_TIMEOUT): either way rank 0 raises TensorParallelError naming it, and the engine
stops. Shutdown stops the workers, and so does rank 0's exit (their pipe closes).
"""

from __future__ import annotations

import functools
import logging
import multiprocessing.connection as mpc
import signal
import threading
import time
import weakref
from typing import Any

import torch
from torch import nn

from specserve import env
from specserve.config import EngineConfig
from specserve.distributed.errors import TensorParallelError
from specserve.distributed.group import TPGroup, make_store
from specserve.distributed.layers import build_shard, shard_state
from specserve.distributed.plan import ShardPlan
from specserve.distributed.runner import TPModelRunner
from specserve.distributed.worker import worker_main
from specserve.model.config import ModelConfig
from specserve.sampling_params import InvalidRequestError

log = logging.getLogger("specserve.distributed")


def rank_devices(device: torch.device, tp: int) -> list[torch.device]:
    if device.type != "cuda":
        return [device] * tp
    base = device.index or 0
    count = torch.cuda.device_count()
    if base + tp > count:
        raise InvalidRequestError(
            f"tensor_parallel_size={tp} on {device} needs cuda:{base}..cuda:{base + tp - 1}, "
            f"but {count} CUDA device(s) are visible",
            "tensor_parallel_size",
        )
    return [torch.device("cuda", base + r) for r in range(tp)]


class TensorParallel:
    def __init__(self, tp: int, device: torch.device, keep_embedding: bool = False) -> None:
        self.world_size = tp
        self.keep_embedding = keep_embedding  # rank 0 keeps the full embedding (EAGLE-3 head)
        self.devices = rank_devices(device, tp)
        self.timeout_s = env.settings.tp_timeout
        self.plan: ShardPlan | None = None
        self._lock = threading.Lock()
        self._error: str | None = None  # set once the engine has failed
        self.group: TPGroup | None = None
        self._store = make_store(0, 0, tp, self.timeout_s)
        ctx = torch.multiprocessing.get_context("spawn")
        threads = max(1, torch.get_num_threads() // tp)
        restore: list[int] = []  # rank 0's thread count before, set back at shutdown
        if self.devices[0].type == "cpu":
            # every rank gets its share of the cores: with rank 0 keeping them all, its idle
            # OpenMP threads spin on the cores its workers need, and each all-reduce waits
            # (measured: 2.4x slower decoding at TP=2 on 2 cores)
            restore.append(torch.get_num_threads())
            torch.set_num_threads(threads)
        self.procs: list[Any] = []
        self.conns: list[mpc.Connection] = []
        self._watch_stop: list[mpc.Connection] = []  # closing it ends the watchdog thread
        self._nccl: list[Any] = []  # rank 0's NCCL group, aborted at shutdown
        self._finalizer = weakref.finalize(
            self, _stop_workers, self.procs, self.conns, self._watch_stop, restore, self._nccl
        )
        for rank in range(1, tp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(
                    rank,
                    tp,
                    self._store.port,
                    child,
                    str(self.devices[rank]),
                    self.timeout_s,
                    threads,
                ),
                name=f"specserve-tp{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    @property
    def load_device(self) -> torch.device:
        """Where rank 0 loads the full model before slicing it (host memory)."""
        return torch.device("cpu")

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # -- start-up ---------------------------------------------------------------------------
    def shard(self, full: nn.Module, cfg: ModelConfig, dtype: torch.dtype) -> nn.Module:
        """Send each worker its slices of the loaded full model; return rank 0's shard. On any
        failure (sizes that cannot be split included) the workers are stopped first."""
        try:
            return self._shard(full, cfg, dtype)
        except BaseException:
            self.shutdown()
            raise

    def _shard(self, full: nn.Module, cfg: ModelConfig, dtype: torch.dtype) -> nn.Module:
        self.plan = plan = ShardPlan.build(cfg, self.world_size)
        state = {k: v.detach() for k, v in full.state_dict().items()}
        names = list(state)
        for conn in self.conns:
            self._send(conn, ("load", cfg, plan, dtype, names))
        # a worker that failed to start is reported now, not after the rendezvous' timeout
        self._wait_ok()
        self.group = TPGroup.create(
            self._store, 0, self.world_size, self.devices[0], self.timeout_s
        )
        self.group.on_failure = self.failure
        if self.devices[0].type == "cuda":
            self._nccl.append(self.group.pg)
        self._start_watchdog()
        for rank, conn in enumerate(self.conns, start=1):
            part = shard_state(state, cfg, plan, rank)
            for name in names:
                t = part[name].contiguous().view(-1).view(torch.uint8)
                self._guard(functools.partial(conn.send_bytes, t.numpy()))
            del part
        model = build_shard(cfg, plan, 0, self.group, dtype, self.devices[0])
        own = shard_state(state, cfg, plan, 0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(own[name])
        if self.keep_embedding:
            model.embed_tokens.full_weight = state["embed_tokens.weight"]
        self._wait_ok()
        return model

    def runner(
        self,
        model: nn.Module,
        num_layers: int,
        num_kv_heads: int,  # the model's; each rank holds its own (plan.py)
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_num_seqs: int = 256,
    ) -> TPModelRunner:
        """ModelRunner(...)'s arguments: the runner of every rank, rank 0's returned."""
        for rank, conn in enumerate(self.conns, start=1):
            kv = self.plan.ranks[rank].num_kv_heads
            spec = (num_layers, kv, head_dim, num_blocks, block_size, dtype)
            self._send(conn, ("runner", spec, {"max_num_seqs": max_num_seqs}))
        self._wait_ok()
        kv = self.plan.ranks[0].num_kv_heads
        return TPModelRunner(
            self,
            model,
            num_layers,
            kv,
            head_dim,
            num_blocks,
            block_size,
            dtype,
            device,
            max_num_seqs,
        )

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        for proc, conn in zip(self.procs, self.conns):
            left = deadline - time.monotonic()
            ready = mpc.wait([conn, proc.sentinel], timeout=max(0.0, left))
            if conn in ready:
                msg = self._guard(conn.recv)
                if msg[0] == "ok":
                    continue
            raise self.failure(None)

    def _start_watchdog(self) -> None:
        """CUDA: a dead peer leaves NCCL kernels spinning, and rank 0's next host sync would
        wait on them until the NCCL timeout; a thread watching the workers aborts the
        communicator at once, and check_alive (after each step's readback) raises."""
        if self.devices[0].type != "cuda":
            return  # gloo reports a closed peer by itself
        stop_r, stop_w = torch.multiprocessing.get_context("spawn").Pipe(duplex=False)
        self._watch_stop.append(stop_w)
        sentinels = [p.sentinel for p in self.procs]
        threading.Thread(
            target=_watchdog,
            args=(sentinels, stop_r, self.group.pg),
            name="specserve-tp-watchdog",
            daemon=True,
        ).start()

    # -- steps ------------------------------------------------------------------------------
    def send(self, msg: Any) -> None:
        """To every worker, in order; a dead worker raises TensorParallelError first."""
        self.check_alive()
        for conn in self.conns:
            self._send(conn, msg)

    def send_bytes(self, blob: bytes) -> None:
        """A message pickled already (`send` of what it unpickles to)."""
        self.check_alive()
        for conn in self.conns:
            self._guard(functools.partial(conn.send_bytes, blob))

    def _send(self, conn: mpc.Connection, msg: Any) -> None:
        self._guard(lambda: conn.send(msg))

    def _guard(self, fn: Any) -> Any:
        try:
            return fn()
        except (OSError, EOFError) as e:
            raise self.failure(e) from e

    def check_alive(self) -> None:
        if self._error is not None or any(p.exitcode is not None for p in self.procs):
            raise self.failure(None)

    def failure(self, exc: BaseException | None) -> TensorParallelError:
        """The error that ends the engine: which worker ended and why (its own report when it
        sent one), else the failed collective itself. Decided once (threads may ask at the same
        time: the CPU overlap thread and the engine's): every later step raises it again."""
        with self._lock:
            if self._error is None:
                self._error = self._diagnose(exc)
            return TensorParallelError(self._error)

    def _diagnose(self, exc: BaseException | None) -> str:
        # a collective can fail a moment before the peer's exit is visible
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and all(p.exitcode is None for p in self.procs):
            time.sleep(0.02)
        parts = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            report = None
            try:
                while conn.poll():
                    msg = conn.recv()
                    if msg[0] == "error":
                        report = msg[1]
            except (OSError, EOFError):
                pass
            code = proc.exitcode
            if report is not None:
                parts.append(f"rank {rank} (pid {proc.pid}) failed: {report}")
            elif code is not None:
                parts.append(f"rank {rank} (pid {proc.pid}) {_describe_exit(code)}")
        if not parts:
            parts.append(f"a collective failed: {exc}")
        return (
            "tensor-parallel worker "
            + "; ".join(parts)
            + ". The engine cannot continue; start a new one."
        )

    # -- shutdown ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every worker (idempotent). Also runs when this object is collected and at exit."""
        self._finalizer()


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _watchdog(sentinels: list[int], stop: mpc.Connection, pg: Any) -> None:
    ready = mpc.wait([stop, *sentinels])
    if stop in ready:
        return  # shutdown
    log.error("a tensor-parallel worker died: aborting the NCCL communicator")
    try:
        pg.abort()
    except Exception:
        log.exception("aborting the NCCL communicator failed")


def _stop_workers(
    procs: list[Any],
    conns: list[mpc.Connection],
    watch_stop: list[mpc.Connection],
    restore_threads: list[int],
    nccl: list[Any],
) -> None:
    for conn in watch_stop:
        conn.close()
    for n in restore_threads:
        torch.set_num_threads(n)
    for conn in conns:
        try:
            conn.send(("stop",))
        except Exception:
            pass
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            log.warning("tensor-parallel worker pid %s did not stop; killing it", proc.pid)
            proc.kill()
            proc.join(5.0)
    for conn in conns:
        conn.close()
    for pg in nccl:
        # abort, not destroy: destroying a communicator whose collectives were captured in
        # CUDA graphs can hang (pytorch#115388); the workers are gone, nothing is in flight
        try:
            pg.abort()
        except Exception:
            log.exception("aborting the NCCL communicator failed")
    nccl.clear()


def start_tensor_parallel(config: EngineConfig, device: torch.device) -> TensorParallel | None:
    """The workers of the engine, started now (they import while rank 0 loads the model); None
    for tensor_parallel_size 1."""
    tp, spec = config.tensor_parallel_size, config.speculative_config
    if tp == 1:
        return None
    return TensorParallel(tp, device, keep_embedding=spec is not None and spec.method == "eagle3")
