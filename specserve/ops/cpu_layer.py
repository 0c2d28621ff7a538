"""A stack of decoder layers on the CPU in one compiled call (cpu_layer.cpp).

The C++ calls the compiled kernels the per-op path calls (cpu_gemm, cpu_fused, cpu_attention),
in the same order, with the same arguments, through function pointers into their loaded
libraries: the result is the per-op path's bit for bit, without the Python between the calls.
model/cpu_stack.py decides where it applies and builds the tables; this module only loads the
library and mirrors its structs.

Built on first use by ops/cpu_build.py; no compiler: one warning, the per-op path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve import env
from specserve.ops import cpu_attention, cpu_build, cpu_fused, cpu_gemm, cpu_qgemm
from specserve.ops.forward_context import ForwardContext, KVCache

_SOURCE = Path(__file__).with_name("cpu_layer.cpp")
_ABI_VERSION = 3
_p = ctypes.c_void_p
_i32, _i64, _f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_float


# a linear's weights -> its kind in Layer.kinds: fp32 panels, bf16 panels, integer blocks
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2}


class _Layer(ctypes.Structure):
    """Mirror of `Layer` in cpu_layer.cpp."""

    _fields_ = [
        ("input_norm", _p),
        ("post_norm", _p),
        ("qkv", _p),
        ("qkv_bias", _p),
        ("o", _p),
        ("gate_up", _p),
        ("down", _p),
        ("k_cache", _p),
        ("v_cache", _p),
        ("input_eps", _f32),
        ("post_eps", _f32),
        ("window", _i32),
        ("kinds", _i32),
    ]


class _Stack(ctypes.Structure):
    """Mirror of `Stack` in cpu_layer.cpp."""

    _fields_ = [
        ("gemm", _p),
        ("gemm_bf16", _p),
        ("gemm_q", _p),
        ("add_rms_norm", _p),
        ("silu_and_mul", _p),
        ("rope_write_kv", _p),
        ("attention", _p),
        ("layers", _p),
        ("num_layers", _i32),
        ("rows", _i32),
        ("hidden", _i32),
        ("heads", _i32),
        ("kv_heads", _i32),
        ("head_dim", _i32),
        ("intermediate", _i32),
        ("kv_dtype", _i32),
        ("threads", _i32),
        ("pad", _i32),
        ("cos_sin", _p),
        ("cs_ld", _i64),
        ("cs_part", _i64),
        ("slots", _p),
        ("captures", _p),
        ("capture_ld", _i64),
        ("attention_args", cpu_attention.Args),
        ("x", _p),
        ("out_x", _p),
        ("out_res", _p),
        ("normed", _p),
        ("qkv_out", _p),
        ("attn_out", _p),
        ("o_out", _p),
        ("gate_up_out", _p),
        ("act", _p),
    ]


def _setup(lib: ctypes.CDLL) -> None:
    if lib.specserve_cpu_layer_version() != _ABI_VERSION:
        raise RuntimeError("cpu_layer library has a different ABI version")
    for name, struct in (("stack", _Stack), ("layer", _Layer)):
        fn = getattr(lib, f"specserve_cpu_layer_sizeof_{name}")
        fn.restype = _i64
        if fn() != ctypes.sizeof(struct):
            raise RuntimeError(f"cpu_layer's {name} struct differs from its ctypes mirror")
    lib.specserve_cpu_layer_stack.argtypes = [ctypes.POINTER(_Stack)]
    lib.specserve_cpu_layer_stack.restype = ctypes.c_int


_kernel = cpu_build.LazyKernel(_SOURCE, _setup, "the per-op path")


def _address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0


@dataclass(frozen=True)
class Kernels:
    """The loaded libraries' entry points the stack calls."""

    lib: ctypes.CDLL  # cpu_layer itself
    gemm: int
    gemm_bf16: int
    gemm_q: int  # 0: cpu_qgemm not loaded
    add_rms_norm: int
    silu_and_mul: int
    rope_write_kv: int
    attention: int


_kernels: Kernels | None = None


def kernels() -> Kernels | None:
    """Every library the stack needs, loaded; None where one of them is unavailable (or
    switched off: SPECSERVE_CPU_ATTENTION=torch, SPECSERVE_FUSED_OPS=0 via cpu_fused)."""
    global _kernels
    if not env.settings.fused_ops or env.settings.cpu_attention == "torch":
        return None
    if _kernels is not None:
        return _kernels
    layer, gemm, fused = _kernel.get(), cpu_gemm.kernel(), cpu_fused.kernel()
    attn, qgemm = cpu_attention.kernel(), cpu_qgemm.kernel()
    if layer is None or gemm is None or fused is None or attn is None:
        return None
    _kernels = Kernels(
        lib=layer,
        gemm=_address(gemm, "specserve_cpu_gemm"),
        gemm_bf16=_address(gemm, "specserve_cpu_gemm_bf16"),
        gemm_q=0 if qgemm is None else _address(qgemm, "specserve_cpu_qgemm"),
        add_rms_norm=_address(fused, "specserve_add_rms_norm"),
        silu_and_mul=_address(fused, "specserve_silu_and_mul"),
        rope_write_kv=_address(fused, "specserve_rope_write_kv"),
        attention=_address(attn, "specserve_cpu_attention"),
    )
    return _kernels


@dataclass(frozen=True)
class LayerParams:
    """One decoder layer's tensors, as the per-op path hands them to the kernels."""

    input_norm: torch.Tensor  # [hidden] fp32 contiguous
    post_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [ceil(((H + 2 Hkv) D) / 16), hidden, 16] panels (fp32, bf16) or blocks
    qkv_bias: torch.Tensor | None  # [(H + 2 Hkv) D]
    o: torch.Tensor  # [ceil(hidden / 16), H D, 16]
    gate_up: torch.Tensor  # [ceil(2 I / 16), hidden, 16]
    down: torch.Tensor  # [ceil(hidden / 16), I, 16]
    input_eps: float
    post_eps: float
    window: int


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


def layer_table(
    params: list[LayerParams], caches: list[KVCache]
) -> ctypes.Array[_Layer]:  # one entry per layer, reused by every forward over these caches
    table = (_Layer * len(params))()
    for entry, p, c in zip(table, params, caches, strict=True):
        entry.input_norm = p.input_norm.data_ptr()
        entry.post_norm = p.post_norm.data_ptr()
        entry.qkv = p.qkv.data_ptr()
        entry.qkv_bias = None if p.qkv_bias is None else p.qkv_bias.data_ptr()
        entry.o = p.o.data_ptr()
        entry.gate_up = p.gate_up.data_ptr()
        entry.down = p.down.data_ptr()
        entry.k_cache = c.k.data_ptr()
        entry.v_cache = c.v.data_ptr()
        entry.input_eps = p.input_eps
        entry.post_eps = p.post_eps
        entry.window = p.window
        linears = (p.qkv, p.o, p.gate_up, p.down)
        entry.kinds = sum(_KINDS[w.dtype] << (2 * i) for i, w in enumerate(linears))
    return table


def run_stack(
    k: Kernels,
    table: ctypes.Array[_Layer],
    shape: Shape,
    x: torch.Tensor,  # [T, hidden] fp32 contiguous: the embeddings
    cos_sin: torch.Tensor,  # [T, 2, 1, D] fp32, last dim contiguous
    ctx: ForwardContext,  # slot_mapping int64 contiguous
    kv_dtype: torch.dtype,  # the caches' (fp32 or bf16)
    block_size: int,  # the caches'
    scale: float,
    captures: dict[int, torch.Tensor] | None = None,  # layer -> [T, hidden] view to write
) -> tuple[torch.Tensor, torch.Tensor]:  # last layer's MLP output, residual: [T, hidden] each
    t = x.shape[0]
    n, h, hkv, d, i = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate
    widths = (n, n, n, (h + 2 * hkv) * d, h * d, n, 2 * i, i)
    buf = torch.empty(t * sum(widths), dtype=torch.float32)
    parts = [b.view(t, w) for b, w in zip(buf.split([t * w for w in widths]), widths)]
    out_x, out_res, normed, qkv, attn, o, gate_up, act = parts
    s = _Stack()
    s.gemm, s.gemm_bf16, s.gemm_q = k.gemm, k.gemm_bf16, k.gemm_q or None
    s.add_rms_norm, s.silu_and_mul = k.add_rms_norm, k.silu_and_mul
    s.rope_write_kv, s.attention = k.rope_write_kv, k.attention
    s.layers = ctypes.addressof(table)
    s.num_layers = len(table)
    s.rows, s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate = t, n, h, hkv, d, i
    s.kv_dtype = int(kv_dtype == torch.bfloat16)
    s.threads = torch.get_num_threads()
    s.cos_sin, s.cs_ld, s.cs_part = cos_sin.data_ptr(), cos_sin.stride(0), cos_sin.stride(1)
    s.slots = ctx.slot_mapping.data_ptr()
    a = s.attention_args  # q, k, v, out, rows and window are set per layer by the C++
    q_lens, c_lens, starts, tables = cpu_attention.attention_meta(ctx)
    a.block_tables, a.bt_stride = tables.data_ptr(), tables.stride(0)
    a.q_lens, a.ctx_lens, a.starts = q_lens.data_ptr(), c_lens.data_ptr(), starts.data_ptr()
    a.num_reqs, a.heads, a.kv_heads, a.head_dim = q_lens.shape[0], h, hkv, d
    a.block_size = block_size
    a.num_threads, a.scale = s.threads, scale
    s.x = x.data_ptr()
    s.out_x, s.out_res, s.normed = out_x.data_ptr(), out_res.data_ptr(), normed.data_ptr()
    s.qkv_out, s.attn_out, s.o_out = qkv.data_ptr(), attn.data_ptr(), o.data_ptr()
    s.gate_up_out, s.act = gate_up.data_ptr(), act.data_ptr()
    if captures:
        ptrs = (_p * len(table))()
        for layer, dst in captures.items():
            ptrs[layer] = dst.data_ptr()
        s.captures = ctypes.addressof(ptrs)
        s.capture_ld = next(iter(captures.values())).stride(0)
    rc = k.lib.specserve_cpu_layer_stack(ctypes.byref(s))
    if rc != 0:
        raise RuntimeError(f"cpu layer stack failed ({rc}): head_dim {d} or KV dtype {kv_dtype}")
    return out_x, out_res
