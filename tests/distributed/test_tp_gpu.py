"""tensor_parallel_size=2 on two GPUs (NCCL, all-reduces inside the decode CUDA graphs, overlap
scheduling on by default): skipped unless 2 CUDA devices are visible. fp32 on the tiny uneven-
heads model, whose random logits are far apart, so greedy outputs must match exactly."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.distributed import TensorParallelError
from tests.distributed.conftest import close, wait_gone

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]
GPU = {"dtype": "float32", "device": "cuda", "progress": False, "kv_cache_memory_gb": 0.1}
PROMPTS = [
    "The capital of France is",
    "one two three one two three one two three one two",
    "Once upon a time, in a small village,",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def ref(uneven_llama_dir: Path) -> list[list[int]]:
    llm = LLM(str(uneven_llama_dir), **GPU)
    out = _tokens(llm)
    del llm
    return out


@pytest.mark.parametrize(
    "kw",
    [
        {},  # CUDA graphs + overlap
        {"enforce_eager": True, "overlap": False},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    ],
    ids=["graphs_overlap", "eager_sync", "ngram"],
)
def test_greedy_equal_tp1_on_two_gpus(uneven_llama_dir: Path, ref, kw: dict) -> None:
    llm = LLM(str(uneven_llama_dir), tensor_parallel_size=2, **GPU, **kw)
    try:
        assert llm.engine.runner.kv_caches[0].k.device == torch.device("cuda", 0)
        assert _tokens(llm) == ref
    finally:
        close(llm)


def test_killed_gpu_worker_is_a_clear_error(uneven_llama_dir: Path) -> None:
    llm = LLM(str(uneven_llama_dir), tensor_parallel_size=2, **GPU)
    try:
        (pid,) = llm.engine.tp.worker_pids
        params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
        seen = 0
        with pytest.raises(TensorParallelError, match=f"pid {pid}"):
            for _ in llm.stream(["hello"], params):
                seen += 1
                if seen == 8:
                    os.kill(pid, signal.SIGKILL)
                    t0 = time.monotonic()
        assert time.monotonic() - t0 < 60  # the watchdog aborts NCCL: no wait for its timeout
        assert wait_gone([pid]) == []
    finally:
        close(llm)
