"""Per-token outputs from a fixed-capacity pool, and the aggregated results of the offline API."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

LOGPROB_FLOOR = -9999.0  # no -inf crosses the output boundary (JSON has no infinity)


class OutputPoolExhausted(RuntimeError):
    pass


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class TokenOutput:
    """One emitted token of one request. Pooled: the pool takes it back two steps after the one
    that made it, and hands it out again only if nothing else references it then (a consumer
    that keeps it keeps it unchanged: OutputPool.release_through)."""

    request_id: str = ""
    token_id: int = -1
    index: int = 0  # position of this token in the request's output
    text: str = ""  # text made visible by this token (may be empty while held back for stops)
    logprob: float | None = None
    top_logprobs: dict[int, Logprob] | None = None  # sampled token + top-N, when asked for
    # prompt_logprobs requests, on the output of index 0 only: one entry per prompt token, None
    # for the first, else {token: Logprob} of the prompt token (with its rank) and the top-N
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_output_tokens: int = 0  # cumulative, including this token
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # anchor fields: set on the request's last output of the step only
    is_anchor: bool = False
    draft_tok: int = 0
    accept_tok: int = 0
    draft_confidences: list[float] | None = None
    step: int = -1  # step that allocated it (pool bookkeeping)

    def clone(self) -> TokenOutput:
        """A copy the pool knows nothing of (step -1)."""
        return TokenOutput(
            self.request_id,
            self.token_id,
            self.index,
            self.text,
            self.logprob,
            dict(self.top_logprobs) if self.top_logprobs is not None else None,
            list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            self.num_output_tokens,
            self.finished,
            self.finish_reason,
            self.stop_reason,
            self.is_anchor,
            self.draft_tok,
            self.accept_tok,
            self.draft_confidences,
        )


def _pool_refs() -> int:
    """sys.getrefcount of a released output only the pool holds, in release_through's loop (its
    step list, the loop variable, the call; measured: interpreters count arguments differently)."""
    outs = [TokenOutput()]
    for out in outs:
        return sys.getrefcount(out)
    raise AssertionError


_POOL_REFS = _pool_refs()


class OutputPool:
    """Fixed-capacity pool of TokenOutput. Outputs of step N are released at the start of step
    N + 2 (a consumer has one full step to read them). Exhaustion is an error, never a silent
    allocation: it means outputs are made faster than they are released.

    A released output that something else still references (a consumer keeping what
    LLM.stream handed it) is not reused: the pool lets it go and takes a fresh one in its
    place, so a kept output never changes and nobody copies the ones that are not kept."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[TokenOutput] = [TokenOutput() for _ in range(capacity)]
        self._by_step: dict[int, list[TokenOutput]] = {}
        self._step = -1  # the step whose list _held is (acquire's fast path)
        self._held: list[TokenOutput] = []
        self.num_kept = 0  # released outputs still referenced elsewhere, replaced

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, step: int) -> TokenOutput:
        if not self._free:
            held = {s: len(v) for s, v in sorted(self._by_step.items())}
            raise OutputPoolExhausted(
                f"output pool exhausted (capacity {self.capacity}) in step {step}: outputs still "
                f"held per step {held}; outputs must be released two steps after they are made"
            )
        out = self._free.pop()
        # back to the field defaults but request_id, index and num_output_tokens (the ledger
        # sets those), inline: once per token
        out.token_id, out.text, out.logprob, out.top_logprobs = -1, "", None, None
        out.prompt_logprobs = None
        out.finished, out.finish_reason, out.stop_reason = False, None, None
        out.is_anchor, out.draft_tok, out.accept_tok, out.draft_confidences = False, 0, 0, None
        out.step = step
        if step != self._step:
            self._step, self._held = step, self._by_step.setdefault(step, [])
        self._held.append(out)
        return out

    def release_through(self, step: int) -> None:
        """Return every output allocated in steps <= step."""
        free = self._free
        for s in [s for s in self._by_step if s <= step]:
            outs = self._by_step.pop(s)
            if s == self._step:
                self._step = -1
            for out in outs:
                if sys.getrefcount(out) > _POOL_REFS:
                    out = TokenOutput()  # someone keeps it: it is theirs now
                    self.num_kept += 1
                free.append(out)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step, bonus included (1.0 when nothing was drafted)."""
        if self.num_drafts == 0:
            return 1.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # as TokenOutput's


@dataclass
class OutputAccumulator:
    """Folds a request's per-token outputs into its final RequestOutput (copies, so the pool's
    objects can be recycled)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    want_logprobs: bool
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, out: TokenOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = list(out.prompt_logprobs)
        if out.token_id >= 0:
            self.token_ids.append(out.token_id)
            if self.want_logprobs:  # (the cumulative logprob is reported only then)
                if out.logprob is not None:
                    self.cumulative_logprob += out.logprob
                if out.top_logprobs is not None:
                    self.logprobs.append(dict(out.top_logprobs))
        if out.text:
            self.text_parts.append(out.text)
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason

    def result(self) -> RequestOutput:
        comp = CompletionOutput(
            index=0,
            text="".join(self.text_parts),
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob if self.want_logprobs else None,
            logprobs=list(self.logprobs) if self.want_logprobs else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [comp],
            self.finish_reason is not None,
            self.metrics,
            # a request the engine ended for its own inputs (finish_reason "error") says why
            error=str(self.stop_reason) if self.finish_reason == "error" else None,
            prompt_logprobs=self.prompt_logprobs,
        )
