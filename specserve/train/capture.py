"""The target's side of training: aux hidden states and next-token logits of whole sequences.

One prefill of every sequence of a batch through specserve's own model (flat rows, a scratch
paged KV cache), so the head learns from exactly the numbers the engine computes at serving
time. The aux hidden states are the residual stream ENTERING the chosen decoder layers, as vLLM
counts EAGLE-3's layer ids: id l is HF's `output_hidden_states[l]` (id 0: the embeddings),
read by the model's own capture (the one serving uses), in ascending layer order.

Per row the logits are kept in the compact form training needs (the full [T, V] fp32 tensor is
200 kB a row for a 49k vocabulary): the draft-vocabulary logits, the log-normaliser over the
whole vocabulary (so target probabilities of draft tokens, and the mass outside the draft
vocabulary, stay exact) and the target's greedy token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from specserve.model.aux_capture import AuxCapture
from specserve.ops.forward_context import ForwardContext, KVCache

BLOCK_SIZE = 16
LOGITS_CHUNK = 1024  # rows of full-vocabulary logits alive at once


@dataclass
class TargetRows:
    """The target's view of a batch of sequences, flat over their tokens (sequence after
    sequence, in order)."""

    aux_hidden: torch.Tensor  # [T, n_aux * H] model dtype, cat of the aux layers' streams
    draft_logits: torch.Tensor  # [T, Vd] fp32, the target's logits on the draft vocabulary
    logsumexp: torch.Tensor  # [T] fp32, log-normaliser over the whole target vocabulary
    greedy: torch.Tensor  # [T] int64, the target's argmax (a target id)
    lens: list[int]  # tokens of each sequence

    def split(self) -> list[TargetRows]:
        out, start = [], 0
        for n in self.lens:
            sl = slice(start, start + n)
            out.append(
                TargetRows(
                    self.aux_hidden[sl],
                    self.draft_logits[sl],
                    self.logsumexp[sl],
                    self.greedy[sl],
                    [n],
                )
            )
            start += n
        return out


def aux_layer_ids_for(num_layers: int) -> tuple[int, ...] | None:
    """The head config's `aux_layer_ids`: None (EAGLE-3's default (2, N // 2, N - 3), which
    vLLM and SGLang both apply when the config names none) when those are valid layers, else
    the defaults clamped into the target's layers (shallow test models)."""
    ids = (2, num_layers // 2, num_layers - 3)
    if all(0 <= i < num_layers for i in ids):
        return None
    return tuple(sorted(min(max(i, 0), num_layers - 1) for i in ids))


def _prefill_context(lens: list[int], device: torch.device) -> ForwardContext:
    """Every sequence prefilled whole, on consecutive blocks of a scratch cache."""
    tables, slots, first = [], [], 0
    for n in lens:
        nb = -(-n // BLOCK_SIZE)
        tables.append(list(range(first, first + nb)))
        slots.extend(range(first * BLOCK_SIZE, first * BLOCK_SIZE + n))
        first += nb
    width = max(len(t) for t in tables)
    ql = torch.tensor(lens, dtype=torch.int32)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(ql, 0)
    return ForwardContext(
        query_lens=ql.to(device),
        cu_query_lens=cu.to(device),
        context_lens=ql.to(device),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
        ),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(lens),
        max_context_len=max(lens),
        query_lens_cpu=list(lens),
        context_lens_cpu=list(lens),
    )


def capture_target(
    model: nn.Module,
    sequences: Sequence[Sequence[int]],
    layer_ids: Sequence[int],
    draft_to_target: torch.Tensor,  # [Vd] int64 target ids of the draft vocabulary
) -> TargetRows:
    """Prefill `sequences` through the target; aux streams and compact logits of every row."""
    rows = _capture(model, sequences, layer_ids, draft_to_target)
    # Cloned outside inference mode: inference tensors cannot be saved for the head's backward.
    return TargetRows(
        rows.aux_hidden.clone(),
        rows.draft_logits.clone(),
        rows.logsumexp.clone(),
        rows.greedy.clone(),
        rows.lens,
    )


@torch.inference_mode()
def _capture(
    model: nn.Module,
    sequences: Sequence[Sequence[int]],
    layer_ids: Sequence[int],
    draft_to_target: torch.Tensor,
) -> TargetRows:
    lens = [len(s) for s in sequences]
    if not lens or min(lens) < 1:
        raise ValueError("every sequence needs at least one token")
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    cfg = model.config
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in lens)
    shape = (num_blocks, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    caches = [
        KVCache(
            torch.empty(shape, dtype=dtype, device=device),
            torch.empty(shape, dtype=dtype, device=device),
        )
        for _ in range(cfg.num_hidden_layers)
    ]
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]).to(device)
    ctx = _prefill_context(lens, device)
    # The model's own capture (model/aux_capture.py), swapped in for this forward only: an
    # engine that shares the model may hold one of its own.
    # A layer named twice (shallow targets) is captured once and its block repeated.
    uniq = sorted(set(layer_ids))
    cap = AuxCapture(tuple(uniq), cfg.hidden_size, len(ids), dtype, device)
    saved, model.aux_capture = model.aux_capture, cap
    try:
        hidden = model(ids, positions, caches, ctx)  # [T, H] final-normed
    finally:
        model.aux_capture = saved
    aux = cap.rows
    if list(layer_ids) != uniq:
        blocks = aux.split(cfg.hidden_size, dim=-1)
        aux = torch.cat([blocks[uniq.index(i)] for i in layer_ids], dim=-1)
    del caches
    d2t_ids = draft_to_target.to(device)
    parts_d, parts_l, parts_g = [], [], []
    for start in range(0, hidden.shape[0], LOGITS_CHUNK):
        logits = model.compute_logits(hidden[start : start + LOGITS_CHUNK])  # [c, V] fp32
        parts_d.append(logits.index_select(1, d2t_ids))
        parts_l.append(torch.logsumexp(logits, dim=-1))
        parts_g.append(logits.argmax(dim=-1))
    return TargetRows(aux, torch.cat(parts_d), torch.cat(parts_l), torch.cat(parts_g), lens)
