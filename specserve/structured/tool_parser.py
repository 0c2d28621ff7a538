"""Model output -> OpenAI tool calls, whole or streamed.

A tool call that does not parse (bad JSON, no name) stays text: the client sees what the model
wrote rather than a call invented from it. Streamed, text outside calls is sent as it comes
(holding back only what could be the start of a call's opening tag); a call is sent whole once
its closing tag arrives (OpenAI clients accumulate argument deltas, and one delta holding all
the arguments is a valid stream).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from specserve.structured.tools import LLAMA3_JSON

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _call(obj: object) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_call(text: str) -> ParsedToolCall | None:
    try:
        return _call(json.loads(text))
    except ValueError:
        return None


def _llama_calls(text: str) -> list[ParsedToolCall] | None:
    """`{...}; {...}` (after an optional <|python_tag|>), or None when it is not all calls."""
    s = text.strip()
    if s.startswith(PYTHON_TAG):
        s = s[len(PYTHON_TAG) :].lstrip()
    if not s.startswith("{"):
        return None
    dec = json.JSONDecoder()
    calls, i = [], 0
    while i < len(s):
        try:
            obj, end = dec.raw_decode(s, i)
        except ValueError:
            return None
        call = _call(obj)
        if call is None:
            return None
        calls.append(call)
        i = end
        while i < len(s) and s[i] in " \t\n;":
            i += 1
    return calls


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, tool calls) of a whole output; content None when only calls were written."""
    p = StreamingToolParser(fmt)
    content, calls = p.feed(text)
    more, last = p.finish()
    content += more
    calls += last
    if calls and not content.strip():
        return None, calls
    return content, calls


class StreamingToolParser:
    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self._buf = ""
        self._in_call = False
        self._mode: str | None = None  # llama3_json: "calls" or "text", decided at the start
        self._after_call = False  # hermes: whitespace after a call separates calls, not text

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        """(text to send as content now, calls completed by this delta)."""
        self._buf += delta
        if self.fmt == LLAMA3_JSON:
            return self._feed_llama()
        return self._feed_hermes()

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """What is left when the output ends: a call cut short stays text unless its JSON is
        whole (a model that stops right after the arguments, without the closing tag)."""
        buf, self._buf = self._buf, ""
        if self.fmt == LLAMA3_JSON:
            if self._mode == "text" or not buf.strip():
                return buf, []
            calls = _llama_calls(buf)
            return ("", calls) if calls else (buf, [])
        if self._in_call:
            self._in_call = False
            call = _json_call(buf.strip())
            return ("", [call]) if call is not None else (OPEN + buf, [])
        return buf, []

    def _feed_llama(self) -> tuple[str, list[ParsedToolCall]]:
        if self._mode is None:
            head = self._buf.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and len(head) < len(PYTHON_TAG)):
                return "", []
            self._mode = "calls" if head.startswith(("{", PYTHON_TAG)) else "text"
        if self._mode == "calls":
            return "", []  # parsed whole at the end
        out, self._buf = self._buf, ""
        return out, []

    def _feed_hermes(self) -> tuple[str, list[ParsedToolCall]]:
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        while True:
            if not self._in_call:
                if self._after_call:
                    self._buf = self._buf.lstrip()
                    if not self._buf:
                        break
                    self._after_call = False
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = _partial_suffix(self._buf, OPEN)
                    cut = len(self._buf) - keep
                    content.append(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    break
                content.append(self._buf[:i])
                self._buf = self._buf[i + len(OPEN) :]
                self._in_call = True
            i = self._buf.find(CLOSE)
            if i < 0:
                break
            body, self._buf = self._buf[:i], self._buf[i + len(CLOSE) :]
            self._in_call = False
            call = _json_call(body.strip())
            if call is None:
                content.append(OPEN + body + CLOSE)
            else:
                calls.append(call)
                self._after_call = True
        return "".join(content), calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
