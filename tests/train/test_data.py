"""Training prompts: ShareGPT first turns (distinct, seed-ordered) under the chat template, as
the engine tokenizes a chat request; a prompts file, one a line or JSONL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specserve.train.data import chat_prompt_ids, file_prompts, sharegpt_prompts, tokenize_prompts


def test_sharegpt_prompts_distinct_and_seeded() -> None:
    a = sharegpt_prompts(20, seed=3)
    assert len(a) == 20 and len(set(a)) == 20 and all(p.strip() == p and p for p in a)
    assert sharegpt_prompts(20, seed=3) == a and sharegpt_prompts(20, seed=4) != a


def test_prompts_under_the_chat_template(default_tokenizer: Any, tmp_path: Path) -> None:
    ids = chat_prompt_ids(default_tokenizer, "Why is the sky blue?")
    text = default_tokenizer.decode(ids)
    assert "Why is the sky blue?" in text and text.rstrip().endswith("assistant")
    assert ids.count(default_tokenizer.bos_token_id) <= text.count("<|im_start|>")
    f = tmp_path / "p.jsonl"
    f.write_text('"plain string"\n\n{"prompt": "an object"}\n')
    assert file_prompts(f) == ["plain string", "an object"]
    long = "word " * 400
    got = tokenize_prompts(default_tokenizer, [long, "short one", "another"], 5, 64)
    assert len(got) == 2 and all(4 <= len(g) <= 64 for g in got)


class _FakeLLM:
    """generate() answers prompt p with [len(p), 7]; counts the prompts it was asked."""

    def __init__(self) -> None:
        self.asked = 0

    def generate(self, prompts, params, use_tqdm=False):  # noqa: ANN001
        from types import SimpleNamespace

        self.asked += len(prompts)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[len(p), 7])]) for p in prompts]


def test_answers_are_cached_and_a_deadline_stops_between_chunks(tmp_path: Path) -> None:
    import time

    from specserve.train.data import AnswerCache, DataSpec, regenerate

    prompts = [[1] * (i + 4) for i in range(5)]
    cache = AnswerCache(tmp_path, DataSpec("m", "f", 5, 64, 2, 0.0, 0))
    llm = _FakeLLM()
    assert regenerate(llm, prompts, cache, 2, progress=False, deadline=time.monotonic() - 1) is None
    assert llm.asked == 0 and cache.load() == []
    got = regenerate(llm, prompts, cache, 2, progress=False)
    assert [s.answer_ids for s in got] == [[i + 4, 7] for i in range(5)] and llm.asked == 5
    again = regenerate(llm, prompts, cache, 2, progress=False)  # all read back from the cache
    assert again == got and llm.asked == 5
    with pytest.raises(ValueError, match="cached answer 0 is to another prompt"):
        regenerate(llm, [[9] * 4] + prompts[1:], cache, 2, progress=False)
