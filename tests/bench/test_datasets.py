from __future__ import annotations

import gzip
import io
import json
import zipfile

import pytest

from specserve import env
from specserve.bench import datasets as ds
from specserve.bench.datasets import (
    iter_json_array,
    load_humaneval_problems,
    load_humaneval_rewrite,
    load_sharegpt,
    load_sharegpt_corpus,
    parse_sharegpt,
    random_requests,
    sample_sharegpt_requests,
)


def _records(n: int) -> list[dict]:
    # non-ASCII text so a multi-byte character can straddle a read boundary
    return [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": "human", "value": f"question {i} naïve café ✓ " * (1 + i % 3)},
                {"from": "gpt", "value": f"answer {i} " * (2 + i % 5)},
            ],
        }
        for i in range(n)
    ]


# ------------------------------------------------------------------ streaming JSON decoding


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_iter_json_array_complete(monkeypatch, chunk):
    monkeypatch.setattr(ds, "_READ_CHUNK", chunk)
    recs = _records(50)
    raw = json.dumps(recs, indent=2, ensure_ascii=False).encode()
    stats: dict[str, int] = {}
    assert list(iter_json_array(io.BytesIO(raw), stats)) == recs
    assert stats["torn_tail_chars"] == 0


@pytest.mark.parametrize("chunk", [5, 100, 1 << 20])
def test_iter_json_array_torn_tail(monkeypatch, chunk):
    monkeypatch.setattr(ds, "_READ_CHUNK", chunk)
    recs = _records(40)
    raw = json.dumps(recs, indent=2, ensure_ascii=False).encode()
    cut = raw[: int(len(raw) * 0.73)]  # mid-record, possibly mid-character
    stats: dict[str, int] = {}
    got = list(iter_json_array(io.BytesIO(cut), stats))
    assert 0 < len(got) < len(recs)
    assert got == recs[: len(got)]  # whole records only, in order, nothing torn
    assert stats["torn_tail_chars"] > 0
    # the record after the last one decoded really was cut off
    assert json.dumps(recs[len(got)], indent=2, ensure_ascii=False).encode() not in cut


def test_iter_json_array_rejects_non_array():
    with pytest.raises(ValueError):
        list(iter_json_array(io.BytesIO(b'{"a": 1}')))


def test_parse_sharegpt_first_turn_pairs():
    recs = [
        {"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "q"}]},
        {"conversations": [{"from": "human", "value": "only"}]},
        {
            "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "Q"}]
            + [{"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A"}]
        },
        {"conversations": []},
    ]
    raw = json.dumps(recs).encode()[:-1]  # drop the closing bracket: still a clean read
    corpus = parse_sharegpt(io.BytesIO(raw))
    assert corpus.num_records == 4
    # the first human turn is the prompt, the first gpt turn after it the reference reply
    assert corpus.pairs == [("Q", "A")]


# ------------------------------------------------------------------ real ShareGPT V3


@pytest.fixture(scope="module")
def corpus():
    return load_sharegpt_corpus()


def test_sharegpt_corpus_size_and_torn_tail(corpus):
    assert corpus.num_records >= 17_000
    assert len(corpus.pairs) >= 17_000
    assert corpus.torn_tail_chars > 0  # the packaged file is cut off at 120 MB
    prompt, reply = corpus.pairs[0]
    assert prompt.startswith("Summarize the main ideas of Jeff Walker")
    assert reply


def test_sharegpt_cache_round_trip(corpus):
    again = load_sharegpt_corpus()  # served from the gzip JSON cache
    assert again.num_records == corpus.num_records
    assert again.pairs[:50] == corpus.pairs[:50]
    assert len(again.pairs) == len(corpus.pairs)


def test_load_sharegpt_deterministic(corpus, word_tokenizer):
    a = load_sharegpt(32, word_tokenizer, seed=3)
    b = load_sharegpt(32, word_tokenizer, seed=3)
    c = load_sharegpt(32, word_tokenizer, seed=4)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]
    for r in a:
        assert 4 <= len(r.prompt_token_ids) <= 1024
        assert r.output_len >= 4 and len(r.prompt_token_ids) + r.output_len <= 2048
        assert r.prompt_token_ids == word_tokenizer([r.prompt])["input_ids"][0]
    fixed = load_sharegpt(32, word_tokenizer, seed=3, fixed_output_len=17)
    assert [r.prompt for r in fixed] == [r.prompt for r in a]  # same prompts, fixed length
    assert {r.output_len for r in fixed} == {17}


def test_load_sharegpt_real_tokenizer(corpus, smol_tokenizer):
    reqs = load_sharegpt(16, smol_tokenizer, seed=0, max_prompt_len=256)
    assert len(reqs) == 16
    for r in reqs:
        assert 4 <= len(r.prompt_token_ids) <= 256
        assert r.prompt_token_ids == smol_tokenizer(r.prompt).input_ids


# ------------------------------------------------------------------ sampling filters


def test_sample_sharegpt_filters(word_tokenizer):
    w = "w "
    pairs = [
        (w * 3, w * 10),  # prompt 3 words + BOS = 4 tokens: kept (the limit is < 4)
        (w * 2, w * 10),  # prompt 3 tokens: dropped
        (w * 10, w * 3),  # reply 3 tokens: dropped
        (w * 1100, w * 10),  # prompt > 1024: dropped
        (w * 1000, w * 1100),  # prompt + reply > 2048: dropped
        (w * 10, w * 10),  # kept
        (w * 1023, w * 1024),  # exactly at both limits (1024 + 1024): kept
    ]
    reqs = sample_sharegpt_requests(pairs, 3, word_tokenizer, seed=0)
    lens = sorted((len(r.prompt_token_ids), r.output_len) for r in reqs)
    assert lens == [(4, 10), (11, 10), (1024, 1024)]
    with pytest.raises(ValueError, match="only 3"):
        sample_sharegpt_requests(pairs, 4, word_tokenizer, seed=0)
    short = sample_sharegpt_requests(pairs, 2, word_tokenizer, seed=0, max_prompt_len=20)
    assert all(len(r.prompt_token_ids) <= 20 for r in short)


def test_sample_sharegpt_seed_order(word_tokenizer):
    pairs = [(f"prompt number {i} here", f"reply {i} a b c") for i in range(200)]
    a = sample_sharegpt_requests(pairs, 50, word_tokenizer, seed=1)
    b = sample_sharegpt_requests(pairs, 50, word_tokenizer, seed=1)
    c = sample_sharegpt_requests(pairs, 50, word_tokenizer, seed=2)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert len({r.prompt for r in a}) == 50  # sampled without replacement


# ------------------------------------------------------------------ HumanEval rewrite


def test_humaneval_problems():
    probs = load_humaneval_problems()
    assert len(probs) == 164
    assert probs[0]["task_id"] == "HumanEval/0"


def test_humaneval_rewrite_prompts(word_tokenizer):
    reqs = load_humaneval_rewrite(170, word_tokenizer, seed=0, output_len=99)
    assert len(reqs) == 170
    assert reqs[164].prompt == reqs[0].prompt  # past 164 the problems cycle
    assert len({r.prompt for r in reqs[:164]}) == 164
    r = reqs[0]
    assert r.output_len == 99
    assert r.prompt.startswith("<user> Rewrite the following Python function")
    assert r.prompt.endswith("<assistant>")
    assert "def " in r.prompt and "return" in r.prompt  # the solution body is included
    assert (
        r.prompt_token_ids == word_tokenizer([r.prompt], add_special_tokens=False)["input_ids"][0]
    )
    again = load_humaneval_rewrite(5, word_tokenizer, seed=0)
    assert [x.prompt for x in again] == [x.prompt for x in reqs[:5]]


def test_humaneval_rewrite_chat_template(smol_tokenizer):
    (r,) = load_humaneval_rewrite(1, smol_tokenizer, seed=0)
    assert r.prompt.startswith("<|im_start|>")
    assert r.prompt.rstrip().endswith("<|im_start|>assistant")
    assert r.prompt_token_ids == smol_tokenizer(r.prompt, add_special_tokens=False).input_ids


# ------------------------------------------------------------------ random ids


def test_random_requests():
    a = random_requests(20, (5, 9), 16, vocab_size=50, seed=7)
    assert a == random_requests(20, (5, 9), 16, vocab_size=50, seed=7)
    assert a != random_requests(20, (5, 9), 16, vocab_size=50, seed=8)
    assert all(5 <= len(r.prompt_token_ids) <= 9 and r.output_len == 16 for r in a)
    assert all(0 <= t < 50 for r in a for t in r.prompt_token_ids)
    with pytest.raises(ValueError):
        random_requests(1, (0, 3), 4, 10)


# ------------------------------------------------------------------ locating package data


def test_open_package_data_installed(tmp_path, monkeypatch):
    pkg = tmp_path / "fakebenchpkg" / "data"
    pkg.mkdir(parents=True)
    (tmp_path / "fakebenchpkg" / "__init__.py").write_text("")
    (pkg / "x.json").write_bytes(b"[1, 2]")
    monkeypatch.syspath_prepend(str(tmp_path))
    with (
        env.override(cache_dir=tmp_path / "cache"),
        ds.open_package_data("fakebenchpkg", "0.1", "fakebenchpkg/data/x.json") as f,
    ):
        assert f.read() == b"[1, 2]"
    assert not (tmp_path / "cache").exists()  # found installed: nothing fetched


def test_open_package_data_cached_wheel(tmp_path, monkeypatch):
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / "not_installed_pkg-0.2-py3-none-any.whl", "w") as z:
        z.writestr("not_installed_pkg/data/d.jsonl.gz", gzip.compress(b'{"k": 1}\n'))
    member = "not_installed_pkg/data/d.jsonl.gz"
    with (
        env.override(cache_dir=tmp_path),
        ds.open_package_data("not-installed-pkg", "0.2", member) as f,
    ):
        assert gzip.decompress(f.read()) == b'{"k": 1}\n'


def test_later_turns_alternate_and_stop_where_the_context_is_too_long():
    conv = [
        {"from": "system", "value": "s"},
        {"from": "gpt", "value": "greeting"},  # before any user turn: left out
        {"from": "human", "value": "Q1"},
        {"from": "human", "value": "Q1 again"},  # a second user turn in a row: left out
        {"from": "gpt", "value": "A1"},
        {"from": "human", "value": "Q2"},
        {"from": "gpt", "value": "A2"},
        {"from": "human", "value": "x" * ds.TURN_CONTEXT_CHARS},  # its context is too long
        {"from": "gpt", "value": "A3"},
    ]
    assert ds.later_turns({"conversations": conv}) == [
        ("user", "Q1"),
        ("assistant", "A1"),
        ("user", "Q2"),
    ]
    # one exchange only, or a later turn that never fits: nothing to train on past the first
    assert ds.later_turns({"conversations": conv[2:5]}) is None
    long_first = [{"from": "human", "value": "y" * ds.TURN_CONTEXT_CHARS}] + conv[4:]
    assert ds.later_turns({"conversations": long_first}) is None


def test_turn_contexts_keep_the_held_out_conversations_apart():
    train = ds.sharegpt_turn_contexts(3000, seed=0, heldout=False)
    held = ds.sharegpt_turn_contexts(300, seed=0, heldout=True)
    assert len(train) == 3000 and len(held) == 300
    for msgs in train + held:
        roles = [m["role"] for m in msgs]
        assert len(msgs) >= 3 and roles == ["user", "assistant"] * (len(msgs) // 2) + ["user"]
        assert sum(len(m["content"]) for m in msgs) <= ds.TURN_CONTEXT_CHARS
    # a conversation's every turn is on the side of its first turn
    assert not any(ds.is_heldout(m[0]["content"].strip()) for m in train)
    assert not any(ds.is_heldout(m[-1]["content"].strip()) for m in train)
    assert all(ds.is_heldout(m[0]["content"].strip()) for m in held)
    assert ds.sharegpt_turn_contexts(3000, seed=0, heldout=False) == train
    assert ds.sharegpt_turn_contexts(50, seed=1, heldout=False) != train[:50]
