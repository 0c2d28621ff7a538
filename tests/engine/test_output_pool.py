"""The output pool reuses only outputs nobody references (engine/outputs.py), so LLM.stream hands
out the pooled outputs themselves; and what the stream hands out equals what generate returns
(generate's text decoded once per request: defer_text)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specserve import SamplingParams
from specserve.engine.outputs import OutputPool, TokenOutput
from tests.engine.conftest import prompts_of


def _made(pool: OutputPool, step: int, n: int) -> list[TokenOutput]:
    outs = [pool.acquire(step) for _ in range(n)]
    for i, out in enumerate(outs):
        out.request_id, out.token_id, out.text = f"r{step}", 1000 * step + i, f"t{step}.{i}"
    return outs


@settings(max_examples=100, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.integers(0, 6), st.lists(st.booleans(), max_size=6)), min_size=1, max_size=12
    )
)
def test_kept_outputs_are_never_reused(steps) -> None:
    pool = OutputPool(16)
    kept: list[tuple[TokenOutput, tuple]] = []
    for step, (n, keep) in enumerate(steps, start=1):
        pool.release_through(step - 2)
        outs = _made(pool, step, n)
        kept += [(o, (o.request_id, o.token_id, o.text)) for o, k in zip(outs, keep) if k]
        del outs  # the engine's references are gone; the consumer's stay
        # a kept output is never handed out again, so it never changes
        assert all((o.request_id, o.token_id, o.text) == v for o, v in kept)
    pool.release_through(len(steps))
    assert pool.num_free == pool.capacity  # replaced, not lost
    assert pool.num_kept == len(kept)
    assert not {id(o) for o in pool._free} & {id(o) for o, _ in kept}


def test_dropped_outputs_are_reused() -> None:
    pool = OutputPool(4)
    first = [id(pool.acquire(1)) for _ in range(4)]  # ids only: nothing kept
    pool.release_through(1)
    again = {id(pool.acquire(2)) for _ in range(4)}
    assert again == set(first) and pool.num_kept == 0


def test_stream_outputs_kept_equal_generate(tiny_llm) -> None:
    prompts = prompts_of([5, 9, 3], seed=4)
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=9, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    ]
    eng = tiny_llm.engine
    kept = list(tiny_llm.stream(prompts, params))  # every output kept past its two steps
    ref = tiny_llm.generate(prompts, params, use_tqdm=False)
    by_req: dict[str, list[TokenOutput]] = {}
    for out in kept:
        by_req.setdefault(out.request_id, []).append(out)
    assert len(by_req) == 3
    for outs, r in zip(by_req.values(), ref):
        comp = r.outputs[0]
        assert [o.index for o in outs] == list(range(len(outs)))
        assert [o.token_id for o in outs] == comp.token_ids
        assert "".join(o.text for o in outs) == comp.text
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        if comp.logprobs is not None:
            assert [o.top_logprobs for o in outs] == comp.logprobs
    assert eng.pool.num_free == eng.pool.capacity
