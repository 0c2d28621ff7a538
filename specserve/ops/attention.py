"""Reference paged attention in plain torch: the CPU path, and the oracle for GPU kernels.

Layout (see ForwardContext): the flat batch holds each request's rows back to back; row j of
request i is KV position context_lens[i] - query_lens[i] + j, and sees positions <= itself; with
a sliding window W > 0 only the W newest of them (p - W < key <= p, HF's mask). Keys older than
every row's window are never gathered, so their blocks may hold anything (freed and reused).

On the CPU the compiled kernel of cpu_attention.py serves every call it supports (fp32 / bf16 KV)
and reads the cache in place; the torch path below is its fallback and the test oracle.

Torch strategy, chosen for a small CPU where every op costs host time:
  * requests with few rows (decode: 1, verify: 1 + drafts) go through ONE padded gather + SDPA;
  * requests with long rows (prefill chunks) run one SDPA each, padding them would waste work;
  * the gather indices and masks depend only on the context and the window, so they are built
    once per forward and window and reused by every layer (cached on the ctx object).
Shapes come from the host lists on ctx, so nothing here waits on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specserve.ops import cpu_attention
from specserve.ops.forward_context import ForwardContext, KVCache
from specserve.ops.triton_attention import paged_attention_triton, use_triton, write_kv_triton

# Requests with at most this many query rows are batched into the padded path. Above it a
# request's own SDPA is cheaper than padding every short request up to its length.
SHORT_QUERY_MAX = 16

_PLAN_ATTR = "_torch_attention_plan"


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cache: KVCache,
    slot_mapping: torch.Tensor,  # [T] int64, negative = padding row
    all_valid: bool | None = None,
) -> None:
    """Scatter the rows' K/V into their cache slots; padding rows write nothing.

    `all_valid=True` lets a caller that already knows there is no padding skip the check (the
    model computes it once per forward instead of once per layer).
    """
    if slot_mapping.numel() == 0:
        return
    if use_triton(k.device):
        return write_kv_triton(k, v, cache, slot_mapping)
    num_kv_heads, head_dim = cache.k.shape[2], cache.k.shape[3]
    k_flat = cache.k.view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
    v_flat = cache.v.view(-1, num_kv_heads, head_dim)
    if all_valid is None:
        all_valid = slots_all_valid(slot_mapping)
    if all_valid:
        k_flat.index_copy_(0, slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, slot_mapping, v.to(v_flat.dtype))
        return
    if slot_mapping.device.type == "cpu":
        # Reading the mask on CPU costs no device sync.
        keep = slot_mapping >= 0
        k_flat.index_copy_(0, slot_mapping[keep], k[keep].to(k_flat.dtype))
        v_flat.index_copy_(0, slot_mapping[keep], v[keep].to(v_flat.dtype))
        return
    _write_kv_sync_free(k, v, k_flat, v_flat, slot_mapping)


def _write_kv_sync_free(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    k_flat: torch.Tensor,  # [num_slots, Hkv, D]
    v_flat: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    """Masked write without reading the mask on the host (no device sync).

    Padding rows repeat the write of the first real row (same slot, same value), so the duplicate
    index is harmless; with no real row at all they rewrite slot 0 with its own value.
    """
    # Tensor indices throughout: indexing with a 0-d tensor would read it on the host.
    keep = slot_mapping >= 0  # [T]
    first = torch.argmax(keep.to(torch.int8)).view(1)  # [1] first real row, or 0 if none
    has_real = keep.index_select(0, first).view(1, 1, 1)
    slot = torch.where(keep, slot_mapping, slot_mapping.index_select(0, first).clamp_min(0))
    for src, dst in ((k, k_flat), (v, v_flat)):
        src = src.to(dst.dtype)
        fill = torch.where(has_real, src.index_select(0, first), dst[:1])  # [1, Hkv, D]
        dst.index_copy_(0, slot, torch.where(keep[:, None, None], src, fill))


def slots_all_valid(slot_mapping: torch.Tensor) -> bool:
    """True when no row is padding. Free on CPU; on a device it would sync, so say False."""
    if slot_mapping.device.type != "cpu":
        return False
    return bool((slot_mapping >= 0).all()) if slot_mapping.numel() else True


@dataclass
class _ShortGroup:
    """Requests with few rows, padded to [B, Qm] queries and [B, Lm] keys: request i's keys are
    positions [lo_i, lo_i + Lm), lo_i = 0 without a window."""

    num_reqs: int
    max_q: int
    q_index: torch.Tensor | None  # [B * Qm] rows of q to gather; None = q[:B*Qm] as is
    kv_slots: torch.Tensor  # [B * Lm] cache slots; positions past a context repeat its lo_i
    max_kv: int
    mask: torch.Tensor | None  # [B, 1, Qm, Lm] bool, True = attend; None = attend to all
    out_src: torch.Tensor | None  # [N] rows of the padded output that are real
    out_dst: torch.Tensor | None  # [N] where they go in the flat output; None = identity
    # mask with each row repeated G times (GQA folding), built on first use, shared by layers
    folded_masks: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class _LongRequest:
    """One request with many rows: its own SDPA over its whole context."""

    row_start: int
    row_end: int
    kv_slots: torch.Tensor  # [context_len - lo] cache slots of positions [lo, context_len)
    mask: torch.Tensor | None  # [query_len, context_len - lo] bool; None = square causal


@dataclass
class _Plan:
    num_rows: int  # rows that belong to a request; rows after them are padding
    short: list[_ShortGroup]
    long: list[_LongRequest]


def _host_lens(ctx: ForwardContext) -> tuple[list[int], list[int]]:
    q = ctx.query_lens_cpu if ctx.query_lens_cpu is not None else ctx.query_lens.tolist()
    c = ctx.context_lens_cpu if ctx.context_lens_cpu is not None else ctx.context_lens.tolist()
    return q, c


def _slots_for(
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    positions: torch.Tensor,  # [B, L] int64
    block_size: int,
) -> torch.Tensor:  # [B, L] int64
    blocks = block_tables.gather(1, positions // block_size).long()
    return blocks * block_size + positions % block_size


def _first_key(q_len: int, c_len: int, window: int) -> int:
    """Oldest position any of the request's rows sees: its first row's window start."""
    return max(0, c_len - q_len - window + 1) if window else 0


def _to_device(lists: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """All of a plan's host-built index lists in ONE copy, pinned and async: no device sync."""
    flat = torch.tensor([x for xs in lists for x in xs], dtype=torch.long)
    if device.type != "cpu":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return list(flat.split([len(xs) for xs in lists]))


def _short_group(
    short_ids: list[int],
    q_lens: list[int],
    c_lens: list[int],
    starts: list[int],
    block_tables: torch.Tensor,
    block_size: int,
    window: int,
    device: torch.device,
) -> _ShortGroup:
    b = len(short_ids)
    qm = max(q_lens[i] for i in short_ids)
    sq = [q_lens[i] for i in short_ids]
    sc = [c_lens[i] for i in short_ids]
    lo = [_first_key(q_lens[i], c_lens[i], window) for i in short_ids]
    spans = [c - first for c, first in zip(sc, lo)]
    lm = max(spans)
    uniform = all(q == qm for q in sq)
    contiguous = all(starts[i] == n * qm for n, i in enumerate(short_ids))
    as_is = uniform and contiguous

    # Padded (request, j) pairs gather the last real row of their request; outputs dropped.
    q_rows, src, dst = [], [], []
    if not as_is:
        for n, i in enumerate(short_ids):
            for j in range(qm):
                q_rows.append(starts[i] + min(j, q_lens[i] - 1))
                if j < q_lens[i]:
                    src.append(n * qm + j)
                    dst.append(starts[i] + j)
    ids, ctx_len, q_len, first, q_index, out_src, out_dst = _to_device(
        [short_ids, sc, sq, lo, q_rows, src, dst], device
    )
    if as_is:
        q_index = out_src = out_dst = None
    pos = first[:, None] + torch.arange(lm, device=device)[None, :]  # [B, Lm] key positions
    # Keys past a request's context repeat its first key: always written, so never garbage
    # (NaN in unwritten cache memory would poison the masked product).
    pos = torch.where(pos < ctx_len[:, None], pos, first[:, None])
    slots = _slots_for(block_tables[ids], pos, block_size)  # [B, Lm]

    mask = None
    # One row per request that sees exactly its Lm keys (with a window: the last W) needs none.
    single_full = all(q == 1 for q in sq) and all(n == lm for n in spans)
    if not single_full:
        j = torch.arange(qm, device=device)
        # Padded rows (j >= q_len) act as the last real row: finite softmax, output dropped.
        q_pos = ctx_len[:, None] - q_len[:, None] + torch.minimum(j[None, :], q_len[:, None] - 1)
        k_pos = first[:, None] + torch.arange(lm, device=device)[None, :]  # [B, Lm] unclamped
        mask = k_pos[:, None, :] <= q_pos[:, :, None]  # [B, Qm, Lm]
        if window:
            mask &= k_pos[:, None, :] > q_pos[:, :, None] - window
        mask = mask[:, None]  # [B, 1, Qm, Lm]
    return _ShortGroup(b, qm, q_index, slots.reshape(-1), lm, mask, out_src, out_dst)


def _group_by_context(ids: list[int], c_lens: list[int]) -> list[list[int]]:
    """Split requests (kept in row order inside a group) into groups whose longest context is
    at most 1.5x + 64 their shortest one."""
    if not ids:
        return []
    by_len = sorted(ids, key=lambda i: c_lens[i], reverse=True)
    groups: list[list[int]] = [[by_len[0]]]
    for i in by_len[1:]:
        if c_lens[groups[-1][0]] > 1.5 * c_lens[i] + 64:
            groups.append([])
        groups[-1].append(i)
    return [sorted(g) for g in groups]


def _build_plan(ctx: ForwardContext, block_size: int, window: int, device: torch.device) -> _Plan:
    q_lens, c_lens = _host_lens(ctx)
    starts = [0] * len(q_lens)
    for i in range(1, len(q_lens)):
        starts[i] = starts[i - 1] + q_lens[i - 1]
    num_rows = sum(q_lens)
    short_ids = [i for i, q in enumerate(q_lens) if q <= SHORT_QUERY_MAX]
    long_ids = [i for i, q in enumerate(q_lens) if q > SHORT_QUERY_MAX]
    block_tables = ctx.block_tables

    long: list[_LongRequest] = []
    for i in long_ids:
        q_len, c_len = q_lens[i], c_lens[i]
        lo = _first_key(q_len, c_len, window)
        pos = torch.arange(lo, c_len, device=device)
        slots = _slots_for(block_tables[i : i + 1], pos[None], block_size)[0]
        mask = None
        if q_len != c_len - lo or window:
            # Row j is position c_len - q_len + j and sees keys up to it (and within the window).
            q_pos = torch.arange(c_len - q_len, c_len, device=device)[:, None]
            mask = pos[None, :] <= q_pos
            if window:
                mask &= pos[None, :] > q_pos - window
        long.append(_LongRequest(starts[i], starts[i] + q_len, slots, mask))

    # requests of similar key spans share a padded group: padding every decode row to the
    # longest context of a mixed batch would read (and copy) far more KV than exists
    spans = [c - _first_key(q, c, window) for q, c in zip(q_lens, c_lens)]
    short = [
        _short_group(g, q_lens, c_lens, starts, block_tables, block_size, window, device)
        for g in _group_by_context(short_ids, spans)
    ]
    return _Plan(num_rows, short, long)


def _get_plan(ctx: ForwardContext, block_size: int, window: int, device: torch.device) -> _Plan:
    plans = ctx.__dict__.setdefault(_PLAN_ATTR, {})  # window -> plan
    plan = plans.get(window)
    if plan is None:
        plan = _build_plan(ctx, block_size, window, device)
        plans[window] = plan
    return plan


def _gather_kv(
    cache: KVCache, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:  # 2x [N, Hkv, D]
    hkv, d = cache.k.shape[2], cache.k.shape[3]
    k = cache.k.view(-1, hkv, d).index_select(0, slots)
    v = cache.v.view(-1, hkv, d).index_select(0, slots)
    return k, v


def _run_short(
    q: torch.Tensor, cache: KVCache, g: _ShortGroup, scale: float
) -> torch.Tensor:  # [B * Qm, H, D]
    _, h, d = q.shape
    hkv = cache.k.shape[2]
    group = h // hkv
    b, qm, lm = g.num_reqs, g.max_q, g.max_kv
    qs = q[: b * qm] if g.q_index is None else q.index_select(0, g.q_index)  # [B*Qm, H, D]
    k, v = _gather_kv(cache, g.kv_slots)  # [B*Lm, Hkv, D]
    k = k.view(b, lm, hkv, d).transpose(1, 2)  # [B, Hkv, Lm, D]
    v = v.view(b, lm, hkv, d).transpose(1, 2)
    # GQA without copying K/V per query head: fold the query heads of one KV head into the query
    # axis, so rows are (j, g) pairs -> [B, Hkv, Qm * G, D] against [B, Hkv, Lm, D].
    qs = qs.view(b, qm, hkv, group, d).transpose(1, 2).reshape(b, hkv, qm * group, d)
    mask = g.mask
    if mask is not None and group > 1:
        folded = g.folded_masks.get(group)
        if folded is None:
            folded = mask.repeat_interleave(group, dim=2)  # [B, 1, Qm * G, Lm]
            g.folded_masks[group] = folded
        mask = folded
    # K/V narrower than q (kv_cache_dtype): widened, the math stays in q's dtype
    dt = torch.promote_types(q.dtype, k.dtype)
    qs, k, v = qs.to(dt), k.to(dt), v.to(dt)
    o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
    o = o.view(b, hkv, qm, group, d).transpose(1, 2).reshape(b * qm, h, d)
    return o


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    cache: KVCache,
    ctx: ForwardContext,
    scale: float,
    window: int = 0,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each request's rows over its paged context (GQA: H % Hkv == 0);
    `window` > 0: each row sees only its `window` newest positions, itself included.

    Rows past the last request (padding) come back as zeros. The index plan derived from ctx is
    cached on the ctx object by the first layer's call: treat a ForwardContext as immutable and
    build a new one per forward.
    """
    if use_triton(q.device) and q.shape[-1] >= 16:  # tl.dot needs K >= 16
        return paged_attention_triton(q, cache, ctx, scale, window=window)
    if cpu_attention.supports(q, cache):
        lib = cpu_attention.kernel()
        if lib is not None:
            return cpu_attention.paged_attention_cpu(lib, q, cache, ctx, scale, window)
    return paged_attention_torch(q, cache, ctx, scale, window)


def paged_attention_torch(
    q: torch.Tensor,  # [T, H, D]
    cache: KVCache,
    ctx: ForwardContext,
    scale: float,
    window: int = 0,
) -> torch.Tensor:  # [T, H, D]
    """paged_attention by gathering K/V and running SDPA (any device, any KV dtype)."""
    t, h, d = q.shape
    hkv = cache.k.shape[2]
    plan = _get_plan(ctx, cache.block_size, window, q.device)
    groups = plan.short
    if len(groups) == 1 and not plan.long and groups[0].out_dst is None and plan.num_rows == t:
        # Pure decode / uniform verify: the padded output is the answer, no scatter needed.
        return _run_short(q, cache, groups[0], scale).to(q.dtype)

    out = q.new_zeros(t, h, d)
    for short in groups:
        o = _run_short(q, cache, short, scale).to(q.dtype)
        if short.out_dst is None:
            out[: o.shape[0]] = o
        else:
            out.index_copy_(0, short.out_dst, o.index_select(0, short.out_src))
    for r in plan.long:
        k, v = _gather_kv(cache, r.kv_slots)  # [L, Hkv, D]
        qr = q[r.row_start : r.row_end].transpose(0, 1)[None]  # [1, H, Lq, D]
        dt = torch.promote_types(q.dtype, k.dtype)
        k = k.transpose(0, 1)[None].to(dt)  # [1, Hkv, L, D]
        v = v.transpose(0, 1)[None].to(dt)
        o = F.scaled_dot_product_attention(
            qr.to(dt),
            k,
            v,
            attn_mask=r.mask,
            is_causal=r.mask is None,
            scale=scale,
            enable_gqa=h != hkv,
        )  # [1, H, Lq, D]
        out[r.row_start : r.row_end] = o[0].transpose(0, 1).to(q.dtype)
    return out
