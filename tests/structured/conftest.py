from __future__ import annotations

import pytest

from tests.engine.conftest import make_llm

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
SELF = {"method": "draft_model", "num_speculative_tokens": 3, "model": "self"}


@pytest.fixture(scope="session")
def off():
    return make_llm(max_num_seqs=64, debug_invariants=True)


@pytest.fixture(scope="session")
def ngram():
    return make_llm(max_num_seqs=64, speculative_config=NGRAM, debug_invariants=True)


@pytest.fixture(scope="session")
def self_draft():
    return make_llm(max_num_seqs=64, speculative_config=SELF, debug_invariants=True)
