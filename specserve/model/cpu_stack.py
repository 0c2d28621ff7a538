"""The decoder layers of a CPU forward in one compiled call (ops/cpu_layer.py), where it applies.

Batch-1 decode of the default model on a 2-core CPU spends ~20 ms a step in the GEMMs and
~4 ms in the Python between its ~150 kernel calls (module calls, dispatch checks, tensor
allocation, ctypes argument conversion). The stack runs the same kernels in the same order on
raw pointers, so its outputs equal the per-op path's bit for bit, without that Python.

Where: `LlamaForCausalLM.forward` asks `stack_for` every forward. It applies only where the
per-op path would itself run exactly the compiled kernels the stack calls:
  * SPECSERVE_CPU_LAYER=auto (off: never);
  * CPU, fp32 hidden states, every decoder linear a PackedLinear over panels (cpu_gemm) or
    integer blocks (cpu_qgemm): so not under `quantization` (int8 / int4 swap the layers, even
    after a first forward: the layers' identity is checked each forward), not dtype bf16, not
    tensor parallel (sharded layers are plain Linear), not SPECSERVE_CPU_LINEAR=torch, and a
    compiler;
  * the compiled elementwise ops (SPECSERVE_FUSED_OPS) and the attention kernel
    (SPECSERVE_CPU_ATTENTION != torch), both built;
  * no per-head q/k norm (Qwen3: torch's rms_norm runs between the kernels there);
  * model/llama.py's own module classes (a subclass may change a forward);
  * no autograd recording (the target's forward runs under inference_mode; head training
    differentiates through its head's own layers, never these);
  * fp32 or bf16 caches, contiguous; slot_mapping int64 and contiguous.
EAGLE-3's capture of layer inputs (aux_capture.py) is written inside the call. CUDA keeps its
Triton kernels and graphs; everything else keeps the per-op loop.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from specserve import env
from specserve.model.aux_capture import AuxCapture
from specserve.model.cpu_linear import PackedLinear
from specserve.ops import cpu_fused, cpu_layer
from specserve.ops.forward_context import ForwardContext, KVCache

if TYPE_CHECKING:
    from specserve.model.llama import LlamaForCausalLM


def _linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    """qkv, o, gate_up, down of a decoder layer: plain dict reads, no nn.Module.__getattr__
    (this runs every forward)."""
    attn, mlp = layer._modules["self_attn"]._modules, layer._modules["mlp"]._modules
    return attn["qkv_proj"], attn["o_proj"], mlp["gate_up_proj"], mlp["down_proj"]


@dataclass
class _Plan:
    """What one model's layers are, checked once; `params` None: the stack does not apply."""

    # every layer's four linears, to notice a swap (quantization); weak: a plan keeps no module
    # alive (a tensor-parallel layer holds its group, whose workers end with the engine)
    linears: list[weakref.ref[nn.Module]]
    params: list[cpu_layer.LayerParams] | None
    shape: cpu_layer.Shape | None
    scale: float = 0.0
    # the caches (dtype, shape, k and v pointers of every layer) -> the kernel's layer table
    tables: dict[tuple[object, ...], ctypes.Array] = field(default_factory=dict)

    def current(self, model: LlamaForCausalLM) -> bool:
        now = [m for layer in model.layers for m in _linears(layer)]
        return len(now) == len(self.linears) and all(
            a is b() for a, b in zip(now, self.linears, strict=True)
        )


def _panels(m: nn.Module, bias_ok: bool) -> bool:
    # fp32 or bf16 panels (cpu_gemm), or integer blocks (cpu_qgemm)
    return (
        type(m) is PackedLinear
        and m.lib is not None
        and (m.panels.dtype in (torch.float32, torch.bfloat16) or m.qlib is not None)
        and (bias_ok or m.bias is None)
    )


def _dims(attn: nn.Module) -> tuple[int, int, int]:
    return attn.num_heads, attn.num_kv_heads, attn.head_dim


def _norm_ok(norm: nn.Module) -> bool:
    from specserve.model.layers import RMSNorm

    w = norm.weight
    return type(norm) is RMSNorm and w.dtype == torch.float32 and w.is_contiguous()


def _build_plan(model: LlamaForCausalLM) -> _Plan:
    from specserve.model.layers import GatedMLP
    from specserve.model.llama import Attention, DecoderLayer

    layers = list(model.layers)
    linears = [weakref.ref(m) for layer in layers for m in _linears(layer)]
    off = _Plan(linears, None, None)
    if not layers:
        return off
    a0 = layers[0].self_attn
    d = a0.head_dim
    if d % 2 or d > cpu_fused.MAX_HEAD_DIM or a0.num_heads % a0.num_kv_heads:
        return off
    params = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not (
            type(layer) is DecoderLayer
            and type(attn) is Attention
            and type(mlp) is GatedMLP
            and not attn.qk_norm
            and _dims(attn) == _dims(a0)
            and _panels(attn.qkv_proj, bias_ok=True)
            and _panels(attn.o_proj, bias_ok=False)
            and _panels(mlp.gate_up_proj, bias_ok=False)
            and _panels(mlp.down_proj, bias_ok=False)
            and _norm_ok(layer.input_layernorm)
            and _norm_ok(layer.post_attention_layernorm)
        ):
            return off
        bias = attn.qkv_proj.bias
        if bias is not None and not (bias.dtype == torch.float32 and bias.is_contiguous()):
            return off
        params.append(
            cpu_layer.LayerParams(
                input_norm=layer.input_layernorm.weight,
                post_norm=layer.post_attention_layernorm.weight,
                qkv=attn.qkv_proj.panels,
                qkv_bias=bias,
                o=attn.o_proj.panels,
                gate_up=mlp.gate_up_proj.panels,
                down=mlp.down_proj.panels,
                input_eps=layer.input_layernorm.eps,
                post_eps=layer.post_attention_layernorm.eps,
                window=attn.window,
            )
        )
    mlp0 = layers[0].mlp
    shape = cpu_layer.Shape(
        hidden=mlp0.down_proj.out_features,
        heads=a0.num_heads,
        kv_heads=a0.num_kv_heads,
        head_dim=d,
        intermediate=mlp0.intermediate_size,
    )
    return _Plan(linears, params, shape, a0.scale)


def _caches_ok(caches: list[KVCache]) -> bool:
    dt = caches[0].k.dtype
    return dt in (torch.float32, torch.bfloat16) and all(
        c.k.dtype == dt
        and c.v.dtype == dt
        and c.k.device.type == "cpu"
        and c.k.is_contiguous()
        and c.v.is_contiguous()
        and c.k.shape == caches[0].k.shape
        and c.v.shape == c.k.shape
        for c in caches
    )


@dataclass
class Stack:
    """A forward's decoder layers as one call."""

    kernels: cpu_layer.Kernels
    plan: _Plan
    table: ctypes.Array

    def run(
        self,
        x: torch.Tensor,  # [T, hidden] embeddings
        cos_sin: torch.Tensor,  # [T, 2, 1, D]
        caches: list[KVCache],
        ctx: ForwardContext,
        capture: AuxCapture | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # last MLP output, residual stream: [T, hidden]
        targets = None if capture is None else capture.targets(x.shape[0], len(caches))
        c = caches[0]
        return cpu_layer.run_stack(
            self.kernels, self.table, self.plan.shape, x, cos_sin, ctx, c.k.dtype,
            c.block_size, self.plan.scale, targets,
        )  # fmt: skip


# model -> its plan; beside the model rather than on it, so that the model still deep-copies
# (ctypes tables cannot be) and a copy builds its own
_plans: weakref.WeakKeyDictionary[nn.Module, _Plan] = weakref.WeakKeyDictionary()


def stack_for(
    model: LlamaForCausalLM,
    x: torch.Tensor,  # [T, hidden]
    cos_sin: torch.Tensor,  # [T, 2, 1, D]
    caches: list[KVCache],
    ctx: ForwardContext,
) -> Stack | None:
    """The compiled stack for this forward, or None: run the per-op layers (module doc)."""
    if env.settings.cpu_layer == "off" or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    if not x.shape[0] or not x.is_contiguous() or not cos_sin.is_contiguous():
        return None
    slots = ctx.slot_mapping
    if slots.dtype != torch.int64 or not slots.is_contiguous() or slots.device.type != "cpu":
        return None
    if torch.is_grad_enabled() or not caches:
        return None
    plan = _plans.get(model)
    if plan is None or not plan.current(model):
        plan = _plans[model] = _build_plan(model)
    if plan.params is None:
        return None
    kernels = cpu_layer.kernels()
    if kernels is None:
        return None
    k0 = caches[0].k
    key = (k0.dtype, k0.shape, *(p for c in caches for p in (c.k.data_ptr(), c.v.data_ptr())))
    table = plan.tables.get(key)
    if table is None:
        if len(caches) != len(plan.params) or not _caches_ok(caches):
            return None
        plan.tables.clear()  # caches reallocated: the old ones are gone
        table = plan.tables[key] = cpu_layer.layer_table(plan.params, caches)
    return Stack(kernels, plan, table)
