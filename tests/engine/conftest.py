import pytest

from specserve import LLM

TINY = "dummy:tiny"


def make_llm(**kw) -> LLM:
    kw.setdefault("model", TINY)
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    kw.setdefault("progress", False)
    return LLM(**kw)


@pytest.fixture(scope="session")
def tiny_llm() -> LLM:
    return make_llm(max_num_seqs=16, debug_invariants=True)


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(n)] for n in lengths]
