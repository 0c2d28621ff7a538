"""The catch-up rows of a model drafter inside the step (EAGLE-3 head or draft model): the
drafter's own forward over what its KV cache lacks (a fresh request's prompt, then each step's
verify rows, shifted on the device by the rejections), laid out on the host and uploaded."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from specserve.engine.sequence import Sequence
from specserve.engine.slots import DraftSlotPool
from specserve.ops.forward_context import ForwardContext
from specserve.ops.sampling import DRAFT_SALT, SamplingTensors, sample, target_probs
from specserve.ops.transfer import h2d_packed
from specserve.runner.step_sampler import SamplerPlan
from specserve.sample.verify import VerifyResult


class CatchUp(NamedTuple):
    """Host layout of a step's catch-up rows (C rows, R requests), on the device."""

    tokens: torch.Tensor  # [C] int64, host tokens (prompt rows)
    # [C] int64, verify-layout row + 1 whose emitted token feeds it; 0: its host token; -1:
    # its request's anchor token, in flight (the step's `anchor`)
    emit_at: torch.Tensor
    positions: torch.Tensor  # [C] int64, host positions (verify rows: upper bounds)
    row_req: torch.Tensor  # [C] int64
    verify_row: torch.Tensor  # [C] bool, row shifts with its request's correction
    query_lens: torch.Tensor  # [R] int32
    cu_query_lens: torch.Tensor  # [R + 1] int32
    prefix: torch.Tensor  # [R] int64, prompt rows before each request's verify rows
    block_tables: torch.Tensor  # [R, W] int32
    max_query_len: int
    max_context_len: int  # host bound on every position touched, chain included, + 1


def pack_catch_up(
    rows: tuple[list[int], list[int], list[int], list[int], list[bool]],
    qlens: list[int],
    prefix: list[int],
    tables: list[list[int]],
    top: int,
    block_size: int,
    trash: int,
    device: torch.device,
    min_width: int = 0,
) -> CatchUp:
    """rows = (tokens, emit_at, positions, row_req, verify_row) per catch-up row. Block tables
    get columns for every position touched (`top`, the chain's included), at least `min_width`;
    past a request's blocks the trash block."""
    tokens, emit_at, positions, row_req, verify_row = rows
    width = max(-(-top // block_size), max(len(t) for t in tables), min_width)
    bt = table_rows(tables, width, trash)
    cu = np.zeros(len(qlens) + 1, dtype=np.int32)
    np.cumsum(qlens, out=cu[1:])

    i64, i32 = torch.int64, torch.int32
    return CatchUp(
        *h2d_packed(
            [
                (tokens, i64),
                (emit_at, i64),
                (positions, i64),
                (row_req, i64),
                (verify_row, torch.bool),
                (qlens, i32),
                (cu, i32),
                (prefix, i64),
                (bt, i32),
            ],
            device,
        ),
        max(qlens),
        top,
    )


def pack_gap(
    seqs: list[Sequence],
    spans: list[tuple[int, int]],
    shift: int,
    block_size: int,
    trash: int,
    device: torch.device,
    min_width: int = 0,
) -> CatchUp:
    """A gap catch-up (device_drafting.DeviceDrafting.gap): request i's rows at positions
    [a, b) = spans[i], feeding its tokens [a + shift, b + shift) (b + shift - 1: its anchor,
    in flight or on the host); every row a prefix row."""
    rows: tuple[list[int], list[int], list[int], list[int], list[bool]] = ([], [], [], [], [])
    tokens, emit_at, positions, row_req, verify_row = rows
    for i, (seq, (a, b)) in enumerate(zip(seqs, spans)):
        toks, feed = prefix_rows(seq, a + shift, b + shift, in_flight=True)
        tokens += toks
        emit_at += feed
        positions += range(a, b)
        row_req += [i] * (b - a)
        verify_row += [False] * (b - a)
    qlens = [b - a for a, b in spans]
    tables = [s.block_table.blocks for s in seqs]
    top = max(b for _, b in spans)
    return pack_catch_up(rows, qlens, qlens, tables, top, block_size, trash, device, min_width)


def gap_context(lay: CatchUp, block_size: int) -> tuple[torch.Tensor, ForwardContext]:
    """The KV slot of each gap row [C] int64 and the gap's ForwardContext."""
    slots = kv_slots(lay.block_tables, lay.row_req, lay.positions, block_size)
    start = lay.positions[lay.cu_query_lens[:-1].to(torch.int64)]
    ctx = ForwardContext(
        query_lens=lay.query_lens,
        cu_query_lens=lay.cu_query_lens,
        context_lens=(lay.query_lens.to(torch.int64) + start).to(torch.int32),
        block_tables=lay.block_tables,
        slot_mapping=slots,
        max_query_len=lay.max_query_len,
        max_context_len=lay.max_context_len,
    )
    return slots, ctx


def prefix_rows(
    seq: Sequence, lo: int, hi: int, in_flight: bool = False
) -> tuple[list[int], list[int]]:
    """The tokens [lo, hi) of a request that catches up (hi - 1: its anchor) and their emit_at:
    0 (a host token), or -1 for an anchor the step in flight has yet to bring to the host
    (in_flight: the catch-up reads it on the device)."""
    toks = seq.token_ids[lo:hi]
    if len(toks) == hi - lo:
        return toks, [0] * len(toks)
    assert in_flight and len(toks) == hi - lo - 1 and seq.num_pending, "a token not on the host"
    return toks + [0], [0] * len(toks) + [-1]


def catch_up_tokens(
    lay: CatchUp, emitted: torch.Tensor, anchor: torch.Tensor | None
) -> torch.Tensor:
    """[C] int64 the token each catch-up row feeds: a verify row's emitted token, a prefix
    row's host token or its request's anchor in flight (anchor [R])."""
    tokens = torch.where(lay.emit_at > 0, emitted[(lay.emit_at - 1).clamp_min(0)], lay.tokens)
    if anchor is None:
        return tokens
    return torch.where(lay.emit_at < 0, anchor[lay.row_req], tokens)


def table_rows(tables: list[list[int]], width: int, trash: int) -> np.ndarray:
    """[R, width] int32 block tables, the trash block past each request's blocks."""
    bt = np.full((len(tables), width), trash, dtype=np.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = t
    return bt


def kv_slots(
    bt: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Flat KV slot of each (request, position): its block table's block, or the last column's
    for positions past the table (the trash block)."""
    col = (pos // block_size).clamp(0, bt.shape[1] - 1)
    return bt[req, col].to(torch.int64) * block_size + pos % block_size


def settled(
    plan: SamplerPlan, result: VerifyResult, num_output: torch.Tensor
) -> tuple[torch.Tensor, SamplingTensors]:
    """What a drafter reads of a verified step: the token each verify-layout row emitted (its
    verified token, else the request's sampled one) [T] int64, and per request sampling params
    (draft_sampling, counters at num_output)."""
    layout = plan.layout
    return emitted_tokens(result, layout.row_to_req), draft_sampling(plan.t, layout.ftp, num_output)


def emitted_tokens(result: VerifyResult, row_to_req: torch.Tensor) -> torch.Tensor:
    """[T] int64 the token each verify-layout row emitted: its verified token, else its
    request's sampled one."""
    return torch.where(
        result.verified_token_ids >= 0,
        result.verified_token_ids.to(torch.int64),
        result.sampled_token_ids[row_to_req],
    )


def draft_sampling(
    t: SamplingTensors, first: torch.Tensor, counter: torch.Tensor
) -> SamplingTensors:
    """Per request sampling params for the chain: each request's at its first verify row
    (`first` = ftp), its RNG counter at `counter` (the drafter samples under DRAFT_SALT)."""
    return dataclasses.replace(
        t,
        temperature=t.temperature[first],
        top_k=t.top_k[first],
        top_p=t.top_p[first],
        min_p=t.min_p[first],
        seed=t.seed[first],
        counter=counter,
    )


def pick_drafts(
    logits: torch.Tensor,  # [R, Vd] a drafter's logits (Vd: its vocabulary)
    t: SamplingTensors,  # per request, its counters at this draft position
    pool: DraftSlotPool,
    q_rows: torch.Tensor | None,  # [R] int64, the pool's flat q row of each request's draft
    to_target: Callable[[torch.Tensor], torch.Tensor] | None = None,  # [R, Vd] -> [R, V]
    ids: torch.Tensor | None = None,  # [Vd] int64, target id of each drafter token
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft per request [R] int64 and its q [R, V] (written to the pool): sampled from q
    under DRAFT_SALT; in a step of greedy requests alone the argmax, and no q (greedy
    verification reads none, step_sampler.py; q_rows may then be None)."""
    if t.all_greedy:
        idx = logits.argmax(dim=-1)
        return (idx if ids is None else ids[idx]), None
    q = target_probs(logits if to_target is None else to_target(logits), t)
    pool.q.index_copy_(0, q_rows, q)
    return sample(q, t, DRAFT_SALT), q


def draft_confidence(q: torch.Tensor | None, tok: torch.Tensor) -> torch.Tensor:
    """[R] float32 the drafted token's q (a greedy draft's: 1)."""
    if q is None:
        return torch.ones(tok.shape, dtype=torch.float32, device=tok.device)
    return q.gather(1, tok.unsqueeze(1)).squeeze(1).float()
