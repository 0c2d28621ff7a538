"""Tokenization for the server: chat-template rendering, and two tokenizer lanes.

Tokenizing is CPU work that scales with the input: a 5 MB prompt takes seconds. It never runs on
the event loop, and a big input never sits in front of a small one: inputs up to
SMALL_INPUT_CHARS go to one thread, bigger ones to another with its own copy of the tokenizer
(HF fast tokenizers are not meant to encode from two threads at once). Inputs are bounded in
characters before any tokenizing, so one request cannot keep a lane busy for long.

Chat templates are rendered by `specserve.chat.render_chat`, which the offline API shares.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
from collections.abc import Callable
from typing import Any, TypeVar

from specserve.chat import render_chat
from specserve.sampling_params import InvalidRequestError

T = TypeVar("T")
SMALL_INPUT_CHARS = 16_384
CHARS_PER_TOKEN_BOUND = 32  # no tokenizer we serve packs more characters into one token


class TokenizerLanes:
    """Encode, render and decode off the event loop, small inputs never behind big ones."""

    def __init__(self, tokenizer: Any, max_chars: int) -> None:
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self._small = concurrent.futures.ThreadPoolExecutor(1, "specserve-tok-small")
        self._large = concurrent.futures.ThreadPoolExecutor(1, "specserve-tok-large")
        # the large lane's own tokenizer, made on first use (a deep copy: ~0.1 s)
        self._large_tok: Any = None

    def check_size(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise InvalidRequestError(
                f"{param} has {chars} characters; this server accepts at most {self.max_chars} "
                "per request (a prompt that long cannot fit the model's context)",
                param,
            )

    async def run(self, chars: int, fn: Callable[[Any], T]) -> T:
        """fn(tokenizer) in the lane for an input of `chars` characters."""
        loop = asyncio.get_running_loop()
        if chars <= SMALL_INPUT_CHARS:
            return await loop.run_in_executor(self._small, fn, self.tokenizer)
        return await loop.run_in_executor(self._large, lambda: fn(self._large_tokenizer()))

    def _large_tokenizer(self) -> Any:
        if self._large_tok is None:
            self._large_tok = copy.deepcopy(self.tokenizer)
        return self._large_tok

    async def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        self.check_size(len(text), param)
        return await self.run(
            len(text), lambda tok: list(tok.encode(text, add_special_tokens=add_special_tokens))
        )

    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any],
        add_special_tokens: bool,
        tools: list[Any] | None = None,
    ) -> tuple[str, list[int]]:
        chars = sum(len(str(m.get("content") or "")) for m in messages)
        chars += len(repr(template_kwargs)) if len(template_kwargs) > 2 else 0
        chars += len(repr(tools)) if tools else 0
        self.check_size(chars, "messages")
        return await self.run(
            chars,
            lambda tok: render_chat(
                tok, messages, template_kwargs, add_special_tokens, None, tools
            ),
        )

    async def decode(self, ids: list[int]) -> str:
        return await self.run(len(ids), lambda tok: tok.decode(ids))

    async def token_strings(self, ids: list[int]) -> list[str]:
        """Each id's own text (as logprobs show tokens)."""
        return await self.run(len(ids), lambda tok: tok.batch_decode([[i] for i in ids]))

    def shutdown(self) -> None:
        self._small.shutdown(wait=False, cancel_futures=True)
        self._large.shutdown(wait=False, cancel_futures=True)
