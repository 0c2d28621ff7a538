"""Per-request sampling and stopping parameters (vLLM-shaped).

Every field is checked for its type and range where a request enters (construction, and again in
LLMEngine.add_request, which also runs the model-dependent checks of validate_for_model): a bad
value raises InvalidRequestError naming the field before any work is queued, so it can never
reach a kernel and fail a whole batch. bool is refused where an int is expected (True is an int
in Python), and so is a float, even an integral one.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from specserve.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # the RNG keeps a seed's low 64 bits (ops/random.py)
FLOAT32_MAX = 3.4028234663852886e38  # floats reach the sampler as float32: larger ones are inf


class InvalidRequestError(ValueError):
    """A request parameter a user got wrong; `param` names it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param)


def _show(x: Any) -> str:
    """A value for an error message, cut short (a user's 10**400 is 401 digits)."""
    r = repr(x)
    return r if len(r) <= 40 else r[:37] + "..."


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _int(x: Any, name: str, lo: int | None = None, hi: int | None = None, what: str = "") -> int:
    """x as a Python int, or InvalidRequestError unless it is an int (not a bool) in [lo, hi]."""
    if not _is_int(x):
        raise _bad(f"{name} must be an integer, got {type(x).__name__} {_show(x)}", name)
    x = int(x)
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        raise _bad(f"{name} must be {what or _range(lo, hi)}, got {_show(x)}", name)
    return x


def _range(lo: float | None, hi: float | None) -> str:
    if hi is None:
        return f">= {lo}"
    if lo is None:
        return f"<= {hi}"
    return f"in [{lo}, {hi}]"


def _float(x: Any, name: str) -> float:
    """x as a finite Python float (ints accepted, bools and non-numbers refused)."""
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        raise _bad(f"{name} must be a number, got {type(x).__name__} {_show(x)}", name)
    try:
        f = float(x)
    except OverflowError:  # an int too large for a float
        f = math.inf
    if not math.isfinite(f) or abs(f) > FLOAT32_MAX:
        raise _bad(f"{name} must be a finite number, got {_show(x)}", name)
    return f


def _bool(x: Any, name: str) -> bool:
    if not isinstance(x, bool):
        raise _bad(f"{name} must be a boolean, got {type(x).__name__} {_show(x)}", name)
    return x


def _token_ids(x: Any, name: str) -> list[int]:
    """A list of non-negative token ids (the model's upper bound: validate_for_model)."""
    if isinstance(x, (str, bytes, dict, set)) or not hasattr(x, "__iter__"):
        raise _bad(f"{name} must be a list of token ids, got {type(x).__name__}", name)
    return [_int(t, name, 0, what="non-negative token ids") for t in x]


def _check_vocab(ids: list[int] | None, name: str, vocab_size: int) -> None:
    if ids and max(ids) >= vocab_size:
        raise _bad(f"{name} must be token ids in [0, {vocab_size}), got {max(ids)}", name)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off; >= the vocabulary size: off too (vLLM)
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
    # keep only the last k prompt tokens (vLLM); -1: the last max_model_len; None: keep all
    truncate_prompt_tokens: int | None = None
    # teacher forcing (benchmarks, tests): output token i is golden_token_ids[i] while there is one;
    # drafts are accepted exactly when they match it, so acceptance can be dialled in
    golden_token_ids: list[int] | None = None
    # logits processing and prompt logprobs (vLLM meaning)
    # logit_bias: token id -> bias in [-100, 100], added to the raw logits of every sampled row
    logit_bias: dict[int, float] | None = None
    # allowed_token_ids: only these ids can be sampled (non-empty)
    allowed_token_ids: list[int] | None = None
    # bad_words: a word's last token is banned where the output so far ends with its other tokens
    bad_words: list[str] | None = None
    # prompt_logprobs: None off; N >= 0: logprob of each prompt token given its prefix + top-N
    prompt_logprobs: int | None = None
    # structured outputs (vLLM's shape): json / regex / choice / grammar / json_object /
    # structural_tag; a dict is taken as StructuredOutputsParams' fields
    structured_outputs: StructuredOutputsParams | dict | None = None
    # bad_words tokenized (with and without a leading space) by resolve_bad_words at request entry
    bad_words_token_ids: list[list[int]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
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
        """Check every field's type and range, normalising in place (plain Python ints and
        floats, stop as a list, top_k -1 as 0). Idempotent: the engine runs it again at
        add_request, so a field changed after construction is checked too."""
        self.n = _int(self.n, "n", 1)
        self.temperature = _float(self.temperature, "temperature")
        if self.temperature < 0.0:
            raise _bad(f"temperature must be >= 0, got {self.temperature}", "temperature")
        self.top_p = _float(self.top_p, "top_p")
        if not 0.0 < self.top_p <= 1.0:
            raise _bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        self.top_k = _int(self.top_k, "top_k", -1, what="-1 or 0 (off), or at least 1")
        self.top_k = max(self.top_k, 0)
        self.min_p = _float(self.min_p, "min_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise _bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.seed is not None:
            self.seed = _int(self.seed, "seed", SEED_MIN, SEED_MAX, "a 64-bit integer")
        for name in ("presence_penalty", "frequency_penalty"):
            v = _float(getattr(self, name), name)
            if not -2.0 <= v <= 2.0:
                raise _bad(f"{name} must be in [-2, 2], got {v}", name)
            setattr(self, name, v)
        self.repetition_penalty = _float(self.repetition_penalty, "repetition_penalty")
        if self.repetition_penalty <= 0.0:
            raise _bad(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                "repetition_penalty",
            )
        if self.max_tokens is not None:
            self.max_tokens = _int(self.max_tokens, "max_tokens", 1, what="at least 1")
        self.min_tokens = _int(self.min_tokens, "min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                "min_tokens",
            )
        self.stop = self._stop_list(self.stop)
        self.stop_token_ids = _token_ids(self.stop_token_ids or [], "stop_token_ids")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            _bool(getattr(self, name), name)
        if self.logprobs is not None:
            self.logprobs = _int(self.logprobs, "logprobs", 0, MAX_LOGPROBS)
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = _int(
                self.truncate_prompt_tokens, "truncate_prompt_tokens", -1
            )
            if self.truncate_prompt_tokens == 0:
                raise _bad(
                    "truncate_prompt_tokens must be -1 (max_model_len) or at least 1, got 0",
                    "truncate_prompt_tokens",
                )
        if self.golden_token_ids is not None:
            self.golden_token_ids = _token_ids(self.golden_token_ids, "golden_token_ids")
        self._validate_logits_processing()
        self._validate_structured_outputs()

    def _validate_structured_outputs(self) -> None:
        if self.structured_outputs is None:
            return
        so = StructuredOutputsParams.from_dict(self.structured_outputs)
        so.validate()
        self.structured_outputs = so
        if self.min_tokens > 0:
            # a grammar that completes must be able to end the request at once
            raise _bad("min_tokens cannot be combined with structured_outputs", "min_tokens")

    @staticmethod
    def _stop_list(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        elif not isinstance(stop, (list, tuple)):
            raise _bad(
                f"stop must be a string or a list of strings, got {type(stop).__name__}", "stop"
            )
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise _bad("stop must be non-empty strings", "stop")
        return list(stop)

    def validate_for_model(self, vocab_size: int, max_model_len: int) -> None:
        """The checks that need the model: token ids below its vocabulary size, top_k clamped to
        it (a top_k >= the vocabulary keeps every token, as in vLLM: 0, off, so a huge value
        never reaches the sampler's int32 tables), truncate_prompt_tokens within its context."""
        _check_vocab(self.stop_token_ids, "stop_token_ids", vocab_size)
        _check_vocab(self.golden_token_ids, "golden_token_ids", vocab_size)
        _check_vocab(list(self.logit_bias or ()), "logit_bias", vocab_size)
        _check_vocab(self.allowed_token_ids, "allowed_token_ids", vocab_size)
        if self.top_k >= vocab_size:
            self.top_k = 0
        k = self.truncate_prompt_tokens
        if k is not None and k > max_model_len:
            raise _bad(
                f"truncate_prompt_tokens ({k}) must not exceed max_model_len ({max_model_len})",
                "truncate_prompt_tokens",
            )

    # -- logits processing and prompt logprobs ---------------------------------------------
    @property
    def has_logits_processing(self) -> bool:
        """Any of logit_bias / allowed_token_ids / bad_words / structured_outputs set (the
        sampler's slow path)."""
        return (
            bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
            or self.structured_outputs is not None
        )

    @property
    def reads_output_tokens(self) -> bool:
        """The sampler needs every output token on the host (penalties, bad words, the grammar
        of structured outputs): under overlap this request's sampling is planned after the
        ledger of the step in flight (step_launch.py), and it verifies no device drafts."""
        return self.has_penalties or bool(self.bad_words) or self.structured_outputs is not None

    def _validate_logits_processing(self) -> None:
        """Types and ranges of logit_bias, allowed_token_ids, bad_words, prompt_logprobs
        (vocabulary bounds: validate_for_model); normalises what it accepts."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise _bad(
                    f"logit_bias must be a map from token id to bias, got "
                    f"{type(self.logit_bias).__name__}",
                    "logit_bias",
                )
            bias: dict[int, float] = {}
            for k, v in self.logit_bias.items():
                tok = _int(k, "logit_bias", 0, what="keyed by non-negative token ids")
                b = _float(v, "logit_bias")
                if not -100.0 <= b <= 100.0:
                    raise _bad(f"logit_bias values must be in [-100, 100], got {b}", "logit_bias")
                bias[tok] = b
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids(self.allowed_token_ids, "allowed_token_ids")
            if not self.allowed_token_ids:
                raise _bad("allowed_token_ids must not be empty", "allowed_token_ids")
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or any(
                not isinstance(w, str) or w == "" for w in words
            ):
                raise _bad("bad_words must be a list of non-empty strings", "bad_words")
            self.bad_words = list(words)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int(self.prompt_logprobs, "prompt_logprobs", 0, MAX_LOGPROBS)

    def resolve_bad_words(self, tokenizer: Any, vocab_size: int) -> None:
        """Tokenize bad_words into bad_words_token_ids (vLLM's rule): each word with its leading
        whitespace stripped, and again with one leading space; the spaced variant is kept only
        when it tokenizes to as many tokens as the bare one but starts with another token (so
        a word is banned at the start of the text and in its middle). The engine calls it at
        add_request: a model without a tokenizer refuses bad_words."""
        self.bad_words_token_ids = []
        if not self.bad_words:
            return
        if tokenizer is None:
            raise _bad("bad_words needs a model with a tokenizer", "bad_words")
        for word in self.bad_words:
            bare = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if bare:
                self.bad_words_token_ids.append(bare)
            if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
                self.bad_words_token_ids.append(spaced)
        if any(t < 0 or t >= vocab_size for w in self.bad_words_token_ids for t in w):
            raise _bad(f"bad_words tokenize to token ids outside [0, {vocab_size})", "bad_words")

    def check_some_token_allowed(self, eos_ids: Seq[int]) -> None:
        """allowed_token_ids that the request's own bans leave empty would sample from a row of
        -inf: refused here when it shows before any token (one-token bad words, min_tokens
        banning the stop ids); a multi-token bad word that empties a later row ends the request
        at that step (runner/logits_plan.py)."""
        if self.allowed_token_ids is None:
            return
        allowed = set(self.allowed_token_ids)
        always = {w[0] for w in self.bad_words_token_ids if len(w) == 1}
        if allowed <= always:
            raise _bad("bad_words ban every token allowed_token_ids permits", "allowed_token_ids")
        stops = set(self.stop_token_ids or ()) | (set() if self.ignore_eos else set(eos_ids))
        if self.min_tokens > 0 and allowed <= always | stops:
            raise _bad(
                "before min_tokens every token allowed_token_ids permits is banned", "min_tokens"
            )
