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
`SPECSERVE_CPU_LINEAR=auto|torch` (torch: F.linear everywhere).
"""

from __future__ import annotations

import torch
from torch import nn

from specserve import env
from specserve.ops import cpu_gemm


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
    """nn.Linear's forward over a weight repacked at load: fp32 in 16-row panels for the
    compiled GEMM (ops/cpu_gemm.py), else (bf16, or no compiler) oneDNN's own layout. `weight`
    reads back a dense copy (for code that initialises from it, e.g. a head's lm_head); writes
    to it go nowhere."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.lib = cpu_gemm.kernel() if weight.dtype == torch.float32 else None
        w = weight.detach().contiguous()
        if self.lib is not None:
            # bf16 values (a bf16 checkpoint): bf16 panels, half the bytes, the same products
            dt = torch.bfloat16 if cpu_gemm.bf16_exact(w) else torch.float32
            self.panels = cpu_gemm.to_panels(w, dt)  # [ceil(N / 16), K, 16]
        else:
            self.packed = w.to_mkldnn()  # [N, K], oneDNN's layout
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @property
    def weight(self) -> torch.Tensor:  # [N, K] dense copy
        if self.lib is not None:
            return cpu_gemm.from_panels(self.panels, self.out_features)
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.lib is not None:
            y = cpu_gemm.gemm(self.lib, x2, self.panels, self.bias, self.out_features)
        else:
            y = _onednn(x2, self.packed, self.bias)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        kind = f"panels {self.panels.dtype}" if self.lib is not None else "oneDNN"
        return f"{self.in_features}, {self.out_features}, packed={kind}"


def pack_linears(model: nn.Module) -> nn.Module:
    """Swap the model's dense linear layers for PackedLinear in place, and give a tied model a
    packed lm_head (LlamaForCausalLM.compute_logits calls `lm_head` when set). Layers where
    packing does not apply (module doc) stay as they are. Returns the model."""
    if env.settings.cpu_linear == "torch":
        return model
    count = 0
    for mod in list(model.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear) and _packable(child.weight):
                setattr(mod, name, PackedLinear(child.weight, child.bias))
                count += 1
    embed = getattr(model, "embed_tokens", None)
    if count and getattr(model, "lm_head", "absent") is None and embed is not None:
        model.lm_head = PackedLinear(embed.weight, None)
    return model


def _packable(w: torch.Tensor) -> bool:
    return w.device.type == "cpu" and packing_available(w.dtype)
