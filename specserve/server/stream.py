"""What the engine thread hands to request handlers: per-step updates on an asyncio queue.

Everything here is a plain copy: the engine's pooled TokenOutputs are recycled two steps later,
so nothing that crosses to the event loop may point into them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from specserve.server.errors import ServerError


@dataclass(slots=True)
class TokenDelta:
    """One emitted token, copied out of the pooled TokenOutput."""

    token_id: int  # -1: no token (text flushed by a terminal output)
    text: str
    logprob: float | None
    # (token id, logprob, token text, rank): the sampled token first, then the top-N by rank
    top_logprobs: list[tuple[int, float, str, int | None]] | None


@dataclass(slots=True)
class StepUpdate:
    """What one engine step produced for one engine request (= one choice)."""

    index: int  # choice index in the HTTP request
    tokens: list[TokenDelta] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: ServerError | None = None
    # with the first update, when prompt_logprobs was asked for: per prompt position, None or
    # [(token id, logprob, rank, decoded text or None)] (the prompt token and the top-N)
    prompt_logprobs: list[list[tuple[int, float, int | None, str | None]] | None] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(1 for t in self.tokens if t.token_id >= 0)


class RequestStream:
    """The asyncio side of one HTTP request: the step updates of its n engine requests."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request_ids: list[str]) -> None:
        self.loop = loop
        self.request_ids = request_ids
        self.num_prompt_tokens: list[int] = [0] * len(request_ids)
        self._queue: asyncio.Queue[StepUpdate] = asyncio.Queue()

    def put_threadsafe(self, update: StepUpdate) -> None:
        deliver_threadsafe([(self, update)])

    async def updates(self) -> AsyncIterator[StepUpdate]:
        """Yield updates until every choice finished; an engine failure raises its ServerError."""
        remaining = len(self.request_ids)
        while remaining:
            update = await self._queue.get()
            if update.error is not None:
                raise update.error
            if update.finish_reason is not None:
                remaining -= 1
            yield update


def _deliver(batch: list[tuple[RequestStream, StepUpdate]]) -> None:
    for stream, update in batch:
        stream._queue.put_nowait(update)


def deliver_threadsafe(batch: list[tuple[RequestStream, StepUpdate]]) -> None:
    """Hand a step's updates to their event loops: one wake-up per loop, not one per request
    (each call_soon_threadsafe writes the loop's self-pipe and costs the engine thread a
    syscall plus a GIL hand-off)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, StepUpdate]]] = {}
    for stream, update in batch:
        by_loop.setdefault(stream.loop, []).append((stream, update))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # event loop closed: the server is shutting down
            pass
