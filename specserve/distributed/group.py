"""The collectives of one tensor-parallel engine: gloo between CPU ranks, NCCL between GPUs.

A standalone process group (not torch.distributed's global default one), so an engine never
touches a group its host program made for itself, and several engines can come and go in one
process. Rank 0 hosts the rendezvous store on a free local port; the workers it spawns connect
to it. Collectives are issued in the same order on every rank (the workers replay rank 0's
steps), and every rank gets the full result (all-reduce, all-gather), so no rank waits for a
host round trip. A collective that fails (gloo notices a closed peer at once) is handed to
`on_failure`, which rank 0 uses to say which worker ended and why.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def make_store(rank: int, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0 passes port 0 and hosts the store on a free port (`store.port`)."""
    return dist.TCPStore(
        "127.0.0.1",
        port,
        world_size,
        rank == 0,
        datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


@dataclass
class TPGroup:
    rank: int
    world_size: int
    pg: Any  # ProcessGroupGloo | ProcessGroupNCCL
    # rank 0: turns a failed collective into the error to raise (names the dead worker)
    on_failure: Callable[[BaseException], BaseException] | None = None

    @staticmethod
    def create(
        store: dist.Store, rank: int, world_size: int, device: torch.device, timeout_s: float
    ) -> TPGroup:
        """Blocks until every rank has called it (the rendezvous)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.PrefixStore("specserve-tp", store)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            # loopback explicitly: the default device resolves the host name, which may not
            # resolve in containers; all ranks of an engine live on this host
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            pg = dist.ProcessGroupGloo(store, rank, world_size, opts)
        group = TPGroup(rank, world_size, pg)
        # connect now (NCCL creates its communicator lazily): never inside a graph capture
        group.all_reduce(torch.zeros(1, device=device))
        return group

    def _wait(self, work: Any) -> None:
        try:
            work.wait()
        except Exception as e:
            if self.on_failure is None:
                raise
            raise self.on_failure(e) from e

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (x must be contiguous); returns x."""
        self._wait(self.pg.allreduce([x]))
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._wait(self.pg.broadcast(x, src))
        return x

    def gather_vocab(
        self,
        x: torch.Tensor,  # [N, Vp] this rank's vocabulary shard of the logits
        vocab_size: int,
    ) -> torch.Tensor:  # [N, V] every rank's shard side by side, padding trimmed
        n, part = x.shape
        out = x.new_empty((self.world_size * n, part))  # [tp * N, Vp], rank-major
        self._wait(self.pg._allgather_base(out, x.contiguous()))
        full = out.view(self.world_size, n, part).permute(1, 0, 2).reshape(n, -1)
        return full[:, :vocab_size] if full.shape[1] != vocab_size else full
