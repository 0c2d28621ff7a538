"""Engines at tensor_parallel_size=2 (gloo, one worker process each), shared per module: a
spawn plus the worker's imports cost seconds on CI's 2 cores."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import _TINY

# a Llama whose attention does not split evenly over 2 ranks: 6 query / 3 KV heads (KV 2 + 1,
# query 4 + 2), 101 MLP columns (51 + 50); untied head, SmolLM2's vocabulary and tokenizer
UNEVEN = {
    **_TINY,
    "hidden_size": 96,
    "intermediate_size": 101,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "head_dim": 16,
}
ENGINE = {"dtype": "float32", "device": "cpu", "progress": False, "kv_cache_memory_gb": 0.05}


@pytest.fixture(scope="session")
def uneven_llama_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any) -> Path:
    import torch
    import transformers

    config = transformers.LlamaConfig(**UNEVEN)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(1)
    d = tmp_path_factory.mktemp("uneven_llama")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(str(d))
    default_tokenizer.save_pretrained(str(d))
    return d


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) is gone for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    """The pids still alive after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


def close(llm: Any) -> None:
    """Shut an engine's workers down and check they are gone."""
    tp = llm.engine.tp
    pids = tp.worker_pids if tp else []
    llm.engine.shutdown()
    assert wait_gone(pids) == [], "tensor-parallel workers outlived shutdown()"
