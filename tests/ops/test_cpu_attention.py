"""The compiled CPU attention kernel (specserve.ops.cpu_attention) against the torch path and a
dense float64 reference, its fallback when it cannot be built, and the engine's greedy outputs
through it. Kernel tests run on two builds of the source: the one the engine loads (AVX-512 path
where the CPU has it) and one with -DSPECSERVE_PORTABLE (the portable C++ path only)."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve import LLM, SamplingParams, env
from specserve.ops import cpu_attention, cpu_build
from specserve.ops.attention import paged_attention, paged_attention_torch
from tests.ops.test_attention import _dense_reference, _setup


def _portable_build() -> ctypes.CDLL:
    """The kernel compiled without its AVX-512 path, loaded like cpu_attention._load does."""
    if cpu_build.compiler() is None:
        pytest.skip("no C++ compiler")
    built = cpu_build.load(cpu_attention._SOURCE, ("-DSPECSERVE_PORTABLE",))
    built.specserve_cpu_attention.argtypes = [ctypes.POINTER(cpu_attention.Args), ctypes.c_int]
    built.specserve_cpu_attention.restype = ctypes.c_int
    return built


@pytest.fixture(scope="module", params=["native", "portable"])
def lib(request):
    if request.param == "portable":
        return _portable_build()
    with env.override(cpu_attention="kernel"):
        return cpu_attention.kernel()  # built once (cached under $SPECSERVE_CACHE/kernels)


@st.composite
def layouts(draw: st.DrawFn) -> dict:
    """A batch of prefill chunks, decode rows and verify rows, in any order."""
    n = draw(st.integers(1, 6))
    q_lens, ctx_lens = [], []
    for _ in range(n):
        kind = draw(st.sampled_from(["decode", "verify", "prefill"]))
        q = {"decode": 1, "verify": draw(st.integers(2, 8)), "prefill": draw(st.integers(9, 40))}
        q_lens.append(q[kind])
        ctx_lens.append(q[kind] + draw(st.integers(0, 70)))
    heads, kv_heads = draw(st.sampled_from([(6, 2), (4, 4), (8, 1), (9, 3)]))
    return {
        "q_lens": q_lens,
        "ctx_lens": ctx_lens,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": draw(st.sampled_from([8, 64, 128])),
        "block_size": draw(st.sampled_from([4, 16])),
        "pad_rows": draw(st.integers(0, 3)),
        "window": draw(st.sampled_from([0, 1, 5, 33])),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(), bf16=st.booleans())
def test_kernel_matches_reference_and_torch_path(lib, layout: dict, bf16: bool) -> None:
    window = layout.pop("window")
    dtype = torch.bfloat16 if bf16 else torch.float32
    s = _setup(**layout, dtype=dtype)
    q_lens, ctx_lens = layout["q_lens"], layout["ctx_lens"]
    # keys older than every row's window may live in freed blocks: poison them
    bs = s.cache.block_size
    for i, (ql, c) in enumerate(zip(q_lens, ctx_lens)):
        for p in range(max(0, c - ql - window + 1) if window else 0):
            blk = int(s.ctx.block_tables[i, p // bs])
            s.cache.k[blk, p % bs] = float("nan")
            s.cache.v[blk, p % bs] = float("nan")
    # the engine's q is a strided view of the qkv projection: so is this one
    t, h, d = s.q.shape
    qkv = torch.randn(t, h + 4, d).to(dtype)
    qkv[:, :h] = s.q
    q = qkv[:, :h]

    out = cpu_attention.paged_attention_cpu(lib, q, s.cache, s.ctx, 0.3, window)
    assert out.dtype == dtype and out.shape == (t, h, d)
    ks = [k.to(dtype) for k in s.ks]
    vs = [v.to(dtype) for v in s.vs]
    ref = _dense_reference(s.q, ks, vs, q_lens, ctx_lens, 0.3, window)
    torch_path = paged_attention_torch(q, s.cache, s.ctx, 0.3, window)
    if bf16:  # one bf16 rounding of the output
        torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, torch_path, atol=1e-5, rtol=1e-5)
    assert (out[sum(q_lens) :] == 0).all()  # padding rows
    # two threads split the work differently: the same numbers
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        again = cpu_attention.paged_attention_cpu(lib, q, s.cache, s.ctx, 0.3, window)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(again, out)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts())
def test_fp32_rows_over_a_bf16_cache_keep_fp32_math(lib, layout: dict) -> None:
    """kv_cache_dtype="bfloat16" under an fp32 model: the kernel and the torch path both widen
    the bf16 K/V and compute in fp32, equal to a dense reference over the bf16-rounded K/V."""
    window = layout.pop("window")
    s = _setup(**layout, dtype=torch.bfloat16)
    q = s.q.float()  # the model's fp32 rows
    out = cpu_attention.paged_attention_cpu(lib, q, s.cache, s.ctx, 0.3, window)
    torch_path = paged_attention_torch(q, s.cache, s.ctx, 0.3, window)
    assert out.dtype == torch_path.dtype == torch.float32
    ks = [k.to(torch.bfloat16).float() for k in s.ks]
    vs = [v.to(torch.bfloat16).float() for v in s.vs]
    ref = _dense_reference(q, ks, vs, layout["q_lens"], layout["ctx_lens"], 0.3, window)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch_path, out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_requests_at_engine_shapes(lib, head_dim: int, window: int, dtype) -> None:
    """Block size 16, GQA 3: 40 requests of decode, verify and prefill rows (the AVX-512 path's
    shapes), context lengths on and off block boundaries, the same numbers at any thread count."""
    g = torch.Generator().manual_seed(head_dim + window)
    q_lens = [[1, 1, 2, 4, 8, 16, 33][i % 7] for i in range(40)]
    ctx_lens = [q + int(torch.randint(0, 260, (1,), generator=g)) for q in q_lens]
    ctx_lens[:4] = [1, 16, 17, 32]  # one key; whole blocks; a block of one key
    q_lens[:4] = [1, 1, 1, 1]
    s = _setup(q_lens, ctx_lens, 9, 3, head_dim, 16, pad_rows=3, dtype=dtype, seed=window)
    if window:  # keys out of every row's window may be freed blocks: poison them
        for i, (ql, c) in enumerate(zip(q_lens, ctx_lens)):
            for p in range(max(0, c - ql - window + 1)):
                blk = int(s.ctx.block_tables[i, p // 16])
                s.cache.k[blk, p % 16] = float("nan")
                s.cache.v[blk, p % 16] = float("nan")
    ks = [k.to(dtype) for k in s.ks]
    vs = [v.to(dtype) for v in s.vs]
    ref = _dense_reference(s.q, ks, vs, q_lens, ctx_lens, 0.125, window)
    n = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(cpu_attention.paged_attention_cpu(lib, s.q, s.cache, s.ctx, 0.125, window))
    finally:
        torch.set_num_threads(n)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(outs[0].double(), ref, atol=tol, rtol=tol)
    assert (outs[0][sum(q_lens) :] == 0).all()
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_dispatch_follows_the_switch(lib) -> None:
    s = _setup([1, 5, 20], [30, 9, 20], 6, 2, pad_rows=2)
    with env.override(cpu_attention="torch"):
        assert cpu_attention.kernel() is None
        assert torch.equal(
            paged_attention(s.q, s.cache, s.ctx, 0.5),
            paged_attention_torch(s.q, s.cache, s.ctx, 0.5),
        )
    with env.override(cpu_attention="kernel"):
        want = cpu_attention.paged_attention_cpu(lib, s.q, s.cache, s.ctx, 0.5)
        assert torch.equal(paged_attention(s.q, s.cache, s.ctx, 0.5), want)


def test_no_compiler_falls_back_with_one_warning(monkeypatch, caplog) -> None:
    monkeypatch.setattr(cpu_build, "compiler", lambda: None)
    monkeypatch.setattr(cpu_attention, "_tried", False)
    monkeypatch.setattr(cpu_attention, "_lib", None)
    s = _setup([1, 5], [30, 9], 6, 2)
    with env.override(cpu_attention="auto"), caplog.at_level(logging.WARNING):
        for _ in range(3):
            out = paged_attention(s.q, s.cache, s.ctx, 0.5)
            assert torch.equal(out, paged_attention_torch(s.q, s.cache, s.ctx, 0.5))
    warnings = [r for r in caplog.records if r.name == cpu_attention.__name__]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0].getMessage()
    monkeypatch.setattr(cpu_attention, "_tried", False)
    with env.override(cpu_attention="kernel"), pytest.raises(RuntimeError) as e:
        cpu_attention.kernel()
    assert "SPECSERVE_CPU_ATTENTION=kernel" in str(e.value)


def test_bad_switch_value_is_named() -> None:
    with pytest.raises(ValueError, match="SPECSERVE_CPU_ATTENTION"):
        env.Settings.from_environ({"SPECSERVE_CPU_ATTENTION": "fast"})


def test_engine_greedy_outputs_equal_the_torch_path(lib, tiny_llama_dir: Path) -> None:
    """Chunked prefill, decode and n-gram verify rows through the whole engine."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() * 2 for n in (23, 5, 11)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(
        str(tiny_llama_dir),
        device="cpu",
        dtype="float32",
        progress=False,
        max_num_batched_tokens=16,
        enable_chunked_prefill=True,
        # budget off: every step verifies what the drafter finds (this test is about the rows)
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "verify_budget": "off"},
    )
    outs = {}
    for mode in ("torch", "kernel"):  # the switch is read at every call: one engine serves both
        with env.override(cpu_attention=mode):
            res = llm.generate(prompts, sp, use_tqdm=False)
            outs[mode] = [o.outputs[0].token_ids for o in res]
    assert outs["kernel"] == outs["torch"]
    assert all(len(o) == 16 for o in outs["kernel"])
    assert llm.get_metrics()["spec_accepted_tokens"] > 0  # verify rows were there
