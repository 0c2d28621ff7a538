"""What a request constrains its output to (vLLM's StructuredOutputsParams).

Exactly one constraint: a JSON schema, any JSON object, a regular expression, a choice among
strings, an EBNF grammar (xgrammar's dialect, GBNF-like), or an xgrammar structural tag. The
constraint is checked here for its shape; whether it compiles is the backend's question
(backend.py), asked at request entry so that a bad schema is a 400 before any work is queued.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specserve.sampling_params import InvalidRequestError

FIELD = "structured_outputs"
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
MAX_SPEC_CHARS = 1_000_000  # a schema or grammar this long is an attack, not a request


def _bad(message: str, sub: str | None = None) -> InvalidRequestError:
    # imported here: sampling_params imports this module
    from specserve.sampling_params import InvalidRequestError

    return InvalidRequestError(f"{FIELD}{'.' + sub if sub else ''}: {message}", FIELD)


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (a dict, or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF in xgrammar's dialect (GBNF-like: root ::= ...)
    json_object: bool | None = None  # any JSON object (OpenAI's json_object mode)
    structural_tag: str | dict | None = None  # xgrammar's structural tag (tool-call formats)
    # vLLM's options: whitespace between JSON tokens is free unless disabled
    disable_any_whitespace: bool = False
    # there is only one backend, so never a fallback; accepted for vLLM's clients
    disable_fallback: bool = False
    # xgrammar's strict mode already refuses properties a schema does not name
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None  # refused: xgrammar has no whitespace pattern

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_dict(cls, d: Any) -> StructuredOutputsParams:
        if isinstance(d, StructuredOutputsParams):
            return d
        if not isinstance(d, dict):
            raise _bad(f"must be an object, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise _bad(f"unknown field {unknown[0]!r}; known: {', '.join(sorted(names))}")
        return cls(**d)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def validate(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise _bad(
                f"exactly one of {', '.join(KINDS)} must be set, got "
                f"{', '.join(given) if given else 'none'}"
            )
        for name in ("disable_any_whitespace", "disable_fallback", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise _bad("must be a boolean", name)
        if self.whitespace_pattern is not None:
            raise _bad(
                "whitespace_pattern is not supported (xgrammar backend)", "whitespace_pattern"
            )
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except ValueError as e:
                    raise _bad(f"not valid JSON: {e}", "json") from None
            else:
                parsed = value
            if not isinstance(parsed, (dict, bool)):
                raise _bad("a JSON schema must be an object", "json")
        elif kind == "json_object":
            if value is not True:
                raise _bad("must be true", "json_object")
        elif kind == "choice":
            if (
                not isinstance(value, (list, tuple))
                or not value
                or any(not isinstance(c, str) or c == "" for c in value)
            ):
                raise _bad("must be a non-empty list of non-empty strings", "choice")
            self.choice = list(value)
        elif kind == "structural_tag":
            if isinstance(value, str):
                try:
                    json.loads(value)
                except ValueError as e:
                    raise _bad(f"not valid JSON: {e}", "structural_tag") from None
            elif not isinstance(value, dict):
                raise _bad("must be a JSON object or its text", "structural_tag")
        elif not isinstance(value, str) or value == "":
            raise _bad("must be a non-empty string", kind)
        if len(self.key()[1]) > MAX_SPEC_CHARS:
            raise _bad(f"longer than {MAX_SPEC_CHARS} characters", kind)

    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar (the backend's cache key): the kind, its value
        as canonical text, and whether whitespace is free."""
        kind = self.kind
        value = getattr(self, kind)
        if kind in ("json", "structural_tag"):
            v = json.loads(value) if isinstance(value, str) else value
            text = json.dumps(v, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            text = json.dumps(value)
        elif kind == "json_object":
            text = ""
        else:
            text = value
        return kind, text, not self.disable_any_whitespace
