"""Linear layers of a CPU engine on oneDNN, weights packed once at load.

torch's CPU `F.linear` (MKL) streams a weight at ~15 GB/s on the project's 2-core Zen 4, where a
plain reduction reads 48 GB/s; oneDNN's matmul over a weight held as an `mkldnn` tensor (its own
layout) reads it at 25-43 GB/s. Decode at batch 1 is those weight reads, so the swap halves the
GEMM time of a step. Measured with 2 threads, 30 distinct weights streamed from DRAM (one
`lm_head`), ms per pass, `F.linear` -> packed:

| weight [N, K] | 1 row | 5 rows | 64 rows |
|---|---|---|---|
| 3072 x 576 (gate_up) x 30 | 13.7 -> 5.5 | 20.0 -> 8.2 | 44.5 -> 22.9 |
| 576 x 1536 (down) x 30 | 5.7 -> 4.0 | 6.7 -> 4.6 | 22.8 -> 12.9 |
| 960 x 576 (qkv) x 30 | 4.7 -> 2.4 | 5.8 -> 2.8 | 15.0 -> 9.1 |
| 49152 x 576 (lm_head) | 7.6 -> 3.4 | 13.4 -> 4.3 | 31.1 -> 11.2 |

Numerics: fp32 accumulation as before (max error against fp64 ~4e-6 on these shapes, F.linear
~2e-6); neither backend makes a row's result independent of the rows beside it.

Which engines: CPU, dtype float32 (bfloat16 where oneDNN has native bf16), no `quantization`
(it swaps the same layers for int8/int4 ones) and no tensor parallelism (its sharded layers
keep F.linear). The target, a separate draft model and an EAGLE-3 head drafting in the engine
are packed (quant.drafter_linears; a head being trained keeps nn.Linear). A tied lm_head gets a packed copy of the embedding (the lookup keeps the
dense rows): +vocab x hidden weights of memory, 113 MB for the default model.

Integer blocks: a target loaded from a GGUF keeps its Q4_1 and Q8_0 tensors (the default
model's 210 Q4_1 tensors in 120 fused layers, its tied head Q8_0) as integer blocks for
ops/cpu_qgemm.py where the CPU has AVX512-VNNI: 1 byte a weight a step instead of 4, fp32-grade
products of the same d q + m the fp32 weights hold. A layer whose shards are not all blocks, or
whose shape is not whole tiles, keeps the panels.
`SPECSERVE_CPU_LINEAR=auto|panels|torch` (panels: never blocks; torch: F.linear everywhere).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specserve import env
from specserve.model.gguf_blocks import Blocks, gguf_blocks, joined
from specserve.ops import cpu_gemm, cpu_qgemm


def packing_available(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # dense [T, K] in, dense [T, N] out; the op inductor's CPU backend emits for packed linears
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """nn.Linear's forward over a weight repacked at load: integer blocks (`blocks` given, fp32,
    ops/cpu_qgemm.py; `panels` then holds their bytes, uint8), else fp32 in 16-row panels for
    the compiled GEMM (ops/cpu_gemm.py), else (bf16, or no compiler) oneDNN's own layout.
    `weight` reads back a dense copy (for code that initialises from it, e.g. a head's lm_head);
    writes to it go nowhere."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, blocks: Blocks | None = None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.lib = cpu_gemm.kernel() if weight.dtype == torch.float32 else None
        self.qlib = cpu_qgemm.kernel() if self.lib is not None and blocks is not None else None
        w = weight.detach().contiguous()
        if self.qlib is not None:
            self.panels = cpu_qgemm.pack(blocks)  # [bytes] uint8
        elif self.lib is not None:
            # bf16 values (a bf16 checkpoint): bf16 panels, half the bytes, the same products
            dt = torch.bfloat16 if cpu_gemm.bf16_exact(w) else torch.float32
            self.panels = cpu_gemm.to_panels(w, dt)  # [ceil(N / 16), K, 16]
        else:
            self.packed = w.to_mkldnn()  # [N, K], oneDNN's layout
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @property
    def weight(self) -> torch.Tensor:  # [N, K] dense copy
        if self.qlib is not None:
            return cpu_qgemm.unpack(self.panels, self.out_features, self.in_features)
        if self.lib is not None:
            return cpu_gemm.from_panels(self.panels, self.out_features)
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.qlib is not None:
            y = cpu_qgemm.gemm(self.qlib, x2, self.panels, self.bias, self.out_features)
        elif self.lib is not None:
            y = cpu_gemm.gemm(self.lib, x2, self.panels, self.bias, self.out_features)
        else:
            y = _onednn(x2, self.packed, self.bias)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        kind = f"panels {self.panels.dtype}" if self.lib is not None else "oneDNN"
        kind = "integer blocks" if self.qlib is not None else kind
        return f"{self.in_features}, {self.out_features}, packed={kind}"


def pack_linears(model: nn.Module, gguf: Path | None = None) -> nn.Module:
    """Swap the model's dense linear layers for PackedLinear in place, and give a tied model a
    packed lm_head (LlamaForCausalLM.compute_logits calls `lm_head` when set). `gguf`: the file
    the model was loaded from, whose Q4_1 / Q8_0 tensors become integer blocks. Layers where
    packing does not apply (module doc) stay as they are. Returns the model."""
    if env.settings.cpu_linear == "torch":
        return model
    source = _block_source(model, gguf)
    count = 0
    for mod_name, mod in list(model.named_modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear) and _packable(child.weight):
                full = f"{mod_name}.{name}" if mod_name else name
                blocks = _blocks(model, full, child.weight, source)
                setattr(mod, name, PackedLinear(child.weight, child.bias, blocks))
                count += 1
    embed = getattr(model, "embed_tokens", None)
    if count and getattr(model, "lm_head", "absent") is None and embed is not None:
        blocks = _blocks(model, "lm_head", embed.weight, source)
        model.lm_head = PackedLinear(embed.weight, None, blocks)
    return model


def _block_source(model: nn.Module, gguf: Path | None) -> dict[str, list]:
    if gguf is None or env.settings.cpu_linear != "auto" or cpu_qgemm.kernel() is None:
        return {}
    return gguf_blocks(model, gguf, ("q4_1", "q8_0"))


def _blocks(model: nn.Module, name: str, weight: torch.Tensor, source: dict) -> Blocks | None:
    if weight.dtype != torch.float32 or not cpu_qgemm.packable(*weight.shape):
        return None
    return joined(model, name, weight, source.get(name, []))


def _packable(w: torch.Tensor) -> bool:
    return w.device.type == "cpu" and packing_available(w.dtype)
