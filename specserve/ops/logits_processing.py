"""Per-row logit bias, allowed-token whitelists and token bans (vLLM/OpenAI semantics).

The rows are a step's sample rows: plain rows and verify rows alike, so the distribution a
verify row checks its draft against is the processed one and speculation stays lossless. The
caller decides what each row bans (bad words depend on the tokens before the row, drafts
included); this module only takes flat (row, column) lists built on the host.

No host sync: every op is an index op on flat indices (advanced-index assignment would sync on
CUDA), and no tensor is inspected for its values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class LogitsProcessing(NamedTuple):
    """What to do to which rows; a part is None when no row of the step needs it."""

    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, cols [B] int64, [B] f32
    allowed: tuple[torch.Tensor, torch.Tensor] | None  # rows [A] int64, ids [A, L] int64 -1 pad
    banned: tuple[torch.Tensor, torch.Tensor] | None  # rows, cols [K] int64: set to -inf
    # structured outputs: rows [G] int64, bits [G, W] int32 (bit t of row g: token t allowed)
    bitmask: tuple[torch.Tensor, torch.Tensor] | None = None


def bitmask_disallowed(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[G, W] int32 packed bitmask (xgrammar's layout: token t is bit t % 32 of word t // 32)
    -> [G, V] bool, True where a token is NOT allowed. Columns past W * 32 are disallowed."""
    g, w = bits.shape
    # as bytes (little-endian, host and GPU): token t is bit t % 8 of byte t // 8; uint8 shifts
    # are vectorised on the CPU where int32 ones are not (~250x slower at one row of 49k)
    u8 = bits.contiguous().view(torch.uint8)  # [G, 4W]
    dev = bits.device
    # made on the device: a host tensor's upload would sync the stream
    one_bit = torch.ones(8, dtype=torch.uint8, device=dev) << torch.arange(
        8, dtype=torch.uint8, device=dev
    )  # [8]: 1, 2, 4, ..., 128
    banned = ((u8.unsqueeze(-1) & one_bit) == 0).view(g, w * 32)  # [G, W*32]
    if w * 32 >= vocab_size:
        return banned[:, :vocab_size]
    pad = torch.ones(g, vocab_size - w * 32, dtype=torch.bool, device=bits.device)
    return torch.cat([banned, pad], dim=1)


def allowed_mask(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[A, L] int64 token ids padded with -1 -> [A, V] bool, True where a token is NOT allowed."""
    a = ids.shape[0]
    # padding goes to a dump column V, so one scatter handles it with no masking pass
    idx = torch.where(ids < 0, vocab_size, ids)  # [A, L]
    keep = torch.zeros(a, vocab_size + 1, dtype=torch.bool, device=ids.device)  # [A, V+1]
    keep.scatter_(1, idx, True)
    return ~keep[:, :vocab_size]  # [A, V]


def apply_logits_processing(logits: torch.Tensor, proc: LogitsProcessing) -> torch.Tensor:
    """Processed logits [N, V] float32; the input is not modified.

    Order (vLLM's): logit bias is added to the raw logits, then everything outside a row's
    allowed ids, every banned (row, token) and every token a row's grammar bitmask disallows
    goes to -inf. The masks commute with each other
    and with the bias (a masked logit stays -inf), and the penalties applied after them keep
    -inf at -inf.
    """
    vocab = logits.shape[1]
    # a fresh contiguous float32 copy: the caller keeps the raw logits (logprobs), and the flat
    # view below needs row-major storage whatever the input's strides
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)  # [N, V]
    out.copy_(logits)
    flat = out.view(-1)  # [N * V], shares out's storage
    if proc.bias is not None:
        rows, cols, values = proc.bias
        # a row's bias keys are distinct (a dict), so no two adds hit one element
        flat.index_add_(0, rows * vocab + cols, values)
    if proc.allowed is not None:
        rows, ids = proc.allowed
        sub = out.index_select(0, rows)  # [A, V]
        sub.masked_fill_(allowed_mask(ids, vocab), float("-inf"))
        out.index_copy_(0, rows, sub)
    if proc.banned is not None:
        rows, cols = proc.banned
        flat.index_fill_(0, rows * vocab + cols, float("-inf"))
    if proc.bitmask is not None:
        rows, bits = proc.bitmask
        # scattered into a full bool mask: one pass over the float logits, not three
        # (index_select, masked_fill, index_copy); bools are a quarter of the bytes
        ban = torch.zeros(out.shape, dtype=torch.bool, device=out.device)  # [N, V]
        ban.index_copy_(0, rows, bitmask_disallowed(bits, vocab))
        out.masked_fill_(ban, float("-inf"))
    return out
