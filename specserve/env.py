"""Every SPECSERVE_* environment variable, read once, in one place.

The process reads them when this module is first imported; code asks `env.settings`, never
`os.environ`. Tests and benchmarks change a switch for a block with `env.override(...)`, which
restores the previous values on exit:

    with env.override(gemv=False):
        ...

| variable | default | meaning |
|---|---|---|
| SPECSERVE_CACHE | ~/.cache/specserve | default model, converted GGUF weights, datasets, step-cost curves |
| SPECSERVE_TOKENIZER | (none) | tokenizer directory for `dummy:` models (else the default model's) |
| SPECSERVE_API_KEY | (none) | `specserve serve`'s default `--api-key` |
| SPECSERVE_GEMV | 1 | one-row Triton GEMV for the decoder linears on CUDA (0: cuBLAS) |
| SPECSERVE_GEMV_ROWS | 1 | 2 to 16 rows (batch-1 verify steps, small-batch decode) take the Triton rows kernel, one weight read under PDL (0: cuBLAS past one row; ops/gemv.py) |
| SPECSERVE_GEMV_WHOLE_K | 1 | a one-row GEMV over K <= 4096 reads its whole weight slice before waiting on the previous kernel, unsplit (ops/gemv.py) |
| SPECSERVE_GEMV_EPILOGUES | 1 | with the GEMV and the fused ops, a one-row gate_up projection also runs silu-and-mul in its epilogue (ops/gemv.py) |
| SPECSERVE_FUSED_OPS | 1 | fused add+RMSNorm, rotary + KV write, silu-and-mul: Triton on CUDA, compiled C++ on the CPU (ops/cpu_fused.py, with the greedy argmax) |
| SPECSERVE_PDL | 1 | programmatic dependent launch on Hopper |
| SPECSERVE_FUSED_VERIFY | 1 | fused Triton sample-and-verify pass on CUDA |
| SPECSERVE_GRAPH_TAIL | 1 | decode/verify steps of the common shape sample inside their bucket's CUDA graph, golden device drafting included (runner/graph_tail.py; needs the fused verify) |
| SPECSERVE_MIXED_GRAPHS | 1 | steps with a prompt chunk (up to 2048 rows) run as CUDA graphs of mixed buckets (runner/cuda_graph.py), and a model drafter's catch-ups over any rows as graphs of rows buckets (speculative/catch_up_graphs.py); 0: both eagerly |
| SPECSERVE_TP_TIMEOUT | 300 | seconds a tensor-parallel rank waits in one collective or at start-up (a dead worker is found at once; this bounds a stuck one) |
| SPECSERVE_DEVICE_DRAFTS | 1 | with overlap, drafters draft inside the step on the device (0: on the host) |
| SPECSERVE_DEVICE_SPLIT | 1 | with the verify budget, a device-drafted step sampling in its graph tail has only its total rows fixed on the host; the device shares them among its requests by the newest confidences (runner/device_split.py; 0: the host fixes each request's rows) |
| SPECSERVE_CPU_ATTENTION | auto | CPU paged attention: auto = compiled kernel (ops/cpu_attention.py) when it builds, else the torch path with one warning; kernel = fail if it does not build; torch = the torch path |
| SPECSERVE_CPU_LINEAR | auto | CPU fp32 linear layers (model/cpu_linear.py): auto = a GGUF's Q4_1 / Q8_0 blocks kept as integer blocks (ops/cpu_qgemm.py, 1 byte a weight, fp32-grade products) where the CPU has AVX512-VNNI (int8 weights too: model/quant.py), else weights packed once at load into panels; panels = always the panels (int8 on torch's kernels); torch = F.linear |
| SPECSERVE_CPU_AMX | auto | integer-block GEMMs: auto = AMX tiles for chunks of 16 rows where the CPU and kernel grant them (the same bits as the vector path); off = vectors only |
| SPECSERVE_CPU_LAYER | auto | CPU decoder layers: auto = all layers of a forward in one compiled call (model/cpu_stack.py) where it applies (fp32, panel GEMMs, compiled fused ops and attention), bit-identical to the per-op path; off = one call per op |
| SPECSERVE_INT4_HEAD | auto | lm_head under quantization="int4": auto = int4 where the GGUF stores it (or the tied embedding) as Q4_1, else int8 per channel (4 bits re-quantized from 8 cost the default model ~9 points of greedy agreement); int4 / int8 = always that |
| SPECSERVE_GRAMMAR_MASK_OP | auto | how grammar bitmasks reach the logits: auto = xgrammar's Triton kernel on CUDA (the torch path where it cannot be built), a byte-table gather and add elsewhere; torch = that torch path everywhere |
| SPECSERVE_CPU_THREADS | keep | intra-op threads of a CPU engine: keep = torch's own (one per core), auto = cores - 1 (one left to the host loop: faster where other processes share the cores), or a count |
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path


def _flag(environ: Mapping[str, str], name: str, default: str = "1") -> bool:
    return environ.get(name, default) != "0"


def _choice(environ: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    value = environ.get(name) or choices[0]
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


@dataclass
class Settings:
    cache_dir: Path
    tokenizer: str | None
    api_key: str | None
    gemv: bool
    gemv_epilogues: bool
    gemv_rows: bool
    gemv_whole_k: bool
    fused_ops: bool
    pdl: bool
    fused_verify: bool
    graph_tail: bool
    mixed_graphs: bool
    tp_timeout: float
    device_drafts: bool
    device_split: bool
    cpu_threads: str  # "auto" | "keep" | a count (engine/cpu_threads.py)
    cpu_attention: str  # "auto" | "kernel" | "torch" (ops/cpu_attention.py)
    cpu_linear: str  # "auto" | "panels" | "torch" (model/cpu_linear.py)
    cpu_amx: str  # "auto" | "off" (ops/cpu_qgemm.py)
    cpu_layer: str  # "auto" | "off" (model/cpu_stack.py)
    int4_head: str  # "auto" | "int4" | "int8" (model/quant_int4.py)
    grammar_mask_op: str  # "auto" | "torch" (ops/logits_processing.py)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings:
        cache = environ.get("SPECSERVE_CACHE") or str(Path.home() / ".cache" / "specserve")
        return cls(
            cache_dir=Path(cache),
            tokenizer=environ.get("SPECSERVE_TOKENIZER") or None,
            api_key=environ.get("SPECSERVE_API_KEY") or None,
            gemv=_flag(environ, "SPECSERVE_GEMV"),
            gemv_epilogues=_flag(environ, "SPECSERVE_GEMV_EPILOGUES"),
            gemv_rows=_flag(environ, "SPECSERVE_GEMV_ROWS"),
            gemv_whole_k=_flag(environ, "SPECSERVE_GEMV_WHOLE_K"),
            fused_ops=_flag(environ, "SPECSERVE_FUSED_OPS"),
            pdl=_flag(environ, "SPECSERVE_PDL"),
            fused_verify=_flag(environ, "SPECSERVE_FUSED_VERIFY"),
            graph_tail=_flag(environ, "SPECSERVE_GRAPH_TAIL"),
            mixed_graphs=_flag(environ, "SPECSERVE_MIXED_GRAPHS"),
            tp_timeout=float(environ.get("SPECSERVE_TP_TIMEOUT") or 300),
            device_drafts=_flag(environ, "SPECSERVE_DEVICE_DRAFTS"),
            device_split=_flag(environ, "SPECSERVE_DEVICE_SPLIT"),
            cpu_threads=environ.get("SPECSERVE_CPU_THREADS") or "keep",
            cpu_attention=_choice(environ, "SPECSERVE_CPU_ATTENTION", ("auto", "kernel", "torch")),
            cpu_linear=_choice(environ, "SPECSERVE_CPU_LINEAR", ("auto", "panels", "torch")),
            cpu_amx=_choice(environ, "SPECSERVE_CPU_AMX", ("auto", "off")),
            cpu_layer=_choice(environ, "SPECSERVE_CPU_LAYER", ("auto", "off")),
            int4_head=_choice(environ, "SPECSERVE_INT4_HEAD", ("auto", "int4", "int8")),
            grammar_mask_op=_choice(environ, "SPECSERVE_GRAMMAR_MASK_OP", ("auto", "torch")),
        )


settings = Settings.from_environ(os.environ)


@contextlib.contextmanager
def override(**changes: object) -> Iterator[Settings]:
    """Change some settings for the duration of a block (unknown names raise TypeError)."""
    global settings
    before = settings
    settings = dataclasses.replace(before, **changes)
    try:
        yield settings
    finally:
        settings = before
