"""Triton KV write / paged attention against the torch reference (specserve.ops.attention).

    pytest -m gpu tests/gpu                                  # correctness (skips without CUDA)
    python3 tests/gpu/test_triton_attention.py --bench       # µs per call, KV-read bandwidth

Every case fills cache slots outside all contexts (and block 0, the block-table padding) with
NaN: a kernel that reads a key it should not turns the output NaN instead of passing silently.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from unittest import mock

import pytest
import torch

from specserve.ops import attention, triton_attention
from specserve.ops.attention import paged_attention, write_kv
from specserve.ops.forward_context import ForwardContext, KVCache
from specserve.ops.triton_attention import (
    TileConfig,
    choose_num_splits,
    choose_tile_config,
    paged_attention_triton,
    write_kv_triton,
)

TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-3}


@dataclass
class Case:
    q: torch.Tensor  # [T, H, D]
    cache: KVCache
    ctx: ForwardContext
    scale: float


def make_ctx(q_lens, c_lens, tables, block_size, pad_rows, device) -> ForwardContext:
    """Context tensors for requests with these lengths and block tables (lists of block ids)."""
    width = max(len(t) for t in tables) + 1  # one padding column of 0s
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    slots = []
    for i, (ql, cl, table) in enumerate(zip(q_lens, c_lens, tables)):
        bt[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cl - ql, cl)]
    slots += [-1] * pad_rows
    cu = [0]
    for ql in q_lens:
        cu.append(cu[-1] + ql)

    def i32(xs):
        return torch.tensor(xs, dtype=torch.int32, device=device)

    return ForwardContext(
        query_lens=i32(q_lens),
        cu_query_lens=i32(cu),
        context_lens=i32(c_lens),
        block_tables=bt.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(q_lens),
        max_context_len=max(c_lens),
        query_lens_cpu=list(q_lens),
        context_lens_cpu=list(c_lens),
    )


def make_case(
    device, dtype, q_lens, c_lens, *, hkv=8, group=4, head_dim=128, block_size=16,
    pad_rows=0, seed=0, poison=True, window=0,
) -> Case:  # fmt: skip
    """window > 0 also poisons the keys older than each request's first row's window: a
    sliding-window kernel must never read them (their blocks may have been freed)."""
    gen = torch.Generator().manual_seed(seed)
    per_req = [math.ceil(c / block_size) for c in c_lens]
    num_blocks = sum(per_req) + 4
    # Blocks handed out in random order; block 0 is never handed out (block-table padding).
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, used = [], 0
    for n in per_req:
        tables.append(perm[used : used + n])
        used += n
    ctx = make_ctx(q_lens, c_lens, tables, block_size, pad_rows, device)
    shape = (num_blocks, block_size, hkv, head_dim)
    k = torch.randn(shape, generator=gen)
    v = torch.randn(shape, generator=gen)
    if poison:
        live = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        for ql, cl, table in zip(q_lens, c_lens, tables):
            pos = torch.arange(max(0, cl - ql - window + 1) if window else 0, cl)
            live[torch.tensor(table)[pos // block_size] * block_size + pos % block_size] = True
        k.view(-1, hkv, head_dim)[~live] = float("nan")
        v.view(-1, hkv, head_dim)[~live] = float("nan")
    cache = KVCache(k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype))
    q = torch.randn(sum(q_lens) + pad_rows, hkv * group, head_dim, generator=gen)
    return Case(q.to(device=device, dtype=dtype), cache, ctx, head_dim**-0.5)


def torch_reference(q, cache, ctx, scale, window: int = 0) -> torch.Tensor:
    """The torch path of `paged_attention`, also on CUDA (where it would dispatch to Triton)."""
    with mock.patch.object(attention, "use_triton", lambda device: False):
        return paged_attention(q, cache, ctx, scale, window)


def check_attention(case: Case, dtype, window: int = 0, **kw) -> None:
    if dtype == torch.bfloat16 and case.q.device.type == "cpu":
        pytest.skip("Triton's CPU interpreter multiplies bf16 as raw uint16")
    ref = torch_reference(case.q, case.cache, case.ctx, case.scale, window)
    out = paged_attention_triton(case.q, case.cache, case.ctx, case.scale, window=window, **kw)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    assert torch.isfinite(out).all(), "kernel read an unwritten (NaN) cache slot"
    n = sum(case.ctx.query_lens_cpu)
    assert (out[n:] == 0).all(), "padding rows must come back as zeros"
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def _rand_lens(gen, n, lo, hi) -> list[int]:
    return torch.randint(lo, hi + 1, (n,), generator=gen).tolist()


def attention_cases() -> dict[str, tuple[list[int], list[int], dict]]:
    """name -> (query_lens, context_lens, make_case kwargs)."""
    g = torch.Generator().manual_seed(1234)
    small = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU interpreter is slow
    big = 300 if small else 4096
    cases = {}
    for b in (1, 64, 256):
        if small and b > 1:
            b //= 16
        cases[f"decode_b{b}"] = ([1] * b, _rand_lens(g, b, 1, big), {"hkv": 2 if b > 64 else 8})
    cases["decode_llama_4k"] = ([1] * 2, [big, big - 5], {})
    vq = _rand_lens(g, 12, 1, 9)
    cases["verify"] = (vq, [q + c for q, c in zip(vq, _rand_lens(g, 12, 0, big // 2))], {})
    pq = [70, 150, 30] if small else [700, 1500, 300]
    cases["prefill"] = (pq, [pq[0], pq[1] + 200, pq[2] + 1000], {"hkv": 2, "pad_rows": 3})
    mq = [1, 5, 1, 9, pq[0], 1, 3]
    mc = [17, 40, 33, 300, pq[0] + 13, 1, 3]
    cases["mixed_gqa7_d64"] = (mq, mc, {"hkv": 2, "group": 7, "head_dim": 64, "pad_rows": 5})
    cases["mixed_mha_bs32"] = (mq, mc, {"hkv": 4, "group": 1, "block_size": 32})
    cases["mixed_d96_bs8"] = (mq, mc, {"hkv": 2, "group": 2, "head_dim": 96, "block_size": 8})
    cases["mixed_d256"] = (mq, mc, {"hkv": 1, "group": 8, "head_dim": 256, "pad_rows": 1})
    return cases


DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]
CASES = attention_cases()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_matches_reference(cuda, name, dtype):
    q_lens, c_lens, kw = CASES[name]
    check_attention(make_case(cuda, dtype, q_lens, c_lens, **kw), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 3, 8, 32])
def test_split_kv_matches_reference(cuda, dtype, splits):
    # decode, verify and a prefill chunk together, each split count forced
    q_lens, c_lens = [1, 1, 5, 9, 40], [1, 700, 5, 650, 400]
    case = make_case(cuda, dtype, q_lens, c_lens, hkv=2, group=4, pad_rows=2, seed=splits)
    check_attention(case, dtype, num_splits=splits)
    # The last live program of each tile merges the splits and resets its tile's counter: the
    # next launch (or graph replay) must find them all at zero again.
    for counters in triton_attention._counters.get(case.q.device, []):
        assert not counters.any(), counters.nonzero()


def compiled_variants(kernel) -> int:
    """Variants of a Triton kernel compiled so far (the cache's layout differs by version)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(c[0]) for c in caches.values())
    return sum(len(c) for c in kernel.cache.values())


@pytest.mark.gpu
def test_split_counts_and_lengths_share_one_compiled_kernel(cuda):
    # An eager launch (a drafter's catch-up) picks its split count from the context length: a
    # kernel compiled per split count stalled the step that first met a count (~1 s each).
    if cuda.type != "cuda":
        pytest.skip("Triton's CPU interpreter compiles nothing")
    kernel = triton_attention._kernels()._paged_attention_kernel
    dtype = torch.bfloat16

    def launch(c_len: int, splits: int) -> None:
        case = make_case(cuda, dtype, [1, 1], [c_len, c_len // 2 + 1], hkv=2, seed=c_len)
        check_attention(case, dtype, num_splits=splits)

    launch(300, 2)
    before = compiled_variants(kernel)
    for c_len, splits in [(301, 3), (517, 5), (1024, 7), (2049, 16), (4000, 31)]:
        launch(c_len, splits)
    assert compiled_variants(kernel) == before


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 5])
def test_decode_tile_on_mixed_batch(cuda, dtype, splits):
    # the decode tile (4 rows x 4 heads) forced on long requests: many tiles each
    q_lens, c_lens = [1, 3, 9, 40], [300, 5, 650, 400]
    case = make_case(cuda, dtype, q_lens, c_lens, hkv=2, group=4, pad_rows=3, seed=splits)
    block_n = 128 if dtype == torch.bfloat16 else 64  # fp32 at 128 would overflow shared memory
    cfg = TileConfig(block_q=4, block_m=16, block_n=block_n, num_warps=4, num_stages=2)
    check_attention(case, dtype, num_splits=splits, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pad_rows", [0, 4])
def test_write_kv_matches_reference(cuda, dtype, pad_rows):
    q_lens, c_lens = [1, 7, 30, 1], [50, 7, 100, 1]
    case = make_case(cuda, dtype, q_lens, c_lens, hkv=4, head_dim=64, pad_rows=pad_rows)
    t = case.q.shape[0]
    gen = torch.Generator().manual_seed(7)
    for src_dtype in {dtype, torch.float32}:
        # K/V as strided views of one fused projection output, as the model hands them over
        kv = torch.randn(t, 3, 4, 64, generator=gen).to(device=cuda, dtype=src_dtype)
        k, v = kv[:, 0], kv[:, 2]
        ref = KVCache(case.cache.k.clone(), case.cache.v.clone())
        got = KVCache(case.cache.k.clone(), case.cache.v.clone())
        write_kv(k, v, ref, case.ctx.slot_mapping)
        write_kv_triton(k, v, got, case.ctx.slot_mapping)
        # Triton's CPU interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): 1 ulp
        tol = 0.0 if src_dtype == dtype or cuda.type == "cuda" else 2**-7
        torch.testing.assert_close(got.k, ref.k, atol=0, rtol=tol, equal_nan=True)
        torch.testing.assert_close(got.v, ref.v, atol=0, rtol=tol, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 300])
def test_cuda_graph_replay_with_new_lengths(cuda, window):
    """Capture write + attention once for a verify bucket, replay with other lengths/tables
    (window 300: a sliding-window layer, its window fixed at capture)."""
    if cuda.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    dtype, b, bucket_q, bound, bs = torch.bfloat16, 6, 4, 2048, 16
    hkv, group = 8, 4
    t = b * bucket_q
    base = make_case(cuda, dtype, [bucket_q] * b, [bound] * b, hkv=hkv, group=group, poison=False)
    cache, c0 = base.cache, base.ctx
    blocks = cache.k.shape[0]
    q_buf, k_buf, v_buf = (
        base.q,
        torch.zeros_like(base.q[:, :hkv]),
        torch.zeros_like(base.q[:, :hkv]),
    )
    # the graph's ctx: fixed buffers, bucket bound for max_query_len, length bound for contexts
    splits = choose_num_splits(b * hkv, bound, cuda)
    assert splits > 1, "the graph case should exercise split-KV"

    def step():
        write_kv_triton(k_buf, v_buf, cache, c0.slot_mapping)
        return paged_attention_triton(
            q_buf, cache, c0, base.scale, window=window, num_splits=splits
        )

    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_buf = step()

    gen = torch.Generator().manual_seed(99)
    for it in range(3):
        q_lens = _rand_lens(gen, b, 1, bucket_q)
        c_lens = [q + c for q, c in zip(q_lens, _rand_lens(gen, b, 0, bound - bucket_q))]
        perm = (torch.randperm(blocks - 1, generator=gen) + 1).tolist()
        tables = [perm[i * (bound // bs) : (i + 1) * (bound // bs)] for i in range(b)]
        ctx = make_ctx(q_lens, c_lens, tables, bs, t - sum(q_lens), cuda)
        for name in ("query_lens", "cu_query_lens", "context_lens", "slot_mapping"):
            getattr(c0, name).copy_(getattr(ctx, name))
        c0.block_tables[:, : ctx.block_tables.shape[1]].copy_(ctx.block_tables)
        for buf in (q_buf, k_buf, v_buf):
            buf.copy_(torch.randn(buf.shape, generator=gen).to(cuda, dtype))
        ref_cache = KVCache(cache.k.clone(), cache.v.clone())
        graph.replay()
        write_kv(k_buf, v_buf, ref_cache, ctx.slot_mapping)
        ref = torch_reference(q_buf, ref_cache, ctx, base.scale, window)
        torch.cuda.synchronize()
        assert torch.equal(cache.k, ref_cache.k) and torch.equal(cache.v, ref_cache.v), it
        torch.testing.assert_close(out_buf.float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert (out_buf[sum(q_lens) :] == 0).all()


# ----------------------------------------------------------------------------- benchmark


def _bench_us(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def _graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _bench_us(graph.replay)


def bench(sweep: bool) -> None:
    dev = torch.device("cuda")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() / (_bench_us(lambda: dst.copy_(src)) * 1e-6) / 1e12
    src = dst = None  # free the 2 GB before the cases
    print(f"device copy bandwidth {copy_bw:.2f} TB/s (read + write)")
    hkv, d = 8, 128
    print("decode, Llama-3.1-8B attention (32q/8kv heads, d128, bf16, block 16), µs per call")
    hdr = f"{'batch':>5} {'ctx':>5} {'splits':>6} {'ref':>8} {'triton':>8} {'graph':>8}"
    print(f"{hdr} {'KV TB/s':>8} {'of 4.3':>6}")
    sweeps = []
    for b in (1, 64):
        for ctx_len in (512, 4096):
            c = make_case(dev, torch.bfloat16, [1] * b, [ctx_len] * b, poison=False)
            paged_attention(c.q, c.cache, c.ctx, c.scale)  # builds the cached plan
            t_ref = _bench_us(lambda c=c: paged_attention(c.q, c.cache, c.ctx, c.scale))
            t_tri = _bench_us(lambda c=c: paged_attention_triton(c.q, c.cache, c.ctx, c.scale))
            t_gr = _graph_us(lambda c=c: paged_attention_triton(c.q, c.cache, c.ctx, c.scale))
            kv_tb = b * ctx_len * hkv * d * 2 * 2 / (t_gr * 1e-6) / 1e12
            s = choose_num_splits(b * hkv, ctx_len, dev)
            row = f"{b:>5} {ctx_len:>5} {s:>6} {t_ref:>8.1f} {t_tri:>8.1f} {t_gr:>8.1f}"
            print(f"{row} {kv_tb:>8.2f} {kv_tb / 4.3:>6.0%}")
            if sweep and ctx_len == 4096:
                sweeps.append((c, b, ctx_len))
    _bench_other(dev)
    for args in sweeps:  # last: the slowest part, and its output matters least
        _sweep_decode(*args)


def _sweep_decode(c: Case, b: int, ctx_len: int) -> None:
    best = []
    splits_opts = [1] if b >= 64 else [8, 16, 32]
    for s in splits_opts:
        for bn in (32, 64, 128):
            for w in (4, 8):
                for st in (2, 3):
                    cfg = TileConfig(4, 16, bn, w, st)

                    def fn(s=s, cfg=cfg):
                        return paged_attention_triton(
                            c.q, c.cache, c.ctx, c.scale, num_splits=s, config=cfg
                        )

                    best.append((_graph_us(fn), s, bn, w, st))
    best.sort()
    print(f"sweep batch {b} ctx {ctx_len}, best (us, splits, block_n, warps, stages):", best[:4])


def _bench_other(dev) -> None:
    print("other shapes (graph replay µs): verify / prefill / write_kv")
    gen = torch.Generator().manual_seed(0)
    c = make_case(dev, torch.bfloat16, [5] * 64, _rand_lens(gen, 64, 1024, 1024), poison=False)
    paged_attention(c.q, c.cache, c.ctx, c.scale)
    t_ref = _bench_us(lambda: paged_attention(c.q, c.cache, c.ctx, c.scale))
    t_gr = _graph_us(lambda: paged_attention_triton(c.q, c.cache, c.ctx, c.scale))
    kv_tb = 64 * 1024 * 8 * 128 * 4 / (t_gr * 1e-6) / 1e12
    print(f"verify 64 x 5 rows, ctx 1024: ref {t_ref:.1f}  triton {t_gr:.1f}  KV {kv_tb:.2f} TB/s")
    for n in (512, 2048):
        c = make_case(dev, torch.bfloat16, [n], [2 * n], poison=False)
        paged_attention(c.q, c.cache, c.ctx, c.scale)
        t_ref = _bench_us(lambda c=c: paged_attention(c.q, c.cache, c.ctx, c.scale))
        t_gr = _graph_us(lambda c=c: paged_attention_triton(c.q, c.cache, c.ctx, c.scale))
        flops = 4 * n * (n + n / 2) * 32 * 128  # QK^T + PV over the causal part
        print(f"prefill chunk {n} rows, ctx {2 * n}: ref {t_ref:.1f}  triton {t_gr:.1f} µs  "
              f"{flops / (t_gr * 1e-6) / 1e12:.0f} TFLOP/s ({choose_tile_config(n, 4, 128)})")  # fmt: skip
    c = make_case(dev, torch.bfloat16, [1] * 64, [100] * 64, poison=False)
    k = torch.randn(64, 8, 128, device=dev, dtype=torch.bfloat16)
    t_ref = _bench_us(lambda: write_kv(k, k, c.cache, c.ctx.slot_mapping))
    t_tri = _graph_us(lambda: write_kv_triton(k, k, c.cache, c.ctx.slot_mapping))
    print(f"write_kv 64 rows: ref {t_ref:.1f}  triton (graph) {t_tri:.1f} µs")


if __name__ == "__main__":
    if "--bench" in sys.argv:
        bench(sweep="--sweep" in sys.argv)
    else:
        sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
