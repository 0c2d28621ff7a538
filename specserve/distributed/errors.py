"""The one error tensor parallelism raises on rank 0 when the engine cannot go on."""

from __future__ import annotations


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died or failed: the engine's ranks no longer agree on any state,
    so the engine ends (no request is retried or isolated). The message names the rank, its
    process and why it ended; a new engine is the only way on."""
