"""`quantization=` on the CPU: the model's linear layers (and its lm_head) with int8 weights.

  "int8"  weight-only: int8 weights per output channel. Where the CPU has AVX512-VNNI they run
          as integer blocks (ops/cpu_qgemm.py: each row's scale as its blocks' d, m = 0): exact
          integer sums of fp32-grade activations, so a row's result never depends on the rows
          beside it (a prefix-cache hit, chunking or speculation cannot change greedy outputs).
          Elsewhere bf16 activations into torch's kernels (ops/int8.py), which differ in the
          last bits past 8 rows.
  "w8a8"  int8 weights and int8 activations (per row, quantized on the fly), int32 accumulation
  "int4"  weight-only, 4-bit groups of 32 (GGUF Q4_1 re-encoded exactly): model/quant_int4.py

Everything else (embedding lookup, norms, attention, KV cache, residual stream, logits) stays in
the engine's dtype. With tied embeddings the lm_head gets its own int8 copy of the embedding
matrix; the lookup keeps reading the full-precision rows (one row per token: cheap).
Kernels and measurements: specserve/ops/int8.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from specserve import env
from specserve.config import QUANTIZATION_METHODS
from specserve.model.cpu_linear import pack_linears
from specserve.ops import cpu_qgemm
from specserve.ops.int8 import dynamic_int8_linear, quantize_per_row, weight_only_linear


class Int8Linear(nn.Module):
    """A linear layer whose weight is int8 per output channel (see the module doc)."""

    def __init__(
        self,
        weight: torch.Tensor,  # [N, K] float
        bias: torch.Tensor | None,
        method: str,
    ) -> None:
        super().__init__()
        if method not in QUANTIZATION_METHODS or method == "int4":
            raise ValueError(f"unknown quantization {method!r}")
        self.method = method
        self.out_features, self.in_features = weight.shape
        q, scale = quantize_per_row(weight)
        self.register_buffer("scale", scale)  # [N] float32
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        n, k = weight.shape
        self.qlib = None
        if method == "int8" and weight.dtype == torch.float32 and cpu_qgemm.packable(n, k):
            self.qlib = cpu_qgemm.kernel() if env.settings.cpu_linear == "auto" else None
        if self.qlib is not None:
            d = scale[:, None].expand(n, k // cpu_qgemm.BLOCK).contiguous()  # [N, K / 32]
            self.register_buffer("blocks", cpu_qgemm.pack((q, d, torch.zeros_like(d))))
            return
        self.register_buffer("qweight", q)  # [N, K] int8
        if method == "int8":
            # the many-row path's GEMM operand: q's integers, exact in bf16
            self.register_buffer("qweight_bf16", q.to(torch.bfloat16))
            self.register_buffer("unit", torch.ones(self.out_features, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.qlib is not None:
            y = cpu_qgemm.gemm(self.qlib, x2.float(), self.blocks, self.bias, self.out_features)
            return y.to(x.dtype).view(*lead, self.out_features)
        if self.method == "int8":
            y = weight_only_linear(x2, self.qweight, self.qweight_bf16, self.scale, self.unit)
        else:
            y = dynamic_int8_linear(x2, self.qweight.t(), self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        kernel = ", integer blocks" if self.qlib is not None else ""
        return f"{self.in_features}, {self.out_features}, method={self.method}{kernel}"


def quantize_model(model: nn.Module, method: str, gguf: Path | None = None) -> nn.Module:
    """Swap every nn.Linear of `model` for an Int8Linear, in place, and give a tied model an
    int8 lm_head (LlamaForCausalLM.compute_logits calls `lm_head` when it is set). "int4": the
    same with Int4Linear; `gguf` is the file the model came from, if it is one."""
    if method == "int4":
        from specserve.model.quant_int4 import quantize_model_int4

        return quantize_model_int4(model, gguf)
    for mod in list(model.modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear):
                setattr(mod, child_name, Int8Linear(child.weight, child.bias, method))
    if getattr(model, "lm_head", "absent") is None:
        model.lm_head = Int8Linear(model.embed_tokens.weight, None, method)
    return model


def quantize_engine(engine: Any) -> None:
    """Quantize a freshly built engine's target model (shared with its runner and a self-drafting
    drafter), and re-measure its verify budget's step-cost curve on the quantized model (not
    cached: the cache key knows dtypes, not quantization). LLM(...) and `specserve serve` call
    it right after building the engine, before any request; inside LLMEngine, right after
    load_model, it would spare the fp32 calibration."""
    method = engine.config.quantization
    if method is None:
        return
    gguf = gguf_source(engine.config.model, engine.config.revision) if method == "int4" else None
    quantize_model(engine.target_model, method, gguf)
    if getattr(engine, "budget", None) is not None:
        from specserve.speculative.verify_budget import VerifyBudget

        engine.budget = VerifyBudget.for_engine(engine, None)


def drafter_linears(model: nn.Module, method: str | None) -> nn.Module:
    """A drafter's own weights (an EAGLE-3 head, a draft model other than the target) on the
    CPU: packed as the target's, or quantized with it (int8 under int4: no GGUF blocks to keep).
    """
    if method is None:
        return pack_linears(model)
    return quantize_model(model, "int8" if method == "int4" else method)


def gguf_source(model: str | None, revision: str | None) -> Path | None:
    """The GGUF file the engine's model was loaded from (None: the default model's), or None."""
    from specserve.model.loader import default_model_path, resolve_model_path
    from specserve.model.loader.dummy import DUMMY_PREFIX

    if model is None:
        return default_model_path()
    if model.startswith(DUMMY_PREFIX):
        return None
    path = resolve_model_path(model, revision)
    return path if path.is_file() and path.suffix.lower() == ".gguf" else None
