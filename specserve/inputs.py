"""Prompts the offline API takes, vLLM-shaped: a string, a list of token ids, a TextPrompt
{"prompt": str} or a TokensPrompt {"prompt_token_ids": [...]} — or a list of those.

Keys of vLLM's prompt dicts that specserve cannot honour (multi-modal data, prompt embeddings,
...) are refused by name, never dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any, TypedDict

from specserve.sampling_params import InvalidRequestError

# what the engine takes: text, or token ids
EnginePrompt = str | list[int]


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt

_ACCEPTED = "a str, a list of token ids, a TextPrompt {'prompt': ...} or a TokensPrompt"
# keys of vLLM's TextPrompt / TokensPrompt / EmbedsPrompt that have no meaning here
_UNSUPPORTED_KEYS = {
    "multi_modal_data": "multi-modal inputs are not supported",
    "mm_processor_kwargs": "multi-modal inputs are not supported",
    "multi_modal_uuids": "multi-modal inputs are not supported",
    "prompt_embeds": "prompt embeddings are not supported",
    "token_type_ids": "token type ids are not supported",
    "cache_salt": "prefix-cache salts are not supported",
}


def parse_prompts(prompts: PromptType | Sequence[PromptType]) -> list[EnginePrompt]:
    """One engine prompt per input prompt; InvalidRequestError (param "prompt") otherwise."""
    if isinstance(prompts, (str, dict)):
        return [parse_prompt(prompts)]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidRequestError(
            f"prompts of type {type(prompts).__name__} are not supported; pass {_ACCEPTED}, "
            "or a list of them",
            "prompt",
        )
    if prompts and all(_is_token_id(t) for t in prompts):
        return [parse_prompt(list(prompts))]  # one prompt given as token ids
    return [parse_prompt(p) for p in prompts]


def parse_prompt(p: Any) -> EnginePrompt:
    if isinstance(p, str):
        return p
    if isinstance(p, dict):
        return _parse_dict(p)
    if isinstance(p, (list, tuple)):
        return _token_ids(p, "prompt")
    raise InvalidRequestError(
        f"a prompt of type {type(p).__name__} is not supported; pass {_ACCEPTED}", "prompt"
    )


def _parse_dict(p: dict[str, Any]) -> EnginePrompt:
    for key, why in _UNSUPPORTED_KEYS.items():
        if key in p:
            raise InvalidRequestError(f"prompt key {key!r}: {why}", key)
    unknown = sorted(set(p) - {"prompt", "prompt_token_ids"})
    if unknown:
        raise InvalidRequestError(
            f"unknown prompt keys {unknown}; a prompt dict holds 'prompt' (TextPrompt) or "
            "'prompt_token_ids' (TokensPrompt)",
            unknown[0],
        )
    if "prompt_token_ids" in p:
        # vLLM keeps a TokensPrompt's optional "prompt" as display text only; the ids decide
        return _token_ids(p["prompt_token_ids"], "prompt_token_ids")
    if "prompt" not in p:
        raise InvalidRequestError(
            "a prompt dict needs 'prompt' (TextPrompt) or 'prompt_token_ids' (TokensPrompt)",
            "prompt",
        )
    text = p["prompt"]
    if not isinstance(text, str):
        raise InvalidRequestError(
            f"TextPrompt 'prompt' must be a str, got {type(text).__name__}", "prompt"
        )
    return text


def _is_token_id(t: Any) -> bool:
    return isinstance(t, Integral) and not isinstance(t, bool)


def _token_ids(ids: Any, param: str) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not all(_is_token_id(t) for t in ids):
        raise InvalidRequestError(f"{param} must be a list of integer token ids", param)
    return [int(t) for t in ids]
