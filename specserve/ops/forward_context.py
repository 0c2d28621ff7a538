"""The explicit per-forward context handed to every attention layer (no globals)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    """One layer's paged KV cache. Slot s lives at block s // block_size, offset s % block_size."""

    k: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]

    @property
    def block_size(self) -> int:
        return self.k.shape[1]


@dataclass
class ForwardContext:
    """Everything one forward over a flat batch of rows needs to read/write the paged KV cache.

    Rows of request i are rows [cu_query_lens[i], cu_query_lens[i+1]) of the flat batch; they are
    the *last* query_lens[i] positions of its context, so row j of request i may attend to KV
    positions [0, context_lens[i] - query_lens[i] + j] (causal within the request); a layer with
    a sliding window W sees only the last W of them. The window is the layer's (ModelConfig.
    layer_window), not the context's: one context serves layers of every window.
    """

    query_lens: torch.Tensor  # [B] int32, rows per request in this forward (>= 1)
    cu_query_lens: torch.Tensor  # [B + 1] int32, exclusive prefix sum of query_lens
    context_lens: torch.Tensor  # [B] int32, KV length of each request after this forward's writes
    block_tables: torch.Tensor  # [B, max_blocks_per_req] int32, padded with 0
    slot_mapping: (
        torch.Tensor
    )  # [T] int64, KV slot each row writes (negative = padding row: no write)
    max_query_len: int
    max_context_len: int
    # host copies, so the torch reference path never syncs to read them
    query_lens_cpu: list[int] | None = None
    context_lens_cpu: list[int] | None = None

    @property
    def num_requests(self) -> int:
        return self.query_lens.shape[0]
