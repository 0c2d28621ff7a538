"""Paged attention vs a dense causal reference: random block tables, mixed query lens, GQA."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from specserve import env
from specserve.ops import attention as attn
from specserve.ops.attention import paged_attention, write_kv
from specserve.ops.forward_context import ForwardContext, KVCache


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def _cpu_path(request):
    """Every test here runs on both CPU paths: the compiled kernel and the torch fallback."""
    with env.override(cpu_attention=request.param):
        yield


@dataclass
class Setup:
    q: torch.Tensor  # [T, H, D]
    ks: list[torch.Tensor]  # per request [context_len, Hkv, D], dense
    vs: list[torch.Tensor]
    cache: KVCache
    ctx: ForwardContext
    rows_k: torch.Tensor  # [T, Hkv, D] what this forward's rows wrote (padding rows: junk)
    rows_v: torch.Tensor


def _setup(
    q_lens: list[int],
    ctx_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int = 8,
    block_size: int = 4,
    pad_rows: int = 0,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Setup:
    """Random dense K/V per request, scattered over shuffled blocks of a NaN-filled cache.

    Prior context is written up front; the rows of this forward are written by write_kv (which
    the test exercises too). Unwritten cache memory stays NaN, so reading it shows up.
    """
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    cache = KVCache(
        torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    )
    ks = [torch.randn(c, kv_heads, head_dim, generator=g) for c in ctx_lens]
    vs = [torch.randn(c, kv_heads, head_dim, generator=g) for c in ctx_lens]

    def slot(i: int, p: int) -> int:
        return tables[i][p // block_size] * block_size + p % block_size

    for i, (q, c) in enumerate(zip(q_lens, ctx_lens)):
        prior = torch.tensor([slot(i, p) for p in range(c - q)], dtype=torch.long)
        if len(prior):
            write_kv(ks[i][: c - q], vs[i][: c - q], cache, prior)
    slots = [slot(i, p) for i, (q, c) in enumerate(zip(q_lens, ctx_lens)) for p in range(c - q, c)]
    slot_mapping = torch.tensor(slots + [-1] * pad_rows, dtype=torch.long)
    new_k = torch.cat([ks[i][c - q :] for i, (q, c) in enumerate(zip(q_lens, ctx_lens))])
    new_v = torch.cat([vs[i][c - q :] for i, (q, c) in enumerate(zip(q_lens, ctx_lens))])
    junk = torch.randn(pad_rows, kv_heads, head_dim, generator=g)
    rows_k, rows_v = torch.cat([new_k, junk]).to(dtype), torch.cat([new_v, junk]).to(dtype)
    write_kv(rows_k, rows_v, cache, slot_mapping)

    width = max(len(t) for t in tables)
    ql = torch.tensor(q_lens, dtype=torch.int32)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(ql, 0)
    ctx = ForwardContext(
        query_lens=ql,
        cu_query_lens=cu,
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=slot_mapping,
        max_query_len=max(q_lens),
        max_context_len=max(ctx_lens),
        query_lens_cpu=list(q_lens),
        context_lens_cpu=list(ctx_lens),
    )
    q = torch.randn(sum(q_lens) + pad_rows, heads, head_dim, generator=g).to(dtype)
    return Setup(q, ks, vs, cache, ctx, rows_k, rows_v)


def _unpack(
    st: Setup,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], KVCache, ForwardContext]:
    return st.q, st.ks, st.vs, st.cache, st.ctx


def _dense_reference(
    q: torch.Tensor,  # [T, H, D]
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
    q_lens: list[int],
    ctx_lens: list[int],
    scale: float,
    window: int = 0,
) -> torch.Tensor:  # [T, H, D] float64, padding rows zero
    """Row at position p attends to keys [0, p], or with a window to (p - window, p] (HF)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // ks[0].shape[1]
    row = 0
    for i, (ql, c) in enumerate(zip(q_lens, ctx_lens)):
        k = ks[i].double().repeat_interleave(group, 1)  # [c, H, D]
        v = vs[i].double().repeat_interleave(group, 1)
        for j in range(ql):
            p = c - ql + j
            lo = max(0, p - window + 1) if window else 0
            s = torch.einsum("hd,thd->ht", q[row + j].double(), k[lo : p + 1]) * scale
            out[row + j] = torch.einsum("ht,thd->hd", s.softmax(-1), v[lo : p + 1])
        row += ql
    return out


CASES = {
    # name: (query lens, context lens)
    "decode": ([1, 1, 1], [5, 17, 9]),
    "decode_uniform_ctx": ([1, 1], [8, 8]),
    "verify": ([4, 2, 3], [10, 6, 23]),
    "uniform_verify": ([3, 3], [12, 7]),
    "prefill_whole": ([37], [37]),
    "prefill_chunk": ([29], [45]),
    "mixed": ([1, 5, 40, 1, 17, 3, 20], [30, 12, 40, 1, 60, 3, 33]),
    "long_first": ([25, 1, 2], [25, 7, 9]),
    # contexts far apart: decode/verify rows split into several padded groups
    "context_groups": ([1, 3, 1, 2, 1, 20], [300, 9, 700, 40, 5, 150]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("pad_rows", [0, 3])
def test_paged_attention_matches_dense(case: str, heads: int, kv_heads: int, pad_rows: int) -> None:
    q_lens, ctx_lens = CASES[case]
    q, ks, vs, cache, ctx = _unpack(_setup(q_lens, ctx_lens, heads, kv_heads, pad_rows=pad_rows))
    scale = 0.37
    out = paged_attention(q, cache, ctx, scale)
    ref = _dense_reference(q, ks, vs, q_lens, ctx_lens, scale)
    assert out.shape == q.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # the cached plan (built by the first layer) gives the same answer to the next layer
    torch.testing.assert_close(paged_attention(q, cache, ctx, scale), out, atol=0, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window", [1, 4, 7, 16])
def test_sliding_window_matches_dense(case: str, window: int) -> None:
    """Each row sees its `window` newest positions; keys older than every row's window are
    poisoned (NaN) in the cache, so gathering one shows up (their blocks may be freed)."""
    q_lens, ctx_lens = CASES[case]
    st = _setup(q_lens, ctx_lens, 6, 2, pad_rows=2)
    q, ks, vs, cache, ctx = _unpack(st)
    bs = cache.block_size
    for i, (ql, c) in enumerate(zip(q_lens, ctx_lens)):
        for p in range(max(0, c - ql - window + 1)):
            blk = int(ctx.block_tables[i, p // bs])
            cache.k[blk, p % bs] = float("nan")
            cache.v[blk, p % bs] = float("nan")
    out = paged_attention(q, cache, ctx, 0.37, window)
    ref = _dense_reference(q, ks, vs, q_lens, ctx_lens, 0.37, window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # layers of one forward with different windows each get their own cached plan
    full = paged_attention(q, cache, ctx, 0.37) if window >= max(ctx_lens) else None
    if full is not None:
        torch.testing.assert_close(full, out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(paged_attention(q, cache, ctx, 0.37, window), out, atol=0, rtol=0)


def test_block_size_16_and_bf16() -> None:
    q_lens, ctx_lens = [1, 6, 30], [40, 6, 70]
    q, ks, vs, cache, ctx = _unpack(
        _setup(q_lens, ctx_lens, 6, 2, head_dim=16, block_size=16, dtype=torch.bfloat16)
    )
    out = paged_attention(q, cache, ctx, 0.25)
    assert out.dtype == torch.bfloat16
    ks = [k.bfloat16() for k in ks]
    vs = [v.bfloat16() for v in vs]
    ref = _dense_reference(q, ks, vs, q_lens, ctx_lens, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_short_threshold_boundary() -> None:
    n = attn.SHORT_QUERY_MAX
    q_lens, ctx_lens = [n, n + 1, 1], [n + 4, n + 1, 3]
    q, ks, vs, cache, ctx = _unpack(_setup(q_lens, ctx_lens, 4, 2))
    ref = _dense_reference(q, ks, vs, q_lens, ctx_lens, 0.5)
    torch.testing.assert_close(
        paged_attention(q, cache, ctx, 0.5).double(), ref, atol=1e-5, rtol=1e-5
    )


def test_padding_rows_write_nothing() -> None:
    q_lens, ctx_lens = [2, 1], [5, 3]
    cache = _setup(q_lens, ctx_lens, 4, 2, pad_rows=4).cache
    written = ~torch.isnan(cache.k[..., 0, 0]).reshape(-1)
    assert int(written.sum()) == sum(ctx_lens)


@pytest.mark.parametrize("slots", [[3, -1, 7, -1], [-1, -1, 5], [-1, -1], [0, 2]])
def test_sync_free_write_matches_masked_write(slots: list[int]) -> None:
    """The device path (no host read of the mask) writes exactly what the masked path writes."""
    g = torch.Generator().manual_seed(1)
    base_k = torch.randn(12, 2, 4, generator=g)
    base_v = torch.randn(12, 2, 4, generator=g)
    k = torch.randn(len(slots), 2, 4, generator=g)
    v = torch.randn(len(slots), 2, 4, generator=g)
    sm = torch.tensor(slots, dtype=torch.long)
    exp_k, exp_v = base_k.clone(), base_v.clone()
    write_kv(k, v, KVCache(exp_k.view(3, 4, 2, 4), exp_v.view(3, 4, 2, 4)), sm)
    got_k, got_v = base_k.clone(), base_v.clone()
    attn._write_kv_sync_free(k, v, got_k, got_v, sm)
    assert torch.equal(got_k, exp_k) and torch.equal(got_v, exp_v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", ["decode", "uniform_verify", "mixed", "long_first"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_cuda_matches_cpu_without_host_sync(case: str, backend: str, monkeypatch) -> None:
    """On a GPU, the torch reference path and the Triton kernels: same numbers as on CPU, and no
    device->host sync."""
    import specserve.ops.attention as attn

    if backend == "reference":
        monkeypatch.setattr(attn, "use_triton", lambda device: False)
    elif not attn.use_triton("cuda"):
        pytest.skip("triton not available")
    q_lens, ctx_lens = CASES[case]
    st = _setup(q_lens, ctx_lens, 6, 2, head_dim=16 if backend == "triton" else 8, pad_rows=3)
    q, cache, ctx = st.q, st.cache, st.ctx
    want = paged_attention(q, cache, ctx, 0.3)
    dev = torch.device("cuda")
    # the rows of this forward are NaN on the device until write_kv puts them there
    k_dev, v_dev = cache.k.to(dev), cache.v.to(dev)
    real = ctx.slot_mapping[ctx.slot_mapping >= 0]
    k_dev.view(-1, *k_dev.shape[2:])[real.to(dev)] = float("nan")
    v_dev.view(-1, *v_dev.shape[2:])[real.to(dev)] = float("nan")
    cache_dev = KVCache(k_dev, v_dev)
    ctx_dev = ForwardContext(
        query_lens=ctx.query_lens.to(dev),
        cu_query_lens=ctx.cu_query_lens.to(dev),
        context_lens=ctx.context_lens.to(dev),
        block_tables=ctx.block_tables.to(dev),
        slot_mapping=ctx.slot_mapping.to(dev),
        max_query_len=ctx.max_query_len,
        max_context_len=ctx.max_context_len,
        query_lens_cpu=ctx.query_lens_cpu,
        context_lens_cpu=ctx.context_lens_cpu,
    )
    q_dev, rk, rv = q.to(dev), st.rows_k.to(dev), st.rows_v.to(dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        write_kv(rk, rv, cache_dev, ctx_dev.slot_mapping)
        out = paged_attention(q_dev, cache_dev, ctx_dev, 0.3)
        out2 = paged_attention(q_dev, cache_dev, ctx_dev, 0.3)  # cached plan
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(out.cpu(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out2, out, atol=0, rtol=0)
    torch.testing.assert_close(cache_dev.k.cpu(), cache.k, atol=0, rtol=0, equal_nan=True)
