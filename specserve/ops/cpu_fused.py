"""The decoder layer's elementwise ops on the CPU in one compiled call each (cpu_fused.cpp):
add + RMSNorm, rotary + KV write, silu-and-mul; and the greedy sampler's row argmax.
ops/fused.py dispatches here for fp32 CPU tensors when `SPECSERVE_FUSED_OPS` is on and no
autograd graph is being recorded (head training keeps the torch ops).

Why: on a small CPU, batch-1 decode of the default model spends ~2 ms a step on these ops in
torch (each a handful of ops of a few microseconds of dispatch), against ~14 ms of weight reads;
torch's argmax over [64, 49152] logits takes ~1.1 ms on one thread.

Built on first use by ops/cpu_build.py; no compiler: one warning, the torch ops.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from specserve import env
from specserve.ops import cpu_build
from specserve.ops.forward_context import KVCache

_SOURCE = Path(__file__).with_name("cpu_fused.cpp")
_ABI_VERSION = 3
MAX_HEAD_DIM = 512  # kMaxHeadDim of the rotary


def _setup(lib: ctypes.CDLL) -> None:
    if lib.specserve_cpu_fused_version() != _ABI_VERSION:
        raise RuntimeError("cpu_fused library has a different ABI version")
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.specserve_add_rms_norm.argtypes = [p, i64, p, i64, p, p, p, i32, i32, f32, i32]
    lib.specserve_add_rms_norm.restype = None
    lib.specserve_silu_and_mul.argtypes = [p, i64, p, i32, i32, i32]
    lib.specserve_silu_and_mul.restype = None
    lib.specserve_rope_write_kv.argtypes = [
        p, i64, i32, i32, i32, p, i64, i64, p, p, i32, p, i32, i32,
    ]  # fmt: skip
    lib.specserve_rope_write_kv.restype = ctypes.c_int
    lib.specserve_argmax_rows.argtypes = [p, i64, i32, i32, p, i32]
    lib.specserve_argmax_rows.restype = None


# rotary: exact torch roundings, so no multiply-add contraction
_kernel = cpu_build.LazyKernel(_SOURCE, _setup, "the torch ops", ("-ffp-contract=off",))


def kernel() -> ctypes.CDLL | None:
    return _kernel.get()


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the compiled ops serve these tensors (the caller checks layouts)."""
    return (
        env.settings.fused_ops
        and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        and kernel() is not None
    )


def add_rms_norm(
    x: torch.Tensor,  # [T, N], last dim contiguous
    residual: torch.Tensor | None,  # [T, N], last dim contiguous
    weight: torch.Tensor,  # [N] contiguous
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, N], new residual [T, N]
    t, n = x.shape
    out = torch.empty(t, n)
    new_res = x if residual is None else torch.empty(t, n)
    if t:
        _kernel.get().specserve_add_rms_norm(
            x.data_ptr(), x.stride(0),
            None if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0),
            weight.data_ptr(), out.data_ptr(), new_res.data_ptr(), t, n, eps,
            torch.get_num_threads(),
        )  # fmt: skip
    return out, new_res


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I], last dim contiguous -> [T, I]
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2)
    if t:
        _kernel.get().specserve_silu_and_mul(
            gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), t, two_i // 2,
            torch.get_num_threads(),
        )  # fmt: skip
    return out


def rope_write_kv_(
    qkv: torch.Tensor,  # [T, H + 2 Hkv, D], heads contiguous within a row
    num_q_heads: int,
    cos_sin: torch.Tensor,  # [T, 2, 1, D], last dim contiguous
    cache: KVCache,  # fp32 or bf16, contiguous
    slot_mapping: torch.Tensor,  # [T] int64 contiguous, negative = padding row
) -> torch.Tensor:  # q [T, H, D]: rotated in place, a view of qkv
    t, nh, d = qkv.shape
    hkv = (nh - num_q_heads) // 2
    if t:
        rc = _kernel.get().specserve_rope_write_kv(
            qkv.data_ptr(), qkv.stride(0), num_q_heads, hkv, d,
            cos_sin.data_ptr(), cos_sin.stride(0), cos_sin.stride(1),
            cache.k.data_ptr(), cache.v.data_ptr(), int(cache.k.dtype == torch.bfloat16),
            slot_mapping.data_ptr(), t,
            torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"cpu rope_write_kv: unsupported head_dim {d}")
    return qkv[:, :num_q_heads]


def argmax(x: torch.Tensor) -> torch.Tensor:  # [T, V] -> [T] int64, torch.argmax(x, -1)
    """torch.argmax over the last dim (first index of the maximum; a NaN row: its first NaN)."""
    if not (x.dim() == 2 and x.stride(-1) == 1 and usable(x)):
        return x.argmax(dim=-1)
    t, v = x.shape
    out = torch.empty(t, dtype=torch.int64)
    if t and v:
        _kernel.get().specserve_argmax_rows(
            x.data_ptr(), x.stride(0), t, v, out.data_ptr(), torch.get_num_threads()
        )
    elif t:
        return x.argmax(dim=-1)  # torch's error for an empty dim
    return out
