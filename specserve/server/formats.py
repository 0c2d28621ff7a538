"""JSON shapes of the two OpenAI endpoints, built from the engine's token deltas.

A ChoiceState accumulates what a choice has received; streamed chunks and the full response are
both built from the same deltas, so concatenated streamed text equals the non-streamed text and
usage counts exactly the tokens that were sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from specserve.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogProbs,
    CompletionResponse,
    DeltaMessage,
    UsageInfo,
)
from specserve.server.stream import TokenDelta


@dataclass
class ChoiceState:
    text_parts: list[str] = field(default_factory=list)
    text_len: int = 0
    token_ids: list[int] = field(default_factory=list)
    tokens: list[TokenDelta] = field(default_factory=list)  # real tokens, for logprobs
    # completions' logprobs.text_offset: where each token's own string starts in the
    # concatenation of token strings (the visible text can lag a token behind the tokens)
    offsets: list[int] = field(default_factory=list)
    token_text_len: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add(
        self, tokens: list[TokenDelta], finish_reason: str | None, stop_reason: str | int | None
    ) -> None:
        for t in tokens:
            if t.token_id >= 0:
                self.token_ids.append(t.token_id)
                self.tokens.append(t)
                self.offsets.append(self.token_text_len)
                if t.top_logprobs:
                    self.token_text_len += len(_token_text(t))
            if t.text:
                self.text_parts.append(t.text)
                self.text_len += len(t.text)
        if finish_reason is not None:
            self.finish_reason, self.stop_reason = finish_reason, stop_reason


def _real(tokens: list[TokenDelta]) -> list[TokenDelta]:
    return [t for t in tokens if t.token_id >= 0]


def _token_text(t: TokenDelta) -> str:
    return next((e[2] for e in t.top_logprobs or [] if e[0] == t.token_id), "")


def _sampled_and_top(t: TokenDelta, n: int) -> tuple[str, float, list[tuple[str, float]]]:
    """(sampled token text, its logprob, the top-n (text, logprob) by rank)."""
    entries = t.top_logprobs or []
    text = _token_text(t)
    lp = t.logprob if t.logprob is not None else 0.0
    ranked = sorted((e for e in entries if e[3] is not None and e[3] <= n), key=lambda e: e[3])
    return text, lp, [(e[2], e[1]) for e in ranked]


class ResponseFormat(Protocol):
    id: str
    return_token_ids: bool

    def first_chunks(self, n: int) -> list: ...

    def chunk(
        self, index: int, tokens: list[TokenDelta], state: ChoiceState, finish: str | None
    ) -> CompletionResponse | ChatCompletionChunk: ...

    def usage_chunk(self, usage: UsageInfo) -> CompletionResponse | ChatCompletionChunk: ...

    def full_response(
        self, states: list[ChoiceState], usage: UsageInfo
    ) -> CompletionResponse | ChatCompletionResponse: ...


class CompletionFormat:
    def __init__(self, id: str, model: str, logprobs: int | None) -> None:
        self.id, self.model, self.logprobs = id, model, logprobs
        self.return_token_ids = False

    def _logprobs(self, tokens: list[TokenDelta], offsets: list[int]) -> CompletionLogProbs | None:
        if self.logprobs is None:
            return None
        out = CompletionLogProbs()
        for t, off in zip(tokens, offsets):
            text, lp, top = _sampled_and_top(t, self.logprobs)
            out.tokens.append(text)
            out.token_logprobs.append(lp)
            out.text_offset.append(off)
            out.top_logprobs.append({text: lp, **dict(top)})
        return out

    def first_chunks(self, n: int) -> list:
        return []

    def chunk(
        self, index: int, tokens: list[TokenDelta], state: ChoiceState, finish: str | None
    ) -> CompletionResponse:
        real = _real(tokens)
        offsets = state.offsets[len(state.offsets) - len(real) :]
        choice = CompletionChoice(
            index=index,
            text="".join(t.text for t in tokens),
            logprobs=self._logprobs(real, offsets),
            finish_reason=finish or None,
            stop_reason=state.stop_reason if finish else None,
            token_ids=[t.token_id for t in real] if self.return_token_ids else None,
        )
        return CompletionResponse(id=self.id, model=self.model, choices=[choice])

    def usage_chunk(self, usage: UsageInfo) -> CompletionResponse:
        return CompletionResponse(id=self.id, model=self.model, choices=[], usage=usage)

    def full_response(self, states: list[ChoiceState], usage: UsageInfo) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=i,
                text=s.text,
                logprobs=self._logprobs(s.tokens, s.offsets),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                token_ids=list(s.token_ids) if self.return_token_ids else None,
            )
            for i, s in enumerate(states)
        ]
        return CompletionResponse(id=self.id, model=self.model, choices=choices, usage=usage)


class ChatFormat:
    def __init__(self, id: str, model: str, top_logprobs: int | None) -> None:
        self.id, self.model, self.top_logprobs = id, model, top_logprobs
        self.return_token_ids = False

    def _logprobs(self, tokens: list[TokenDelta]) -> ChatLogprobs | None:
        if self.top_logprobs is None:
            return None
        content = []
        for t in tokens:
            text, lp, top = _sampled_and_top(t, self.top_logprobs)
            content.append(
                ChatTokenLogprob(
                    token=text,
                    logprob=lp,
                    bytes=list(text.encode("utf-8")),
                    top_logprobs=[
                        ChatTopLogprob(token=s, logprob=v, bytes=list(s.encode("utf-8")))
                        for s, v in top
                    ],
                )
            )
        return ChatLogprobs(content=content)

    def first_chunks(self, n: int) -> list[ChatCompletionChunk]:
        # OpenAI opens every choice with a role-only delta
        return [
            ChatCompletionChunk(
                id=self.id,
                model=self.model,
                choices=[
                    ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                ],
            )
            for i in range(n)
        ]

    def chunk(
        self, index: int, tokens: list[TokenDelta], state: ChoiceState, finish: str | None
    ) -> ChatCompletionChunk:
        real = _real(tokens)
        choice = ChatStreamChoice(
            index=index,
            delta=DeltaMessage(content="".join(t.text for t in tokens)),
            logprobs=self._logprobs(real),
            finish_reason=finish or None,
            stop_reason=state.stop_reason if finish else None,
            token_ids=[t.token_id for t in real] if self.return_token_ids else None,
        )
        return ChatCompletionChunk(id=self.id, model=self.model, choices=[choice])

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, model=self.model, choices=[], usage=usage)

    def full_response(self, states: list[ChoiceState], usage: UsageInfo) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=i,
                message=ChatResponseMessage(content=s.text),
                logprobs=self._logprobs(s.tokens),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                token_ids=list(s.token_ids) if self.return_token_ids else None,
            )
            for i, s in enumerate(states)
        ]
        return ChatCompletionResponse(id=self.id, model=self.model, choices=choices, usage=usage)
