"""Per-request sampling and stopping parameters (vLLM-shaped)."""

from __future__ import annotations

from dataclasses import dataclass


class InvalidRequestError(ValueError):
    """A request parameter a user got wrong; `param` names it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; N >= 0: sampled token + top-N
    skip_special_tokens: bool = True
    # teacher forcing (benchmarks, tests): output token i is golden_token_ids[i] while there is one;
    # drafts are accepted exactly when they match it, so acceptance can be dialled in
    golden_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        def bad(msg: str, param: str) -> None:
            raise InvalidRequestError(msg, param)

        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}", "n")
        if not (self.temperature >= 0.0):
            bad(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not (0.0 <= self.min_p <= 1.0):
            bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            bad(
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
                "presence_penalty",
            )
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            bad(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
                "frequency_penalty",
            )
        if not (self.repetition_penalty > 0.0):
            bad(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                "repetition_penalty",
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.min_tokens < 0:
            bad(f"min_tokens must be >= 0, got {self.min_tokens}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                "min_tokens",
            )
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            bad(f"logprobs must be in [0, 20], got {self.logprobs}", "logprobs")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            bad("stop must be non-empty strings", "stop")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed must be an integer", "seed")
        if self.golden_token_ids is not None and any(
            not isinstance(t, int) or t < 0 for t in self.golden_token_ids
        ):
            bad("golden_token_ids must be non-negative token ids", "golden_token_ids")
