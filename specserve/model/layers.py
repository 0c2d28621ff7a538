"""Building blocks shared by the Llama family: linear, RMSNorm, rotary embedding, gated SiLU MLP.

The elementwise work goes through `specserve.ops.fused`: Triton kernels on CUDA, the plain torch
ops on CPU (unchanged numerics there). Linear layers go through `specserve.ops.gemv` (on Hopper
a Triton GEMV for one row and a rows kernel up to 16, F.linear everywhere else; there the MLP's
gate_up projection and silu-and-mul are one launch).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model.errors import ModelLoadError
from specserve.ops.fused import add_rms_norm, silu_and_mul
from specserve.ops.gemv import gemv_glu, glu_eligible, linear


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) whose few-row calls may run the GEMV."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        # One fused op instead of pow/mean/rsqrt/mul/mul: decode on CPU is bound by op count.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_forward(
        self,
        x: torch.Tensor,  # [T, dim]
        residual: torch.Tensor | None,  # [T, dim], None: nothing to add (first layer)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # norm(x + residual), x + residual
        """The residual add fused with this norm: one kernel on CUDA instead of add + norm."""
        return add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:  # [head_dim // 2] float32
    """Rotary frequencies, with the same float32 arithmetic as transformers' rope init."""
    # Explicit CPU: models are built under a meta-device context.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, blended, scaled)
    raise ModelLoadError(f"unsupported rope scaling {kind!r}")


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a cos/sin table indexed by position.

    The table grows on demand (doubling) from the host-known max context length, so it never
    reads positions back from the device and a 128k-context config costs nothing until used.
    """

    def __init__(
        self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)  # float32, kept off the module
        self._table: torch.Tensor | None = None  # [P, 2, 1, D]: cos, signed sin

    def table(self, needed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        t = self._table
        if t is None or t.shape[0] < needed or t.device != device or t.dtype != dtype:
            size = 4096
            while size < needed:
                size *= 2
            pos = torch.arange(size, dtype=torch.float32, device="cpu")
            freqs = pos[:, None] * self.inv_freq[None, :]  # [P, D/2], as HF: one fp32 product
            cos, sin = freqs.cos(), freqs.sin()
            # out = x * cos + roll(x, D/2) * signed_sin  ==  HF's x*cos + rotate_half(x)*sin
            t = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], 1)
            self._table = t[:, :, None, :].to(device=device, dtype=dtype)
            t = self._table
        return t

    def cos_sin(
        self, positions: torch.Tensor, max_context_len: int, dtype: torch.dtype
    ) -> torch.Tensor:  # [T, 2, 1, D]
        """Gather once per forward; every layer reuses the result."""
        return self.table(max_context_len, positions.device, dtype).index_select(0, positions)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate_up = self.gate_up_proj
        if type(gate_up) is Linear and glu_eligible(x, gate_up.weight):
            return self.down_proj(gemv_glu(x, gate_up.weight))  # one kernel to [T, I]
        return self.down_proj(silu_and_mul(gate_up(x)))  # via [T, 2I] -> [T, I]
