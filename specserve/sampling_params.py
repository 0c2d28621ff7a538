"""Per-request sampling and stopping parameters (vLLM-shaped)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    # --- begin block: logits processing and prompt logprobs (helper "sampling"; vLLM meaning) ---
    # logit_bias: token id -> bias in [-100, 100], added to the raw logits of every sampled row
    logit_bias: dict[int, float] | None = None
    # allowed_token_ids: only these ids can be sampled (non-empty)
    allowed_token_ids: list[int] | None = None
    # bad_words: a word's last token is banned where the output so far ends with its other tokens
    bad_words: list[str] | None = None
    # prompt_logprobs: None off; N >= 0: logprob of each prompt token given its prefix + top-N
    prompt_logprobs: int | None = None
    # bad_words tokenized (with and without a leading space) by resolve_bad_words at request entry
    bad_words_token_ids: list[list[int]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )
    # --- end block ---

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
        self._validate_logits_processing()

    # --- begin block: logits processing and prompt logprobs (helper "sampling") ---------------
    @property
    def has_logits_processing(self) -> bool:
        """Any of logit_bias / allowed_token_ids / bad_words set (the sampler's slow path)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def reads_output_tokens(self) -> bool:
        """The sampler needs every output token on the host (penalties, bad words), so a step
        of this request cannot overlap the one in flight."""
        return self.has_penalties or bool(self.bad_words)

    def _validate_logits_processing(self) -> None:
        """Types and ranges (vocabulary-free); normalises the values it accepts."""

        def bad(msg: str, param: str) -> None:
            raise InvalidRequestError(msg, param)

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias must be a map from token id to bias", "logit_bias")
            bias: dict[int, float] = {}
            for k, v in self.logit_bias.items():
                if not is_int(k) or k < 0:
                    bad(f"logit_bias keys must be non-negative token ids, got {k!r}", "logit_bias")
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    bad(f"logit_bias values must be numbers, got {v!r}", "logit_bias")
                if not (-100.0 <= v <= 100.0):  # NaN fails this too; so does +-inf
                    bad(f"logit_bias values must be in [-100, 100], got {v!r}", "logit_bias")
                bias[int(k)] = float(v)
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids:
                bad("allowed_token_ids must be a non-empty list of token ids", "allowed_token_ids")
            if any(not is_int(t) or t < 0 for t in ids):
                bad("allowed_token_ids must be non-negative token ids", "allowed_token_ids")
            self.allowed_token_ids = [int(t) for t in ids]
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or any(
                not isinstance(w, str) or w == "" for w in words
            ):
                bad("bad_words must be a list of non-empty strings", "bad_words")
            self.bad_words = list(words)
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or not (0 <= self.prompt_logprobs <= 20)
        ):
            bad(
                f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs!r}",
                "prompt_logprobs",
            )

    def _validate_logits_processing_for_model(self, vocab_size: int) -> None:
        """Token ids of logit_bias / allowed_token_ids must be in the model's vocabulary."""
        if self.logit_bias and max(self.logit_bias) >= vocab_size:
            raise InvalidRequestError(
                f"logit_bias token ids must be in [0, {vocab_size})", "logit_bias"
            )
        if self.allowed_token_ids and max(self.allowed_token_ids) >= vocab_size:
            raise InvalidRequestError(
                f"allowed_token_ids must be in [0, {vocab_size})", "allowed_token_ids"
            )

    def resolve_bad_words(self, tokenizer, vocab_size: int) -> None:
        """Tokenize bad_words into bad_words_token_ids (vLLM's rule): each word with its leading
        whitespace stripped, and again with one leading space; the spaced variant is kept only
        when it tokenizes to as many tokens as the bare one but starts with another token (so
        a word is banned at the start of the text and in its middle)."""
        self.bad_words_token_ids = []
        if not self.bad_words:
            return
        if tokenizer is None:
            raise InvalidRequestError("bad_words needs a model with a tokenizer", "bad_words")
        for word in self.bad_words:
            bare = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if bare:
                self.bad_words_token_ids.append(bare)
            if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
                self.bad_words_token_ids.append(spaced)
        if any(t < 0 or t >= vocab_size for w in self.bad_words_token_ids for t in w):
            raise InvalidRequestError(
                f"bad_words tokenize to token ids outside [0, {vocab_size})", "bad_words"
            )

    # --- end block ---
