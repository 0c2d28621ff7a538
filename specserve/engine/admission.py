"""A request enters the engine: its prompt and params checked against the model, then its
Sequence built (seed, grammar matcher, detokenizer). Every user error raises
InvalidRequestError here, before anything is queued, so no other request is touched."""

from __future__ import annotations

import copy
import numbers
from typing import TYPE_CHECKING

from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.sequence import Sequence
from specserve.sampling_params import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from specserve.llm_engine import LLMEngine


def admit(
    engine: LLMEngine,
    prompt: str | list[int],
    params: SamplingParams | None,
    request_id: str | None,
    arrival_time: float | None,
    defer_text: bool,
) -> Sequence:
    """The request's Sequence, not yet queued. It gets its own copy of params, checked again
    here (fields may have changed since construction) and against the model."""
    eng = engine
    params = copy.copy(params) if params is not None else SamplingParams()
    params.validate()
    vocab = eng.model_config.vocab_size
    params.validate_for_model(vocab, eng.max_model_len)
    params.resolve_bad_words(eng.tokenizer, vocab)
    params.check_some_token_allowed(eng.eos_ids)
    if isinstance(prompt, str):
        if prompt == "":
            raise InvalidRequestError("prompt must not be empty", "prompt")
        if eng.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: give token ids", "prompt")
        text: str | None = prompt
        ids = eng.tokenizer.encode(prompt)
    else:
        text, ids = None, prompt_ids(prompt)
    if not ids:
        raise InvalidRequestError("prompt must contain at least one token", "prompt")
    if any(i < 0 or i >= vocab for i in ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
    if params.truncate_prompt_tokens is not None:
        k = params.truncate_prompt_tokens
        ids = ids[-(eng.max_model_len if k == -1 else k) :]  # vLLM: the last k tokens
    # an id only once the request is known to be valid: a refused one takes none
    request_id = request_id or eng.new_request_id()
    if request_id in eng.requests:
        raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
    seed = params.seed if params.seed is not None else eng.seed_rng.getrandbits(63)
    seq = Sequence(request_id, text, ids, params, seed)
    if params.structured_outputs is not None:
        # compiled here, before queueing (the server compiles earlier, off this thread, and
        # finds it cached); a constraint that does not compile is the caller's error
        seq.grammar = eng.grammars.matcher(params.structured_outputs)
    if arrival_time is not None:
        seq.arrival_time = arrival_time
    if eng.tokenizer is not None:
        seq.detokenizer = IncrementalDetokenizer(
            eng.tokenizer,
            ids,
            params.stop,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
            params.min_tokens,
            defer=defer_text,
        )
    return seq


def prompt_ids(prompt: object) -> list[int]:
    """A token-id prompt as a list of ints, or InvalidRequestError naming `prompt`."""
    if isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__iter__"):
        raise InvalidRequestError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}", "prompt"
        )
    ids = list(prompt)
    if any(not isinstance(t, numbers.Integral) or isinstance(t, bool) for t in ids):
        raise InvalidRequestError("prompt token ids must be integers", "prompt")
    return [int(t) for t in ids]
