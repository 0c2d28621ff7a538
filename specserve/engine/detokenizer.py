"""Incremental detokenization with stop-string detection.

The engine appends output tokens one at a time; after each token it needs (a) the text
that just became visible, to search for stop strings, and (b) a streaming delta that a
later stop match can never retract. Both must cost O(token length + longest stop) per
token, so nothing here ever re-decodes the whole output.

Decoding uses the prefix/read-offset technique on a small sliding window of ids:

    window = [ context ids (already emitted) | pending ids (not emitted yet) ]
    delta  = decode(window)[len(decode(context)):]

The context ids make tokenizer-specific boundary rules come out right: SentencePiece
decoders strip the leading space of the *first* decoded token, and byte-level BPE tokens
can end in the middle of a multi-byte UTF-8 character. Decoding context+pending and
subtracting the context text applies the same rules the full decode would. A window
whose text ends in U+FFFD is an incomplete character: we keep waiting for more tokens
rather than emitting a replacement char that a full decode would not contain.

Why `backend_tokenizer.decode(ids)` instead of `convert_ids_to_tokens` +
`convert_tokens_to_string`: for fast tokenizers `PreTrainedTokenizerBase.decode` *is*
the backend decode (plus an optional space clean-up), so the window decode matches the
reference text by construction, including how special tokens are skipped; it is one
Rust call (~2.5 us for a 5-token window) with no per-token Python work, and it is no
slower than the decoder-on-token-strings route, which would also need our own copy of
the special-token filtering.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"

# Hard upper bound on ids waiting in the window. Real text resolves within a few tokens
# (a UTF-8 char is at most 4 bytes); only garbage byte streams can keep a window open, and
# this bounds the per-token decode cost for them. Past the cap the pending text is emitted
# as-is, which can differ from a full decode only for such pathological streams.
MAX_PENDING_TOKENS = 64

# SentencePiece byte fallback (`<0xE6>` tokens) decodes a whole run of byte tokens at
# once and turns *every* byte of an invalid run into U+FFFD, so a later bad byte can
# retroactively change an earlier valid one. We therefore hold a window that ends in a
# byte token until the run ends, but only this long: valid text never needs it, and a
# shorter cap than MAX_PENDING_TOKENS lets long runs of byte-encoded CJK still stream.
MAX_BYTE_RUN_HOLD = 16


@dataclass(frozen=True, slots=True)
class StopMatch:
    """A stop string was found in the output text."""

    stop_str: str
    # index (0-based, among all appended tokens) of the token whose append revealed the
    # match; usually the one that completed it, later only if that text was still pending
    # (an open SentencePiece byte run) or flush() revealed it
    token_index: int
    # character offset of the stop string's first char in the (untrimmed) output text
    text_offset: int


@dataclass(frozen=True, slots=True)
class _TokenizerInfo:
    """What the window decoder needs from a tokenizer, computed once per tokenizer."""

    decode: Callable[[list[int], bool], str]
    special_ids: frozenset[int]  # ids that skip_special_tokens drops
    id_to_token: Callable[[int], str | None] | None  # set only for byte-fallback decoders
    # a byte-level decoder alone (GPT-2 style BPE): the text of ids is the UTF-8 decode of
    # their bytes joined, so whole characters decode the same alone as after anything ending
    # on a character boundary
    byte_level: bool = False
    # decode([id]) by id, for the window decoders of every request: a window of one id (the
    # context after each emission, usually) decodes the same whatever came before it
    single: dict[int, str] = field(default_factory=dict)


_INFO_CACHE: weakref.WeakKeyDictionary[object, _TokenizerInfo] = weakref.WeakKeyDictionary()


def _tokenizer_info(tokenizer: PreTrainedTokenizerBase) -> _TokenizerInfo:
    info = _INFO_CACHE.get(tokenizer)
    if info is not None:
        return info
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        info = _TokenizerInfo(
            decode=lambda ids, skip: backend.decode(ids, skip_special_tokens=skip),
            # the backend skips exactly its added tokens flagged special
            special_ids=frozenset(
                i for i, t in backend.get_added_tokens_decoder().items() if t.special
            ),
            # the Python bindings expose no decoder tree, but its repr names every step
            id_to_token=backend.id_to_token if "ByteFallback" in repr(backend.decoder) else None,
            byte_level=repr(backend.decoder).startswith("ByteLevel("),
        )
    else:  # slow tokenizer: correct, just not as cheap
        info = _TokenizerInfo(
            decode=lambda ids, skip: tokenizer.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
            ),
            special_ids=frozenset(tokenizer.all_special_ids),
            id_to_token=None,
        )
    _INFO_CACHE[tokenizer] = info
    return info


def _is_byte_token(token: str | None) -> bool:
    return token is not None and len(token) == 6 and token.startswith("<0x") and token[-1] == ">"


class _WindowDecoder:
    """Turns a stream of token ids into text deltas by decoding a small id window."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> None:
        info = _tokenizer_info(tokenizer)
        self._decode_fn = info.decode
        # one-id windows decode skipping specials or not alike: those ids never enter a window
        # that skips them, and the cache holds only ids a window held
        self._single = info.single
        self._byte_level = info.byte_level
        self._skip = skip_special_tokens
        # filtering skipped specials up front keeps them out of the window, so they never
        # crowd out the context a boundary rule needs
        self._skip_ids = info.special_ids if skip_special_tokens else frozenset()
        self._id_to_token = info.id_to_token
        self._ids: list[int] = []  # ids[:read] emitted context, ids[read:] pending
        self._read = 0
        self._context_text = ""  # == decode(ids[:read]), cached

    @property
    def window_size(self) -> int:
        return len(self._ids)

    def push(self, token_id: int) -> str:
        """Adds a token; returns the text it (and earlier pending tokens) completed."""
        if token_id in self._skip_ids:
            return ""
        self._ids.append(token_id)
        pending = len(self._ids) - self._read
        if pending == 1 and self._byte_level and not self._context_text.endswith(REPLACEMENT_CHAR):
            # the context ends on a character boundary: a token of whole characters adds its
            # own text, which the window decode below would find too (and emit the same way)
            text = self._single_text(token_id)
            if text and REPLACEMENT_CHAR not in text:
                del self._ids[:-1]
                self._read, self._context_text = 1, text
                return text
        if (
            self._id_to_token is not None
            and pending < MAX_BYTE_RUN_HOLD
            and _is_byte_token(self._id_to_token(token_id))
        ):
            return ""  # byte run still open: its text is not final yet
        text = self._decode_fn(self._ids, self._skip)
        if pending < MAX_PENDING_TOKENS and (
            text.endswith(REPLACEMENT_CHAR) or len(text) <= len(self._context_text)
        ):
            # incomplete UTF-8 sequence, or nothing visible yet (e.g. a lone SentencePiece
            # space): wait, keeping the context so the next decode sees the same boundary
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Emits whatever is pending, even an incomplete character (as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        return self._emit(self._decode_fn(self._ids, self._skip))

    def _emit(self, text: str) -> str:
        delta = text[len(self._context_text) :]
        # the ids just emitted become the context for the next window; older ids can no
        # longer influence any boundary rule, so dropping them keeps decodes O(window)
        del self._ids[: self._read]
        ids = self._ids
        self._read = len(ids)
        if len(ids) == 1:
            self._context_text = self._single_text(ids[0])
        else:
            self._context_text = self._decode_fn(ids, self._skip)
        return delta

    def _single_text(self, token_id: int) -> str:
        text = self._single.get(token_id)
        if text is None:
            text = self._single[token_id] = self._decode_fn([token_id], self._skip)
        return text

    def decode_all(self, ids: list[int]) -> str:
        """The text of a whole output at once (what flush() after pushing each id gives)."""
        skip = self._skip_ids
        return self._decode_fn([i for i in ids if i not in skip] if skip else ids, self._skip)


class IncrementalDetokenizer:
    """Per-request detokenizer: appends tokens, finds stop strings, streams safe text.

    Invariants:
      - `text` never contains a stop string: on a match it is cut right before the stop
        string, or right after it with `include_stop_str_in_output`.
      - Without a stop match, `text` after `flush()` == `tokenizer.decode(output_ids,
        skip_special_tokens=...)` (with `clean_up_tokenization_spaces=False`), and the
        concatenation of all `take_delta()` results plus `flush()` == `text`.

    `prompt_token_ids` is accepted for API symmetry but deliberately not used as decode
    context: with SentencePiece tokenizers a prompt context would keep the leading space
    of the first output token, which `decode(output_ids)` strips.

    `defer=True` (a caller that reads the text only at the end, e.g. LLM.generate) with no
    stop strings makes it `deferred`: nothing is decoded per token; `take_delta()` gives ""
    and `flush()` the whole text, `tokenizer.decode(output_ids)` in one call (by the invariant
    above, what the deltas would have added up to). A deferred detokenizer need not be fed
    token by token: `flush(ids)` decodes the output ids given. With stop strings the text is
    needed after each token to find them, so `defer` has no effect.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str],
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        defer: bool = False,
    ) -> None:
        self._decoder = _WindowDecoder(tokenizer, skip_special_tokens)
        # an empty stop string would match everywhere: treat it as absent
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        # decodes at flush() only (class docstring); _deferred: the ids appended until then
        self.deferred = defer and not self._stops
        self._deferred: list[int] | None = [] if self.deferred else None
        # a future match must end in future text, so it can start at most this many chars
        # back in the current text: that is both the search tail and the stream holdback
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self._include_stop = include_stop_str_in_output
        # visible text kept as chunks: appending to one str attribute would copy it per token
        self._chunks: list[str] = []
        self._len = 0
        self._tail = ""  # last `_holdback` chars of the visible text
        self._streamed = 0  # chars of the visible text already handed out by take_delta
        self._num_tokens = 0
        self._stop_match: StopMatch | None = None
        self._finished = False
        # stop strings only count once more than min_tokens tokens are out (vLLM semantics)
        self._min_tokens = min_tokens

    @property
    def text(self) -> str:
        """Full visible output text so far (already trimmed at a stop).

        O(len(text)) after new text arrived (one join); per-token consumers should use
        `take_delta` instead.
        """
        if len(self._chunks) > 1:
            # coalesce so repeated reads (and later suffix walks) stay cheap
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def has_stops(self) -> bool:
        """Stop strings to find: the text is needed after each token, before its stop check."""
        return bool(self._stops)

    @property
    def stop_match(self) -> StopMatch | None:
        return self._stop_match

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def append(self, token_id: int) -> StopMatch | None:
        """Adds one output token; returns the stop match it completed, if any."""
        if self._finished:
            raise RuntimeError("append() after the detokenizer finished")
        token_index = self._num_tokens
        self._num_tokens += 1
        if self._deferred is not None:
            self._deferred.append(token_id)
            return None
        delta = self._decoder.push(token_id)
        if not delta:
            return None
        if not self._stops:  # fast path: nothing to search, nothing to hold back
            self._chunks.append(delta)
            self._len += len(delta)
            return None
        return self._accept(delta, token_index, search=token_index >= self._min_tokens)

    def append_text(self, token_id: int) -> str:
        """append() then take_delta(), for a detokenizer without stop strings (nothing held
        back, nothing to find): the text this token made visible."""
        if self._stops or self._deferred is not None or self._streamed != self._len:
            self.append(token_id)
            return self.take_delta()
        if self._finished:
            raise RuntimeError("append() after the detokenizer finished")
        self._num_tokens += 1
        delta = self._decoder.push(token_id)
        if delta:
            self._chunks.append(delta)
            self._len += len(delta)
            self._streamed = self._len
        return delta

    def take_delta(self) -> str:
        """Text made visible since the last call that no later stop match can cut."""
        end = self._len if self._finished else self._len - self._holdback
        if end <= self._streamed:
            return ""
        n = self._len - self._streamed
        last = self._chunks[-1]
        if len(last) >= n:  # one token's text, usually: no join
            out = last[len(last) - n : len(last) - n + end - self._streamed]
        else:
            out = self._suffix(n)[: end - self._streamed]
        self._streamed = end
        return out

    def flush(self, ids: list[int] | None = None) -> str:
        """Finishes the request (any reason) and returns all not-yet-streamed text.

        Pending text is decoded now; if it completes a stop string, the text is cut there
        and `stop_match` is set, just as `append` would have done. Deferred: the text of `ids`,
        the whole output, when given (else of the ids appended).
        """
        if not self._finished and self._deferred is not None:
            self._append_text(self._decoder.decode_all(self._deferred if ids is None else ids))
            self._deferred = None
            self._finished = True
        if not self._finished:
            delta = self._decoder.flush()
            if delta:
                # pending ids can hold complete chars ahead of an incomplete one, so the
                # flushed text is still checked: the output must never contain a stop string
                if self._stops:
                    self._accept(delta, self._num_tokens - 1)
                else:
                    self._append_text(delta)
            self._finished = True
        return self.take_delta()

    def _accept(self, delta: str, token_index: int, search: bool = True) -> StopMatch | None:
        """Appends newly visible text, cutting it at the earliest stop string."""
        window = self._tail + delta
        # only matches that end in the new text: one lying wholly in the tail was either
        # searched already or came before min_tokens (and must not stop the request later)
        found = self._find_stop(window, len(self._tail)) if search else None
        if found is None:
            self._append_text(delta)
            self._tail = window[max(0, len(window) - self._holdback) :] if self._holdback else ""
            return None
        start, stop_str = found
        window_base = self._len - len(self._tail)  # text offset of window[0]
        end = start + len(stop_str) if self._include_stop else start
        keep = end - len(self._tail)  # chars of `delta` to keep; < 0 cuts into the tail
        if keep >= 0:
            self._append_text(delta[:keep])
        else:
            # safe: the tail is exactly the held-back part, never streamed yet
            self._truncate(self._len + keep)
        self._stop_match = StopMatch(stop_str, token_index, window_base + start)
        self._finished = True
        return self._stop_match

    def _find_stop(self, window: str, min_end: int) -> tuple[int, str] | None:
        # earliest start wins, whatever the list order; on a tie the shorter one, which
        # is the one that would have matched first had the text arrived char by char
        best: tuple[int, str] | None = None
        for s in self._stops:
            i = window.find(s, max(0, min_end - len(s) + 1))
            if i >= 0 and (best is None or (i, len(s)) < (best[0], len(best[1]))):
                best = (i, s)
        return best

    def _append_text(self, s: str) -> None:
        if s:
            self._chunks.append(s)
            self._len += len(s)

    def _suffix(self, n: int) -> str:
        """Last `n` chars of the visible text; walks only the chunks it needs."""
        if n <= 0:
            return ""
        parts: list[str] = []
        got = 0
        for chunk in reversed(self._chunks):
            parts.append(chunk)
            got += len(chunk)
            if got >= n:
                break
        joined = "".join(reversed(parts))
        return joined[max(0, len(joined) - n) :]

    def _truncate(self, new_len: int) -> None:
        while self._chunks and self._len - len(self._chunks[-1]) >= new_len:
            self._len -= len(self._chunks.pop())
        if self._len > new_len:
            last = self._chunks[-1]
            self._chunks[-1] = last[: len(last) - (self._len - new_len)]
            self._len = new_len
