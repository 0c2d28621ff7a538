"""Structured outputs (JSON schemas, regex, choice, grammars) and tool calling.

params.py   the constraint a request carries (vLLM's StructuredOutputsParams)
backend.py  xgrammar compiler, LRU cache of compiled grammars, compile thread
matcher.py  one request's grammar state: advanced by emitted tokens, rolled through drafts
drafts.py   drafts checked by the matcher before verification
tools.py    tool definitions, tool_choice, the tool-call constraint of a chat template's format
tool_parser.py  model output -> OpenAI tool_calls (whole and streamed)
"""

from specserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
