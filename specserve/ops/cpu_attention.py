"""Compiled paged attention for the CPU: reads the paged KV cache in place, no gather per step.

The torch path in attention.py copies every request's (padded) context out of the cache before
SDPA, in every layer: at 64 decode requests that copy is most of the attention time. The kernel
in cpu_attention.cpp walks each request's block table instead, with an online softmax, for
decode, verify and prefill rows alike (GQA, sliding window, padding rows -> zeros).

Built on first use by ops/cpu_build.py (the system C++ compiler, cached per source and CPU,
loaded with ctypes). No compiler, or a failed build: one warning, and attention.py keeps its
torch path.
$SPECSERVE_CPU_ATTENTION: auto (default: kernel if it builds), kernel (fail if it does not),
torch (never build it).
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import threading
from pathlib import Path

import torch

from specserve import env
from specserve.ops import cpu_build
from specserve.ops.forward_context import ForwardContext, KVCache

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_attention.cpp")
_ABI_VERSION = 1
_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class Args(ctypes.Structure):
    """Mirror of `SpecserveAttentionArgs` (cpu_attention_args.h: same order, same widths)."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("q_row_stride", ctypes.c_int64),
        ("q_head_stride", ctypes.c_int64),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("bt_stride", ctypes.c_int64),
        ("q_lens", ctypes.c_void_p),
        ("ctx_lens", ctypes.c_void_p),
        ("starts", ctypes.c_void_p),
        ("num_reqs", ctypes.c_int32),
        ("num_rows", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("window", ctypes.c_int32),
        ("num_threads", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("out", ctypes.c_void_p),
    ]


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _load() -> ctypes.CDLL:
    lib = cpu_build.load(_SOURCE)
    if lib.specserve_cpu_attention_version() != _ABI_VERSION:
        raise RuntimeError("cpu_attention library has a different ABI version")
    lib.specserve_cpu_attention.argtypes = [ctypes.POINTER(Args), ctypes.c_int]
    lib.specserve_cpu_attention.restype = ctypes.c_int
    return lib


def kernel() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first call; None when the torch path is to be used."""
    global _lib, _tried
    mode = env.settings.cpu_attention
    if mode == "torch":
        return None
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    _lib = _load()
                except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                    if mode == "kernel":
                        raise RuntimeError(
                            f"SPECSERVE_CPU_ATTENTION=kernel but the kernel is unavailable: {e}"
                        ) from e
                    logger.warning(
                        "CPU attention kernel unavailable, using the torch path: %s",
                        str(e).splitlines()[0],
                    )
                _tried = True
    return _lib


def supports(q: torch.Tensor, cache: KVCache) -> bool:
    """Whether the kernel can serve this call (else the torch path does)."""
    return (
        q.device.type == "cpu"
        and cache.k.dtype in _KV_DTYPES
        and cache.v.dtype == cache.k.dtype
        and cache.k.is_contiguous()
        and cache.v.is_contiguous()
        and q.dim() == 3
        and q.shape[1] % cache.k.shape[2] == 0
    )


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


def attention_meta(
    ctx: ForwardContext,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """int32 copies of query_lens [B], context_lens [B], cu_query_lens [B + 1] and block_tables
    [B, max_blocks], made once per forward (cached on ctx) and shared by every layer."""
    meta = ctx.__dict__.get("_cpu_attention_meta")
    if meta is None:
        meta = (
            _int32(ctx.query_lens),
            _int32(ctx.context_lens),
            _int32(ctx.cu_query_lens),
            _int32(ctx.block_tables),
        )
        ctx.__dict__["_cpu_attention_meta"] = meta
    return meta


def paged_attention_cpu(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [T, H, D]
    cache: KVCache,
    ctx: ForwardContext,
    scale: float,
    window: int = 0,
) -> torch.Tensor:  # [T, H, D], q's dtype
    """attention.paged_attention's contract, computed by the compiled kernel (fp32 math)."""
    t, h, d = q.shape
    qf = q if q.dtype == torch.float32 else q.float()
    if qf.stride(2) != 1:
        qf = qf.contiguous()
    out = torch.empty(t, h, d, dtype=torch.float32)
    q_lens, c_lens, starts, tables = attention_meta(ctx)
    args = Args(
        qf.data_ptr(),
        qf.stride(0),
        qf.stride(1),
        cache.k.data_ptr(),
        cache.v.data_ptr(),
        tables.data_ptr(),
        tables.stride(0),
        q_lens.data_ptr(),
        c_lens.data_ptr(),
        starts.data_ptr(),
        q_lens.shape[0],
        t,
        h,
        cache.k.shape[2],
        d,
        cache.block_size,
        window,
        torch.get_num_threads(),
        scale,
        out.data_ptr(),
    )
    if lib.specserve_cpu_attention(ctypes.byref(args), _KV_DTYPES[cache.k.dtype]) != 0:
        raise RuntimeError(f"cpu attention kernel refused KV dtype {cache.k.dtype}")
    return out if q.dtype == torch.float32 else out.to(q.dtype)
