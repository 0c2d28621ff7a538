"""A minimal paged-KV driver for model tests: block allocation, ForwardContext, greedy loop."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from specserve.model.config import ModelConfig
from specserve.ops.forward_context import ForwardContext, KVCache


def build_ctx(
    q_lens: list[int],
    ctx_lens: list[int],
    tables: list[list[int]],
    block_size: int,
    pad_rows: int = 0,
    device: torch.device | str = "cpu",
) -> ForwardContext:
    """Context for rows = last q_lens[i] positions of each request, then `pad_rows` padding."""
    slots: list[int] = []
    for q, c, table in zip(q_lens, ctx_lens, tables):
        for p in range(c - q, c):
            slots.append(table[p // block_size] * block_size + p % block_size)
    slots += [-1] * pad_rows
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    ql = torch.tensor(q_lens, dtype=torch.int32)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(ql, 0)
    return ForwardContext(
        query_lens=ql.to(device),
        cu_query_lens=cu.to(device),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        block_tables=bt.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(q_lens),
        max_context_len=max(ctx_lens),
        query_lens_cpu=list(q_lens),
        context_lens_cpu=list(ctx_lens),
    )


class PagedRunner:
    """Drives a model over requests with paged KV; blocks handed out in a shuffled order."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        num_blocks: int = 256,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        # NaN-filled: any read of a slot that was never written poisons the result visibly.
        self.caches = [
            KVCache(
                torch.full(shape, float("nan"), dtype=dtype, device=device),
                torch.full(shape, float("nan"), dtype=dtype, device=device),
            )
            for _ in range(config.num_hidden_layers)
        ]
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=g).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def forward(self, batch: list[tuple[int, list[int]]], pad_rows: int = 0) -> torch.Tensor:
        """batch: (request id, new token ids). Returns final hidden [T, hidden] (incl. padding)."""
        q_lens, ctx_lens, tables, ids, pos = [], [], [], [], []
        for rid, toks in batch:
            start = self.lens.get(rid, 0)
            end = start + len(toks)
            table = self.tables.setdefault(rid, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            self.lens[rid] = end
            q_lens.append(len(toks))
            ctx_lens.append(end)
            tables.append(table)
            ids += toks
            pos += range(start, end)
        ids += [0] * pad_rows
        pos += [0] * pad_rows
        ctx = build_ctx(q_lens, ctx_lens, tables, self.block_size, pad_rows, self.device)
        return self.model(
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            torch.tensor(pos, dtype=torch.int64, device=self.device),
            self.caches,
            ctx,
        )

    def logits(self, batch: list[tuple[int, list[int]]], pad_rows: int = 0) -> torch.Tensor:
        return self.model.compute_logits(self.forward(batch, pad_rows))


def greedy(
    runner: PagedRunner,
    prompts: list[list[int]],
    max_new: int,
    chunk: int | None = None,
    eos: int | None = None,
) -> list[list[int]]:
    """Greedy decode all prompts as one batch: chunked prefill, then one row per request."""
    out: list[list[int]] = [[] for _ in prompts]
    nxt: dict[int, int] = {}
    # prefill, `chunk` tokens per request per step, all requests in the same forward
    done = [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        batch, rows_end = [], []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                step = len(p) - done[i] if chunk is None else min(chunk, len(p) - done[i])
                batch.append((i, p[done[i] : done[i] + step]))
                done[i] += step
                rows_end.append((i, done[i] == len(p)))
        logits = runner.logits(batch)
        row = 0
        for (i, finished), (_, toks) in zip(rows_end, batch):
            row += len(toks)
            if finished:
                nxt[i] = int(logits[row - 1].argmax())
    live = list(range(len(prompts)))
    while live:
        for i in live:
            out[i].append(nxt[i])
        live = [i for i in live if nxt[i] != eos and len(out[i]) < max_new]
        if not live:
            break
        logits = runner.logits([(i, [nxt[i]]) for i in live])
        for r, i in enumerate(live):
            nxt[i] = int(logits[r].argmax())
    return out


def assert_logits_close(
    got: torch.Tensor, want: torch.Tensor, what: str, atol: float = 2e-5, rtol: float = 1e-4
) -> None:
    """|got - want| <= atol + rtol * |want| everywhere.

    A plain bound instead of torch.testing.assert_close, which costs ~0.1 s per block of
    49k-vocab rows on a small CPU and dominated the model tests.
    """
    err = (got - want).abs()
    ok = bool((err <= atol + rtol * want.abs()).all())
    assert ok, f"{what}: max abs err {float(err.max()):.3g}"


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one thread for a while.

    These models are small (bandwidth- or overhead-bound), so one thread costs little; but two
    OpenMP threads that spin-wait ran up to 10x slower when the 2-core box was shared with other
    processes (measured), which made test times swing by minutes.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def round_to_blocks(model: torch.nn.Module) -> dict[str, list]:
    """Round every linear weight of `model` (and a tied head's embedding) in place to Q8_0-style
    blocks (value = d q, q int8, d fp16), as a GGUF holds them; returns the blocks by module
    name, in gguf_blocks' form."""
    source = {}
    with torch.no_grad():
        named = [(n, m.weight) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        if getattr(model, "lm_head", "absent") is None:
            named.append(("lm_head", model.embed_tokens.weight))
        for name, w in named:
            blocks = w.view(w.shape[0], -1, 32)
            d = (blocks.abs().amax(-1) / 127).half().float().clamp_min(2**-14)  # [N, K/32]
            q = torch.round(blocks / d[..., None]).clamp(-127, 127)
            w.copy_((q * d[..., None]).view_as(w))
            source[name] = [(q.view_as(w).to(torch.int8), d, torch.zeros_like(d))]
    return source


def pack_as_blocks(model: torch.nn.Module, monkeypatch) -> torch.nn.Module:
    """round_to_blocks, then pack_linears with those blocks as the model's GGUF's."""
    from specserve.model import cpu_linear

    source = round_to_blocks(model)
    monkeypatch.setattr(cpu_linear, "gguf_blocks", lambda model, path, kinds: source)
    return cpu_linear.pack_linears(model, Path("blocks.gguf"))
