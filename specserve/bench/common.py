"""Helpers shared by the benchmarks: golden continuations, the exact command line for reports,
freeing one engine's device memory before the next, the batch-1 memory roofline."""

from __future__ import annotations

import gc
import hashlib
import random
import shlex
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def golden_continuations(num: int, length: int, high: int, seed: int | str) -> list[list[int]]:
    """`num` random continuations of `length` token ids in [1, high), the same for a given seed.

    Drawn once per request set and shared by every mode of a benchmark, so that speculation
    off, fixed k and auto all emit exactly these tokens: identical work, comparable tok/s."""
    if high < 2:
        raise ValueError(f"token id range [1, {high}) is empty")
    rng = random.Random(f"golden:{seed}")  # a str seed is hashed stably across processes
    return [[rng.randrange(1, high) for _ in range(length)] for _ in range(num)]


def token_id_bound(llm: Any) -> int:
    """Upper bound for synthetic output ids: inside the model's vocabulary and the tokenizer's
    (dummy models pair a 128k-vocab model with a 49k tokenizer; the detokenizer sees these ids)."""
    vocab = int(llm.engine.model_config.vocab_size)
    tok = getattr(llm, "tokenizer", None)
    try:
        return min(vocab, len(tok)) if tok is not None else vocab
    except TypeError:
        return vocab


def model_vocab_size(llm: Any) -> int:
    return int(llm.engine.model_config.vocab_size)


def digest(token_lists: Iterable[list[int]]) -> str:
    """Short fingerprint of a request set's outputs, to compare modes without keeping them."""
    h = hashlib.sha1()
    for toks in token_lists:
        h.update(",".join(map(str, toks)).encode())
        h.update(b";")
    return h.hexdigest()[:16]


def command_line() -> str:
    """The command that ran, for the JSON report: `python -m specserve.cli.main ...` when a
    module of the package was run with -m (argv[0] is then its file), else argv[0]'s file name."""
    argv = list(sys.argv)
    if not argv:
        return ""
    parts = Path(argv[0]).with_suffix("").parts
    if argv[0].endswith(".py") and "specserve" in parts:
        start = len(parts) - 1 - parts[::-1].index("specserve")
        return shlex.join(["python", "-m", ".".join(parts[start:]), *argv[1:]])
    return shlex.join([Path(argv[0]).name, *argv[1:]])


def free_memory() -> None:
    """After `del llm`: collect the engine (it has reference cycles) and return its cached device
    blocks, so the next engine's KV sizing (a share of free memory) sees the whole device. A CUDA
    engine froze what it built (engine/device.py): frozen objects are never collected."""
    gc.unfreeze()
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def memory_roofline(llm: Any, decode_tok_s: float) -> dict[str, float] | None:
    """Batch-1 decode against the memory roofline, measured in this run: every weight byte is
    read once per token, at the device's copy bandwidth (bytes read + written by a 1 GiB
    device-to-device copy, median of 10). None off CUDA."""
    import torch

    eng = getattr(llm, "engine", None)
    if eng is None or eng.device.type != "cuda":
        return None
    weight_bytes = sum(
        t.numel() * t.element_size()
        for t in [*eng.target_model.parameters(), *eng.target_model.buffers()]
    )
    try:
        src = torch.empty(2**30, dtype=torch.uint8, device=eng.device)
        dst = torch.empty_like(src)
    except torch.cuda.OutOfMemoryError:
        return None  # the KV cache took the memory: no roofline rather than no benchmark
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    seconds = statistics.median(times[2:])
    bandwidth = 2 * 2**30 / seconds
    roofline = bandwidth / weight_bytes
    return {
        "weight_bytes": weight_bytes,
        "copy_bandwidth_bytes_s": bandwidth,
        "roofline_tok_s": roofline,
        "decode_tok_s": decode_tok_s,
        "fraction_of_roofline": decode_tok_s / roofline,
    }


def engine_kwargs(
    max_model_len: int | None,
    kv_cache_gb: float | None,
    enforce_eager: bool,
    enable_prefix_caching: bool = True,
) -> dict[str, Any]:
    """Optional LLM() keyword arguments: only what was set, so the engine's defaults apply."""
    kw: dict[str, Any] = {}
    if max_model_len is not None:
        kw["max_model_len"] = max_model_len
    if kv_cache_gb is not None:
        kw["kv_cache_memory_gb"] = kv_cache_gb
    if enforce_eager:
        kw["enforce_eager"] = True
    if not enable_prefix_caching:
        kw["enable_prefix_caching"] = False
    return kw
