"""Triton KV write and paged attention for CUDA: same semantics as `specserve.ops.attention`.

Safe to import anywhere: triton itself is imported on first use (`use_triton` says whether that
can happen), so CPU-only installs never need it. Kernels live in `specserve.ops.triton_kv`.

No host sync: every per-request length is read by the kernels from the ctx tensors; the host
only uses shapes and the Python ints ctx.max_query_len / ctx.max_context_len.

CUDA graphs. The launch depends on these host values only:
  * tensor shapes: q [T, H, D], the cache, ctx.query_lens [B] (B = requests, incl. padding ones);
  * ctx.max_query_len -> the query-tile grid dimension and the tile config;
  * ctx.max_context_len (bounded by the window, if any) and the grid size -> the split-KV count
    (or pass `num_splits`); the window itself is fixed per layer, so a graph captures it.
So a captured graph must be replayed with the same T and B buffers, and the capture must use
ctx.max_query_len = the bucket's largest query_len (1 for plain decode, 1 + max drafts for
verify) and ctx.max_context_len = a fixed bound (e.g. max_model_len), or an explicit num_splits.
Padding requests in a graph bucket may use query_len 0 (cu_query_lens flat, context_len 0):
their programs exit at once. Rows >= cu_query_lens[B] are padding rows and come back as 0.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass
from types import ModuleType

import torch

from specserve.ops.forward_context import ForwardContext, KVCache
from specserve.ops.pdl import launch_options

# A split-KV chunk shorter than this costs more to merge than it saves.
MIN_KEYS_PER_SPLIT = 128
MAX_SPLITS = 32
# Aim for this many programs per SM before splitting the key range further.
PROGRAMS_PER_SM = 2
# Bytes of shared memory the pipelined K/V tiles may take (H200: 227 KB per block), leaving room
# for the layout conversions tl.dot needs.
SMEM_BUDGET = 128 * 1024

_LOG2E = 1.4426950408889634


@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(device: torch.device | str) -> bool:
    """True when the Triton kernels can run for tensors on `device` (CUDA and triton present)."""
    return torch.device(device).type == "cuda" and _triton_importable()


@functools.lru_cache(maxsize=1)
def _kernels() -> ModuleType:
    from specserve.ops import triton_kv

    return triton_kv


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def write_kv_triton(
    k: torch.Tensor,  # [T, Hkv, D], last dim contiguous
    v: torch.Tensor,  # [T, Hkv, D]
    cache: KVCache,
    slot_mapping: torch.Tensor,  # [T] int64, negative = padding row
) -> None:
    """Scatter each row's K/V into its cache slot (cast to the cache dtype); padding rows skip."""
    t = slot_mapping.shape[0]
    if t == 0:
        return
    hkv, d = cache.k.shape[2], cache.k.shape[3]
    assert k.shape == (t, hkv, d) and v.shape == (t, hkv, d), (k.shape, v.shape, cache.k.shape)
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and cache.k.stride(-1) == 1
    assert cache.v.stride(-1) == 1
    _kernels()._write_kv_kernel[(t,)](
        k, v, cache.k, cache.v, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cache.k.stride(0), cache.k.stride(1), cache.k.stride(2),
        cache.v.stride(0), cache.v.stride(1), cache.v.stride(2),
        NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_H=_pow2(hkv), BLOCK_D=_pow2(d),
        PAGE=cache.block_size, num_warps=4 if hkv * d >= 1024 else 2,
    )  # fmt: skip


@dataclass(frozen=True)
class TileConfig:
    block_q: int  # query positions per program
    block_m: int  # rows per program = block_q * group, padded to a power of two
    block_n: int  # keys per step
    num_warps: int
    num_stages: int


def choose_tile_config(
    max_query_len: int, group: int, head_dim: int, elem_bytes: int = 2, wide_grid: bool = False
) -> TileConfig:
    """Tile shapes from the static bound on rows per request (a Python int: no sync).

    Decode/verify: the tile holds all of a request's rows x all query heads of a KV head, as
    few rows as tl.dot allows (16), since K/V bandwidth, not the MMA, is the limit there.
    Prefill: 128-row tiles (64 at head_dim > 128) so each K/V tile feeds enough math.
    block_n shrinks until the pipelined K+V buffers fit shared memory (fp32, head_dim 256).
    wide_grid: the requests x KV heads fill the GPU without splitting the keys (grid_is_wide).
    """
    want = max(1, max_query_len) * group
    cap = 128 if head_dim <= 128 else 64
    block_m = min(max(16, _pow2(want)), max(cap, _pow2(group)))
    block_q = max(1, block_m // group)
    if block_m <= 16 and wide_grid:
        # Decode over many requests: many small programs per SM beat fewer big ones (H200, 8B
        # heads, in CUDA graphs: batch 64 at 300-500 keys 42.3 vs
        # 45.0 us, at 3-4k keys 227 vs 234; batch 256 at 300-500 keys 118.5 vs 126.5).
        block_n, warps, stages = 64, 2, 2
    elif block_m <= 16:
        # Decode over few requests (the keys split across programs): 128-key steps keep more
        # bytes in flight (batch 1 and 16, the same sweep; earlier, batch 64 x 4k: 262 µs vs
        # 337 µs at 64 keys x 3 stages and 4 warps).
        block_n, warps, stages = 128, 4, 2
    elif block_m <= 64:
        block_n, warps, stages = 64, 4, 3
    else:
        block_n, warps, stages = 64, 8, 2
    while block_n > 16 and 2 * stages * block_n * _pow2(head_dim) * elem_bytes > SMEM_BUDGET:
        block_n //= 2
    return TileConfig(block_q, block_m, block_n, warps, stages)


def _target_programs(device: torch.device) -> int:
    # Off CUDA (Triton's CPU interpreter, for tests) assume an H200's 132 SMs.
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 132
    return PROGRAMS_PER_SM * sms


def grid_is_wide(num_programs: int, device: torch.device) -> bool:
    """Does a grid of this many (query tile, request, KV head) programs fill the GPU unsplit?"""
    return num_programs >= _target_programs(device)


def choose_num_splits(num_programs: int, max_context_len: int, device: torch.device) -> int:
    """Split the key range only when the grid leaves SMs idle (small batch, long context)."""
    target = _target_programs(device)
    if num_programs >= target:
        return 1
    by_occupancy = math.ceil(target / num_programs)
    by_length = max(1, max_context_len // MIN_KEYS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def key_bound(max_context_len: int, window: int, block_q: int) -> int:
    """Most keys one query tile reads: a windowed tile's block_q rows see at most
    window + block_q - 1 keys, however long the context."""
    return min(max_context_len, window + block_q - 1) if window else max_context_len


# Split-KV tile counters per device. They are zero between launches (the last program of each
# tile resets its own), so a launch never clears them. They only grow: a CUDA graph keeps the
# address it captured, so every buffer handed out stays alive.
_counters: dict[torch.device, list[torch.Tensor]] = {}


def _split_counters(n: int, device: torch.device) -> torch.Tensor:  # [>= n] int32
    bufs = _counters.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 1024), device=device, dtype=torch.int32))
    return bufs[-1]


def paged_attention_triton(
    q: torch.Tensor,  # [T, H, D], last dim contiguous
    cache: KVCache,
    ctx: ForwardContext,
    scale: float,
    *,
    window: int = 0,
    num_splits: int | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:  # [T, H, D] in q's dtype
    """Causal attention of each request's rows over its paged context, GQA (H % Hkv == 0);
    `window` > 0: each row sees only its `window` newest positions (sliding window).

    Same contract as `specserve.ops.attention.paged_attention`; rows past the last request
    come back as zeros. `num_splits` / `config` override the heuristics (tests, benchmarks,
    CUDA graph capture).
    """
    t, h, d = q.shape
    _, page, hkv, dk = cache.k.shape
    assert dk == d and h % hkv == 0, (q.shape, cache.k.shape)
    assert q.stride(-1) == 1 and cache.k.stride(-1) == 1 and cache.v.stride(-1) == 1
    out = torch.empty_like(q)
    b = ctx.num_requests
    if t == 0:
        return out
    if b == 0:
        return out.zero_()
    group = h // hkv
    cfg = config or choose_tile_config(
        ctx.max_query_len, group, d, cache.k.element_size(), grid_is_wide(b * hkv, q.device)
    )
    num_tiles = max(1, math.ceil(ctx.max_query_len / cfg.block_q))
    max_keys = key_bound(ctx.max_context_len, window, cfg.block_q)
    splits = num_splits or choose_num_splits(num_tiles * b * hkv, max_keys, q.device)
    if splits > 1:
        o_part = torch.empty(splits, t, h, d, device=q.device, dtype=torch.float32)
        lse_part = torch.empty(splits, t, h, device=q.device, dtype=torch.float32)
        counters = _split_counters(num_tiles * b * hkv, q.device)
    else:
        o_part = lse_part = counters = out  # unused by the kernel when splits == 1
    fp32 = cache.k.dtype == torch.float32
    _kernels()._paged_attention_kernel[(num_tiles * splits, b, hkv)](
        q, cache.k, cache.v, out, o_part, lse_part, counters,
        ctx.query_lens, ctx.cu_query_lens, ctx.context_lens, ctx.block_tables,
        b, t, h, scale * _LOG2E, window, splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.k.stride(0), cache.k.stride(1), cache.k.stride(2),
        cache.v.stride(0), cache.v.stride(1), cache.v.stride(2),
        ctx.block_tables.stride(0),
        GROUP=group, HEAD_DIM=d, HEAD_DIM_P2=_pow2(d), PAGE=page,
        BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT=splits > 1,
        SLIDING=window > 0,
        # fp32 caches get true fp32 products (tf32 would cost ~3e-4 relative error)
        DOT_PRECISION="ieee" if fp32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(q),
    )  # fmt: skip
    return out
