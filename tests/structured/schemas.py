"""JSON schemas for the structured-output tests: nested objects, arrays, enums, bounded numbers,
required fields, pattern strings, refs. Strings and arrays are bounded so that a random-weight
model's output completes within a test's max_tokens (an unbounded string waits for a random
closing quote)."""

from __future__ import annotations

from typing import Any

S = {"type": "string", "maxLength": 6}
INT = {"type": "integer", "minimum": -50, "maximum": 50}


def obj(props: dict[str, Any], required: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
        **kw,
    }


SCHEMAS: list[dict[str, Any]] = [
    obj({"a": INT}),
    obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"ok": {"type": "boolean"}}),
    obj({"x": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"n": {"type": "null"}}),
    obj({"v": {"const": "fixed"}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}),
    obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    obj({"id": {"type": "string", "pattern": "^[a-f0-9]{4}-[a-f0-9]{2}$"}}),
    obj({"tags": {"type": "array", "items": S, "maxItems": 3}}),
    obj({"nums": {"type": "array", "items": INT, "minItems": 1, "maxItems": 4}}),
    obj({"flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}}),
    obj({"p": obj({"x": INT, "y": INT})}),
    obj({"outer": obj({"inner": obj({"leaf": {"enum": [1, 2, 3]}})})}),
    obj({"a": INT, "b": S}, required=["a"]),
    obj({"a": INT, "b": {"type": "boolean"}, "c": {"type": "null"}}, required=["c"]),
    obj({"u": {"anyOf": [INT, {"type": "boolean"}]}}),
    obj({"u": {"anyOf": [{"type": "null"}, S]}}),
    obj({"items": {"type": "array", "items": obj({"k": S, "v": INT}), "maxItems": 2}}),
    obj(
        {
            "matrix": {
                "type": "array",
                "maxItems": 2,
                "items": {"type": "array", "items": INT, "maxItems": 2},
            }
        }
    ),  # fmt: skip
    obj({"level": {"type": "integer", "minimum": 1, "maximum": 5}}),
    obj({"neg": {"type": "integer", "minimum": -9, "maximum": -1}}),
    obj({"big": {"type": "integer", "minimum": 1000, "maximum": 1010}}),
    obj({"ratio": {"type": "number", "minimum": -2.5, "maximum": 2.5}}),
    obj({"status": {"enum": ["active", "inactive", None]}}),
    obj({"mixed": {"enum": [1, "one", True]}}),
    obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    obj({"word": {"type": "string", "minLength": 2, "maxLength": 4}}),
    obj({"email": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"}}),
    obj(
        {
            "person": obj(
                {
                    "name": S,
                    "langs": {"type": "array", "items": {"enum": ["en", "fr"]}, "maxItems": 2},
                }
            )
        }
    ),  # fmt: skip
    obj({"a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {"type": "boolean"}}),
    obj({"point": {"type": "array", "prefixItems": [INT, INT], "items": False}}),
    obj({"k1": INT, "k2": INT, "k3": INT, "k4": INT}),
    obj({"s": {"type": "string", "enum": ["x", "yy", "zzz"]}}),
    obj({"empty": obj({})}),
    obj(
        {
            "list": {
                "type": "array",
                "items": obj({"on": {"type": "boolean"}}),
                "minItems": 1,
                "maxItems": 2,
            }
        }
    ),  # fmt: skip
    obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    obj({"opt": obj({"x": INT}, required=[])}),
    obj({"choice": {"oneOf": [obj({"kind": {"const": "a"}}), obj({"kind": {"const": "b"}})]}}),
    {
        "$defs": {"pt": obj({"x": INT, "y": INT})},
        **obj({"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}}),
    },  # fmt: skip
    obj(
        {
            "score": {"type": "integer", "minimum": 0, "maximum": 100},
            "grade": {"enum": ["A", "B", "C"]},
        }
    ),  # fmt: skip
    obj({"digits": {"type": "string", "pattern": "^[0-9]{1,3}$"}}),
    obj({"arr": {"type": "array", "items": {"type": "null"}, "maxItems": 3}}),
    obj(
        {
            "nested": {
                "type": "array",
                "maxItems": 2,
                "items": obj(
                    {"t": {"type": "array", "items": {"enum": ["p", "q"]}, "maxItems": 2}}
                ),
            }
        }
    ),  # fmt: skip
    obj({"yes": {"const": True}, "no": {"const": False}}),
    obj({"temp": {"type": "number", "minimum": -40, "maximum": 60}, "unit": {"enum": ["C", "F"]}}),
    obj({"city": S, "country": {"type": "string", "pattern": "^[A-Z]{2}$"}}),
    obj(
        {
            "q": {"type": "integer", "minimum": 0, "maximum": 9},
            "r": {"type": "integer", "minimum": 0, "maximum": 9},
        }
    ),  # fmt: skip
    obj({"title": S, "meta": obj({"pages": INT, "draft": {"type": "boolean"}})}),
    obj({"ip": {"type": "string", "pattern": "^[0-9]{1,3}\\.[0-9]{1,3}$"}}),
    obj({"any_small": {"anyOf": [INT, S, {"type": "boolean"}, {"type": "null"}]}}),
    {"type": "array", "items": INT, "minItems": 1, "maxItems": 3},
    {"enum": ["top-level", "enum"]},
    {"type": "integer", "minimum": 3, "maximum": 7},
]
