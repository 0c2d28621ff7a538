from __future__ import annotations

import pytest

from tests.engine.conftest import make_llm

# debug_invariants off: its per-step checks cost 5-30x the tiny model's steps here (the
# invariants have their own tests); the overlap test keeps them on
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
SELF = {"method": "draft_model", "num_speculative_tokens": 3, "model": "self"}


@pytest.fixture(scope="session")
def off():
    return make_llm(max_num_seqs=64)


@pytest.fixture(scope="session")
def ngram():
    return make_llm(max_num_seqs=64, speculative_config=NGRAM)


@pytest.fixture(scope="session")
def self_draft():
    return make_llm(max_num_seqs=64, speculative_config=SELF)
