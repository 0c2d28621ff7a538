"""Tensor parallelism over torch.distributed: rank 0 is the engine, ranks 1.. its workers.

plan.py      which heads / columns / vocabulary rows each rank holds (uneven sizes included)
group.py     the process group (gloo on CPU, NCCL on CUDA) and its collectives
layers.py    row-parallel linear, vocabulary-parallel embedding, sharding a loaded model
runner.py    rank 0's runner (each forward replayed by the workers) and the step message
worker.py    a worker process's loop
launcher.py  rank 0: spawn, shard, watch, stop the workers
"""

from specserve.distributed.errors import TensorParallelError
from specserve.distributed.launcher import TensorParallel, start_tensor_parallel

__all__ = ["TensorParallel", "TensorParallelError", "start_tensor_parallel"]
