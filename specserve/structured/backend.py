"""The grammar backend: xgrammar's compiler over the model's vocabulary, an LRU cache of compiled
grammars keyed by the constraint, and a thread that compiles off the engine's critical path.

The bitmask covers the model's vocabulary, which may exceed the tokenizer's (padded embedding
rows): xgrammar never allows an id it has no token for, so those rows are always masked. The
stop tokens the grammar ends with are the model's EOS ids.

xgrammar is imported on first use, so the engine imports (and serves unconstrained requests)
without touching it.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from specserve.structured.matcher import MaskStats, RequestGrammar
from specserve.structured.params import FIELD, StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept (a JSON schema's is ~10-100 KB)
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _invalid(message: str) -> Exception:
    from specserve.sampling_params import InvalidRequestError

    return InvalidRequestError(message, FIELD)


# xgrammar 0.2.9 lets a length-bounded JSON string hold raw control characters (invalid JSON);
# its pattern path does not, so bounded strings become the same bounds as a pattern
_PLAIN_CHARS = '[^"\\\\\\x00-\\x1f]'  # no quote, backslash or control character


def bounded_strings(node: Any) -> Any:
    """A copy of a JSON schema (or structural tag) whose strings bounded by minLength /
    maxLength alone carry the bounds as a pattern over plain characters (no escapes)."""
    if isinstance(node, list):
        return [bounded_strings(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: bounded_strings(v) for k, v in node.items()}
    lengths = "minLength" in out or "maxLength" in out
    other = any(k in out for k in ("pattern", "format", "enum", "const"))
    if out.get("type") == "string" and lengths and not other:
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        if isinstance(lo, int) and (hi == "" or isinstance(hi, int)):
            out["pattern"] = f"^{_PLAIN_CHARS}{{{lo},{hi}}}$"
        else:  # malformed bounds: left for xgrammar to refuse
            out["minLength"], out["maxLength"] = lo, hi
    return out


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of the strings (JSON string escapes are xgrammar's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarBackend:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_ids: Iterable[int],
        cache_size: int = CACHE_SIZE,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's: the logits' width
        self.stop_ids = sorted(stop_ids)
        self.cache_size = cache_size
        self._info: Any = None
        self._compiler: Any = None
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()  # the cache
        self._init_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.num_compiled = 0  # cache misses (tests: the cache is used)
        self.stats = MaskStats()

    # -- set-up -------------------------------------------------------------------------------
    def _ensure(self) -> None:
        with self._init_lock:
            if self._compiler is not None:
                return
            if self.tokenizer is None:
                raise _invalid(f"{FIELD} needs a model with a tokenizer")
            import xgrammar as xgr

            vocab = max(self.vocab_size, len(self.tokenizer))
            self._info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=vocab, stop_token_ids=self.stop_ids or None
            )
            # our own LRU keyed by the request's constraint; xgrammar's cache would grow unbounded
            self._compiler = xgr.GrammarCompiler(self._info, max_threads=2, cache_enabled=False)

    @property
    def bitmask_width(self) -> int:
        """int32 words per bitmask row."""
        self._ensure()
        return (self._info.vocab_size + 31) // 32

    # -- compiling ----------------------------------------------------------------------------
    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of a constraint (cached); InvalidRequestError naming the field
        when it does not compile. Thread-safe."""
        self._ensure()
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        # compiled outside the lock: a cache hit in the engine thread never waits behind a big
        # schema compiling in the backend's thread (xgrammar's compiler is thread-safe)
        compiled = self._compile(spec)
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        c = self._compiler
        kind = spec.kind
        any_ws = not spec.disable_any_whitespace
        try:
            if kind == "json":
                schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
                schema = json.dumps(bounded_strings(schema))
                return c.compile_json_schema(schema, any_whitespace=any_ws)
            if kind == "json_object":
                # OpenAI: a JSON object (the builtin JSON grammar also allows arrays)
                return c.compile_json_schema('{"type": "object"}', any_whitespace=any_ws)
            if kind == "regex":
                return c.compile_regex(spec.regex)
            if kind == "choice":
                return c.compile_grammar(choice_grammar(spec.choice))
            if kind == "grammar":
                return c.compile_grammar(spec.grammar)
            tag = spec.structural_tag
            tag = json.loads(tag) if isinstance(tag, str) else tag
            return c.compile_structural_tag(json.dumps(bounded_strings(tag)))
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with its reason
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            first = _LOG_PREFIX.sub("", first)  # "[hh:mm:ss] /path/file.cc:123: " of xgrammar
            raise _invalid(f"{FIELD}.{kind}: cannot be compiled: {first[:300]}") from None

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """compile() in the backend's thread (the server compiles before queueing)."""
        with self._init_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="specserve-grammar")
        return self._pool.submit(self.compile, spec)

    def matcher(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher for one request (the compiled grammar from the cache)."""
        import xgrammar as xgr

        compiled = self.compile(spec)
        m = xgr.GrammarMatcher(compiled)  # rollback is unlimited in xgrammar >= 0.2
        return RequestGrammar(m, self.bitmask_width, self.stop_ids, self.stats)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
