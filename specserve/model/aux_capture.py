"""Capture of the target's hidden states inside its forward (EAGLE-3 heads, head training).

The residual stream *entering* each chosen layer (vLLM's `aux_hidden_states`: layer i's input
`hidden + residual`) is written into a preallocated static buffer during the forward itself: no
second pass, no allocation per step, and under CUDA graphs the writes are part of the graph.
A model without a capture (`LlamaForCausalLM.aux_capture is None`) does no work and holds no
buffer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specserve.ops.forward_context import ForwardContext

# (streams [T, n * H] of the forward's rows, its context) -> None, run after the last layer
CaptureSink = Callable[[torch.Tensor, ForwardContext], None]


class AuxCapture:
    def __init__(
        self,
        layer_ids: tuple[int, ...],
        hidden_size: int,
        max_rows: int,
        dtype: torch.dtype,
        device: torch.device,
        sink: CaptureSink | None = None,
    ) -> None:
        self.layer_ids = tuple(sorted(layer_ids))
        self.hidden_size = hidden_size
        self._column = {layer: j for j, layer in enumerate(self.layer_ids)}
        # [max_rows, n * H]: row r of the latest forward, the chosen layers side by side in
        # ascending layer order (the order of an EAGLE-3 fc's input blocks)
        self.rows = torch.zeros(
            max_rows, len(self.layer_ids) * hidden_size, dtype=dtype, device=device
        )
        self.num_rows = 0  # rows of the latest forward
        self.sink = sink

    def record(
        self,
        layer: int,
        x: torch.Tensor,  # [T, H] the previous layer's output (layer 0: the embeddings)
        residual: torch.Tensor | None,  # [T, H] the residual stream before x; None at layer 0
    ) -> None:
        """Called before each layer runs; writes the stream entering `layer` if it is chosen."""
        j = self._column.get(layer)
        if j is None:
            return
        t = x.shape[0]
        if t > self.rows.shape[0]:
            raise RuntimeError(
                f"hidden-state capture holds {self.rows.shape[0]} rows; a forward has {t}"
            )
        h = self.hidden_size
        dst = self.rows[:t, j * h : (j + 1) * h]
        if residual is None:
            dst.copy_(x)
        else:
            torch.add(x, residual, out=dst)  # the stream the next norm would form

    def targets(self, num_rows: int, num_layers: int) -> dict[int, torch.Tensor]:
        """Where a compiled forward (model/cpu_stack.py) writes what `record` would: chosen
        layer -> [T, H] view of `rows` (row stride n * H)."""
        if num_rows > self.rows.shape[0]:
            raise RuntimeError(
                f"hidden-state capture holds {self.rows.shape[0]} rows; a forward has {num_rows}"
            )
        h = self.hidden_size
        return {
            layer: self.rows[:num_rows, j * h : (j + 1) * h]
            for layer, j in self._column.items()
            if layer < num_layers
        }

    def finish(self, ctx: ForwardContext, num_rows: int) -> None:
        self.num_rows = num_rows
        if self.sink is not None:
            self.sink(self.rows[:num_rows], ctx)
