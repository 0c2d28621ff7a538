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


def test_later_turn_prompts_carry_their_history(default_tokenizer: Any) -> None:
    from specserve.train.data import sharegpt_turn_prompts

    convs = sharegpt_turn_prompts(40, seed=0)
    assert len(convs) == 40 and convs == sharegpt_turn_prompts(40, seed=0)
    msgs = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ]
    got = tokenize_prompts(default_tokenizer, [msgs, "a first turn"], 5, 512)
    text = default_tokenizer.decode(got[0])
    for m in msgs:
        assert m["content"] in text
    assert text.index("Blue.") < text.index("Another one?") and text.rstrip().endswith("assistant")
    assert got[1] == chat_prompt_ids(default_tokenizer, "a first turn")

    class Refusing:  # a template that raises for this conversation: it is skipped
        chat_template = "{{ raise_exception('no') }}"

        def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
            raise ValueError("refused")

    assert tokenize_prompts(Refusing(), [msgs], 5, 512) == []


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


def test_all_turns_answer_the_later_turns_after_the_first(
    tmp_path: Path, default_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    from specserve.train import pipeline
    from specserve.train.data import AnswerCache

    firsts = ["First question one?", "First question two?"]
    later = [
        [
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "What next?"},
        ]
    ]
    monkeypatch.setattr(pipeline, "sharegpt_prompts", lambda num, seed: firsts)
    monkeypatch.setattr(pipeline, "sharegpt_turn_prompts", lambda num, seed: later)
    llm = _FakeLLM()
    llm.tokenizer, llm.model_name = default_tokenizer, "m"
    job = pipeline.HeadTrainingJob(out=tmp_path, turns="all", num_prompts=10, progress=False)
    samples = pipeline.build_data(job, llm, None)
    assert [s.prompt_ids for s in samples] == [
        chat_prompt_ids(default_tokenizer, firsts[0]),
        chat_prompt_ids(default_tokenizer, firsts[1]),
        pipeline.tokenize_prompts(default_tokenizer, later, 1, 512)[0],
    ]
    # the cache knows which turns it holds: a first-turns run never reads these answers
    first_only = SimpleNamespace(**{**vars(job), "turns": "first"})
    spec = pipeline.DataSpec("m", pipeline.data_source(first_only), 10, 512, 256, 0.0, 0)
    with pytest.raises(ValueError, match="source: cached 'sharegpt-all-turns', now 'sharegpt'"):
        AnswerCache(tmp_path / "data", spec).check_spec()
