"""JSON shapes of the two OpenAI endpoints, built from the engine's token deltas.

A ChoiceState accumulates what a choice has received; streamed chunks and the full response are
both built from the same deltas, so concatenated streamed text equals the non-streamed text and
usage counts exactly the tokens that were sent. What `echo` prepends (the prompt, or for chat the
last message) is part of the text but never of the completion's token count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from specserve.server.responses import (
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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    PromptLogprob,
    PromptLogprobs,
    ToolCall,
    UsageInfo,
)
from specserve.server.stream import TokenDelta
from specserve.structured.tool_parser import (
    ParsedToolCall,
    StreamingToolParser,
    parse_tool_calls,
)

# StepUpdate.prompt_logprobs: per prompt position, None or [(id, logprob, rank, text or None)]
RawPromptLogprobs = list[list[tuple[int, float, int | None, str | None]] | None]


@dataclass
class ChoiceState:
    prompt_token_ids: list[int] = field(default_factory=list)
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
    # echo: text before the completion, and (completions with logprobs) the prompt's tokens
    echo_text: str = ""
    echo_tokens: list[TokenDelta] = field(default_factory=list)
    echo_offsets: list[int] = field(default_factory=list)
    echo_pending: bool = False  # streamed: the echo chunk is still to be sent
    drop_tokens: bool = False  # echo with max_tokens 0: the one token that ran is not returned
    prompt_logprobs: PromptLogprobs | None = None
    # chat with tools, streamed: the parser of this choice's output, the calls sent so far
    tool_parser: StreamingToolParser | None = None
    num_tool_calls: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def text(self) -> str:
        return self.echo_text + "".join(self.text_parts)

    def set_echo_tokens(self, tokens: list[TokenDelta]) -> None:
        """The prompt's tokens lead the logprobs; the completion's offsets follow them."""
        self.echo_tokens = tokens
        self.echo_offsets = []
        for t in tokens:
            self.echo_offsets.append(self.token_text_len)
            self.token_text_len += len(t.text)

    def add(
        self, tokens: list[TokenDelta], finish_reason: str | None, stop_reason: str | int | None
    ) -> None:
        if not self.drop_tokens:
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


def prompt_token_deltas(
    prompt_ids: list[int], raw: RawPromptLogprobs, texts: dict[int, str]
) -> list[TokenDelta]:
    """The prompt as logprob-carrying tokens (echo): the first has no logprob, as in OpenAI."""
    out = []
    for tid, entry in zip(prompt_ids, raw):
        if entry is None:
            out.append(TokenDelta(tid, texts[tid], None, None))
            continue
        top = [(t, lp, texts[t], rank) for t, lp, rank, _ in entry]
        lp = next(e[1] for e in entry if e[0] == tid)
        out.append(TokenDelta(tid, texts[tid], lp, top))
    return out


def prompt_logprobs_body(raw: RawPromptLogprobs, texts: dict[int, str]) -> PromptLogprobs:
    return [
        None
        if entry is None
        else {
            t: PromptLogprob(logprob=lp, rank=rank, decoded_token=texts[t])
            for t, lp, rank, _ in entry
        }
        for entry in raw
    ]


def _real(tokens: list[TokenDelta]) -> list[TokenDelta]:
    return [t for t in tokens if t.token_id >= 0]


def _token_text(t: TokenDelta) -> str:
    return next((e[2] for e in t.top_logprobs or [] if e[0] == t.token_id), "")


def _sampled_and_top(
    t: TokenDelta, n: int, as_ids: bool
) -> tuple[str, float | None, list[tuple[str, float]] | None]:
    """(token text, its logprob, the top-n (text, logprob) by rank). A token without
    logprobs (the first of an echoed prompt) has None for both."""
    if t.top_logprobs is None:
        return (f"token_id:{t.token_id}" if as_ids else t.text), None, None
    entries = t.top_logprobs
    text = f"token_id:{t.token_id}" if as_ids else _token_text(t)
    lp = t.logprob if t.logprob is not None else 0.0
    ranked = sorted((e for e in entries if e[3] is not None and e[3] <= n), key=lambda e: e[3])
    return text, lp, [((f"token_id:{e[0]}" if as_ids else e[2]), e[1]) for e in ranked]


class ResponseFormat(Protocol):
    id: str
    return_token_ids: bool
    tokens_as_ids: bool

    def first_chunks(self, n: int) -> list: ...

    def echo_chunk(
        self, index: int, state: ChoiceState
    ) -> CompletionResponse | ChatCompletionChunk | None: ...

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
        self.tokens_as_ids = False

    def _logprobs(self, tokens: list[TokenDelta], offsets: list[int]) -> CompletionLogProbs | None:
        if self.logprobs is None:
            return None
        out = CompletionLogProbs()
        for t, off in zip(tokens, offsets):
            text, lp, top = _sampled_and_top(t, self.logprobs, self.tokens_as_ids)
            out.tokens.append(text)
            out.token_logprobs.append(lp)
            out.text_offset.append(off)
            out.top_logprobs.append(None if top is None else {text: lp, **dict(top)})
        return out

    def first_chunks(self, n: int) -> list:
        return []

    def echo_chunk(self, index: int, state: ChoiceState) -> CompletionResponse | None:
        if not state.echo_text and not state.echo_tokens:
            return None
        choice = CompletionChoice(
            index=index,
            text=state.echo_text,
            logprobs=self._logprobs(state.echo_tokens, state.echo_offsets),
            prompt_token_ids=state.prompt_token_ids if self.return_token_ids else None,
        )
        return CompletionResponse(id=self.id, model=self.model, choices=[choice])

    def chunk(
        self, index: int, tokens: list[TokenDelta], state: ChoiceState, finish: str | None
    ) -> CompletionResponse:
        real = [] if state.drop_tokens else _real(tokens)
        offsets = state.offsets[len(state.offsets) - len(real) :]
        choice = CompletionChoice(
            index=index,
            text="" if state.drop_tokens else "".join(t.text for t in tokens),
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
                logprobs=self._logprobs(s.echo_tokens + s.tokens, s.echo_offsets + s.offsets),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                token_ids=list(s.token_ids) if self.return_token_ids else None,
                prompt_token_ids=s.prompt_token_ids if self.return_token_ids else None,
                prompt_logprobs=s.prompt_logprobs,
            )
            for i, s in enumerate(states)
        ]
        return CompletionResponse(id=self.id, model=self.model, choices=choices, usage=usage)


@dataclass(frozen=True)
class ToolOutput:
    """A chat request with tools: its output is parsed into tool calls."""

    format: str  # structured.tools.HERMES / LLAMA3_JSON
    choice: str  # "auto" | "required" | the forced function's name
    parallel: bool  # parallel_tool_calls: false keeps the first call only

    def finish_reason(self, finish: str | None, num_calls: int) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call; a forced function ends with "stop"
        if finish == "stop" and num_calls and self.choice in ("auto", "required"):
            return "tool_calls"
        return finish


def _tool_calls(calls: list[ParsedToolCall]) -> list[ToolCall]:
    return [
        ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
    ]


class ChatFormat:
    def __init__(
        self,
        id: str,
        model: str,
        top_logprobs: int | None,
        prompt_text: str | None = None,
        tools: ToolOutput | None = None,
    ) -> None:
        self.id, self.model, self.top_logprobs = id, model, top_logprobs
        self.prompt_text = prompt_text  # return_prompt_text
        self.tools = tools
        self.return_token_ids = False
        self.tokens_as_ids = False

    def _logprobs(self, tokens: list[TokenDelta]) -> ChatLogprobs | None:
        if self.top_logprobs is None:
            return None
        content = []
        for t in tokens:
            text, lp, top = _sampled_and_top(t, self.top_logprobs, self.tokens_as_ids)
            content.append(
                ChatTokenLogprob(
                    token=text,
                    logprob=lp if lp is not None else 0.0,
                    bytes=list(text.encode("utf-8")),
                    top_logprobs=[
                        ChatTopLogprob(token=s, logprob=v, bytes=list(s.encode("utf-8")))
                        for s, v in top or []
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
                prompt_text=self.prompt_text if i == 0 else None,
            )
            for i in range(n)
        ]

    def echo_chunk(self, index: int, state: ChoiceState) -> ChatCompletionChunk | None:
        if not state.echo_text:
            return None
        choice = ChatStreamChoice(index=index, delta=DeltaMessage(content=state.echo_text))
        return ChatCompletionChunk(id=self.id, model=self.model, choices=[choice])

    def chunk(
        self, index: int, tokens: list[TokenDelta], state: ChoiceState, finish: str | None
    ) -> ChatCompletionChunk:
        real = _real(tokens)
        text = "".join(t.text for t in tokens)
        delta = DeltaMessage(content=text)
        if self.tools is not None:
            delta = self._tool_delta(state, text, finish)
            finish = self.tools.finish_reason(finish, state.num_tool_calls)
        choice = ChatStreamChoice(
            index=index,
            delta=delta,
            logprobs=self._logprobs(real),
            finish_reason=finish or None,
            stop_reason=state.stop_reason if finish else None,
            token_ids=[t.token_id for t in real] if self.return_token_ids else None,
        )
        return ChatCompletionChunk(id=self.id, model=self.model, choices=[choice])

    def _tool_delta(self, state: ChoiceState, text: str, finish: str | None) -> DeltaMessage:
        """The content and the tool calls completed by this chunk's text."""
        assert self.tools is not None
        if state.tool_parser is None:
            state.tool_parser = StreamingToolParser(self.tools.format)
        content, calls = state.tool_parser.feed(text)
        if finish is not None:
            more, last = state.tool_parser.finish()
            content, calls = content + more, calls + last
        if not self.tools.parallel:
            calls = calls[: max(0, 1 - state.num_tool_calls)]
        deltas = [
            DeltaToolCall(
                index=state.num_tool_calls + k,
                id=c.id,
                type="function",
                function=DeltaFunctionCall(name=c.name, arguments=c.arguments),
            )
            for k, c in enumerate(calls)
        ]
        state.num_tool_calls += len(calls)
        if deltas:
            return DeltaMessage(content=content or None, tool_calls=deltas)
        return DeltaMessage(content=content)

    def _message(self, s: ChoiceState) -> tuple[ChatResponseMessage, str | None]:
        if self.tools is None:
            return ChatResponseMessage(content=s.text), s.finish_reason
        content, calls = parse_tool_calls(s.text, self.tools.format)
        if not self.tools.parallel:
            calls = calls[:1]
        finish = self.tools.finish_reason(s.finish_reason, len(calls))
        return ChatResponseMessage(content=content, tool_calls=_tool_calls(calls) or None), finish

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, model=self.model, choices=[], usage=usage)

    def full_response(self, states: list[ChoiceState], usage: UsageInfo) -> ChatCompletionResponse:
        choices = []
        for i, s in enumerate(states):
            message, finish = self._message(s)
            choices.append(
                ChatChoice(
                    index=i,
                    message=message,
                    logprobs=self._logprobs(s.tokens),
                    finish_reason=finish,
                    stop_reason=s.stop_reason,
                    token_ids=list(s.token_ids) if self.return_token_ids else None,
                )
            )
        first = states[0]
        return ChatCompletionResponse(
            id=self.id,
            model=self.model,
            choices=choices,
            usage=usage,
            prompt_logprobs=first.prompt_logprobs,
            prompt_token_ids=first.prompt_token_ids if self.return_token_ids else None,
            prompt_text=self.prompt_text,
        )
