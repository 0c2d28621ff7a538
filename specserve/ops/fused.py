"""Fused elementwise ops of the decoder layer: Triton kernels on CUDA, plain torch elsewhere.

Why: batch-1 decode on a GPU is launch-bound between the matmuls. Unfused, each layer spends a
dozen tiny kernels on RMSNorm, the residual adds, rotary (roll/mul/mul/add) and silu/mul; fused,
that is four launches (add+norm twice, one rotary over q and k that also writes k and v to the
KV cache, silu-and-mul).

Dispatch, per call: the Triton kernel when the tensor is on CUDA, triton is importable
(`use_triton`) and `env.settings.fused_ops` (read at call time, so a test or benchmark can force
the reference on CUDA with `env.override`; a captured CUDA graph keeps the path it was captured
with).
Otherwise the torch reference below runs: exactly the ops the model used before fusion, so CPU
numerics (checked against HF transformers) do not change.

Safe to import without triton: `specserve.ops.triton_fused` is imported on first kernel use.
Nothing here syncs with the device, and every launch depends only on shapes, so all of it is
CUDA-graph capturable.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from specserve import env
from specserve.ops import cpu_fused
from specserve.ops.attention import write_kv
from specserve.ops.forward_context import KVCache
from specserve.ops.pdl import launch_options
from specserve.ops.triton_attention import use_triton


def fused_enabled(x: torch.Tensor) -> bool:
    """True when the Triton path should run for tensors like `x` (see the module docstring)."""
    return x.is_cuda and env.settings.fused_ops and use_triton(x.device)


def records_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records an op on these tensors. The kernels have no backward: a kernel
    output would be a constant to autograd and cut every parameter before it off its gradient
    (head training), so such calls run the torch reference."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# The dispatchers look this up per call (module global), so a test can point it at a predicate
# that also accepts CPU tensors to run the kernels under TRITON_INTERPRET=1.
_enabled = fused_enabled


@functools.lru_cache(maxsize=1)
def _kernels() -> ModuleType:
    from specserve.ops import triton_fused

    return triton_fused


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- torch references: the CPU path, and the oracle for the kernels ----------------------------


def add_rms_norm_reference(
    x: torch.Tensor,  # [T, N]
    residual: torch.Tensor | None,  # [T, N]
    weight: torch.Tensor,  # [N]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, N], new residual [T, N]
    if residual is not None:
        x = x + residual
    # One fused op instead of pow/mean/rsqrt/mul/mul: decode on CPU is bound by op count.
    return F.rms_norm(x, (x.shape[-1],), weight, eps), x


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Neox rotate-half rotary: x [T, heads, D], cos_sin [T, 2, 1, D] -> new [T, heads, D]."""
    rotated = torch.roll(x, x.shape[-1] // 2, dims=-1)  # [x2, x1]
    return x * cos_sin[:, 0] + rotated * cos_sin[:, 1]


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    i = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :i]) * gate_up[:, i:]


# -- dispatchers ---------------------------------------------------------------------------------
# Each runs the Triton kernel where `_enabled`, else the compiled CPU op (ops/cpu_fused.py) where
# it serves the layout, else the torch reference.


def _cpu_rows_ok(x: torch.Tensor) -> bool:  # [T, N] with contiguous rows
    return x.dim() == 2 and x.stride(-1) == 1


def _cpu_norm_ok(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    if residual is None:
        return _cpu_rows_ok(x) and weight.is_contiguous() and cpu_fused.usable(x, weight)
    return (
        _cpu_rows_ok(x)
        and residual.shape == x.shape
        and residual.stride(-1) == 1
        and weight.is_contiguous()
        and cpu_fused.usable(x, residual, weight)
    )


def _cpu_rope_ok(
    qkv: torch.Tensor, cos_sin: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor
) -> bool:
    d = qkv.shape[-1]
    return (
        d % 2 == 0
        and d <= cpu_fused.MAX_HEAD_DIM
        and qkv.stride(-1) == 1
        and qkv.stride(1) == d
        and cos_sin.stride(-1) == 1
        and cache.k.is_contiguous()
        and cache.v.is_contiguous()
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and slot_mapping.device.type == "cpu"
        # an fp32 model's cache may be bf16 (kv_cache_dtype): the kernel rounds as torch does
        and cache.k.dtype == cache.v.dtype
        and cache.k.dtype in (torch.float32, torch.bfloat16)
        and cache.k.device.type == "cpu"
        and cpu_fused.usable(qkv, cos_sin)
    )


def add_rms_norm(
    x: torch.Tensor,  # [T, N], last dim contiguous
    residual: torch.Tensor | None,  # [T, N], or None: no add (first layer)
    weight: torch.Tensor,  # [N]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, N], new residual [T, N]
    """new_residual = x + residual (rounded to x's dtype), normed = rms_norm(new_residual) * weight.

    With residual=None: (rms_norm(x) * weight, x).
    """
    if not (
        _enabled(x)
        and not records_grad(x, residual, weight)
        and x.dim() == 2
        and x.stride(-1) == 1
        and weight.dtype == x.dtype
        and weight.is_contiguous()
    ):
        if _cpu_norm_ok(x, residual, weight):
            return cpu_fused.add_rms_norm(x, residual, weight, eps)
        return add_rms_norm_reference(x, residual, weight, eps)
    t, n = x.shape
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if residual is None:
        new_res, res, stride_r = x, x, 0  # res/new_res unused by the kernel
    else:
        assert residual.shape == x.shape and residual.stride(-1) == 1, (x.shape, residual.shape)
        new_res = torch.empty((t, n), dtype=x.dtype, device=x.device)
        res, stride_r = residual, residual.stride(0)
    if t == 0:
        return out, new_res
    block = _pow2(n)
    _kernels()._add_rms_norm_kernel[(t,)](
        x, res, weight, out, new_res, x.stride(0), stride_r, n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        # More warps for wide rows: at batch 1 one program does the whole row, so its latency is
        # the kernel's. (Heuristic, not tuned per GPU.)
        num_warps=8 if block >= 4096 else 4 if block >= 1024 else 2, **launch_options(x),
    )  # fmt: skip
    return out, new_res


def rope_(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotary over x [T, heads, D] with cos_sin [T, 2, 1, D] (as `apply_rope`).

    On the fused path x is rotated IN PLACE and returned; on the reference path a new tensor is
    returned and x is left alone. Either way use the return value, and do not reuse x after.
    x may be a strided view (e.g. q and k together, a column slice of the qkv projection: rows
    of stride (H + 2 Hkv) * D); only its last dim must be contiguous.
    """
    t, nh, d = x.shape
    if not (
        _enabled(x)
        and not records_grad(x)
        and x.stride(-1) == 1
        and cos_sin.stride(-1) == 1
        and d % 2 == 0
    ):
        return apply_rope(x, cos_sin)
    assert cos_sin.shape == (t, 2, 1, d), (x.shape, cos_sin.shape)
    if t == 0 or nh == 0:
        return x
    half = d // 2
    block_half = _pow2(half)
    # ~2k elements per half-tile per program: decode (T=1) still spreads 40 heads x 128 over a
    # few programs, prefill gets one or two programs per row.
    block_h = min(_pow2(nh), max(1, 2048 // block_half))
    _kernels()._rope_kernel[(t, _cdiv(nh, block_h))](
        x, cos_sin, x.stride(0), x.stride(1), cos_sin.stride(0), cos_sin.stride(1), nh,
        HALF=half, BLOCK_HALF=block_half, BLOCK_H=block_h,
        num_warps=4 if block_h * block_half >= 1024 else 2, **launch_options(x),
    )  # fmt: skip
    return x


def rope_write_kv_(
    qkv: torch.Tensor,  # [T, H + 2 Hkv, D]: the qkv projection output, last dim contiguous
    num_q_heads: int,
    cos_sin: torch.Tensor,  # [T, 2, 1, D]
    cache: KVCache,
    slot_mapping: torch.Tensor,  # [T] int64, negative = padding row
    all_valid: bool | None = None,
) -> torch.Tensor:  # q [T, H, D], rotated
    """Rotary over q and k, then k and v into their cache slots (as `rope_` + `write_kv`).

    On the fused path one kernel does it all (one launch fewer per layer: batch-1 decode is
    launch-bound between the matmuls); q is rotated in place and returned as a view of qkv, and
    the k columns of qkv are left unrotated (only the cache is read after this).
    """
    t, nh, d = qkv.shape
    hkv = (nh - num_q_heads) // 2
    fused = (
        _enabled(qkv)
        and not records_grad(qkv)
        and qkv.stride(-1) == 1
        and cos_sin.stride(-1) == 1
        and d % 2 == 0
        and cache.k.stride(-1) == 1
        and cache.v.stride(-1) == 1
    )
    if not fused:
        if _cpu_rope_ok(qkv, cos_sin, cache, slot_mapping):
            return cpu_fused.rope_write_kv_(qkv, num_q_heads, cos_sin, cache, slot_mapping)
        qk = rope_(qkv[:, : num_q_heads + hkv], cos_sin)
        write_kv(qk[:, num_q_heads:], qkv[:, num_q_heads + hkv :], cache, slot_mapping, all_valid)
        return qk[:, :num_q_heads]
    assert cos_sin.shape == (t, 2, 1, d), (qkv.shape, cos_sin.shape)
    assert cache.k.shape[2:] == (hkv, d), (qkv.shape, cache.k.shape)
    if t == 0:
        return qkv[:, :num_q_heads]
    half = d // 2
    block_half = _pow2(half)
    block_h = min(_pow2(nh), max(1, 2048 // block_half))  # as in rope_
    _kernels()._rope_write_kv_kernel[(t, _cdiv(nh, block_h))](
        qkv, cos_sin, cache.k, cache.v, slot_mapping,
        qkv.stride(0), qkv.stride(1), cos_sin.stride(0), cos_sin.stride(1),
        cache.k.stride(0), cache.k.stride(1), cache.k.stride(2),
        cache.v.stride(0), cache.v.stride(1), cache.v.stride(2),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=hkv, HALF=half, BLOCK_HALF=block_half,
        BLOCK_H=block_h, PAGE=cache.block_size,
        num_warps=4 if block_h * block_half >= 1024 else 2, **launch_options(qkv),
    )  # fmt: skip
    return qkv[:, :num_q_heads]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """silu(gate) * up, for gate and up side by side in the fused gate_up projection output."""
    if not (
        _enabled(gate_up)
        and not records_grad(gate_up)
        and gate_up.dim() == 2
        and gate_up.stride(-1) == 1
    ):
        if _cpu_rows_ok(gate_up) and cpu_fused.usable(gate_up):
            return cpu_fused.silu_and_mul(gate_up)
        return silu_and_mul_reference(gate_up)
    t, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(_pow2(inter), 1024)
    _kernels()._silu_and_mul_kernel[(t, _cdiv(inter, block))](
        gate_up,
        out,
        gate_up.stride(0),
        inter,
        BLOCK=block,
        num_warps=4,
        **launch_options(gate_up),
    )
    return out
