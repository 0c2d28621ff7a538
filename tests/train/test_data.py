"""Training prompts: ShareGPT first turns (distinct, seed-ordered) under the chat template, as
the engine tokenizes a chat request; a prompts file, one a line or JSONL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
