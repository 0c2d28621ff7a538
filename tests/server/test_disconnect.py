"""Client disconnects abort at once and free everything; an engine failure costs only the requests
of its step."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest

from specserve.server.metrics import parse_prometheus, sample
from tests.server.conftest import Served


def _aborted(srv: Served) -> float:
    return sample(parse_prometheus(srv.metrics()), "request_success_total", finished_reason="abort")


def _assert_clean(srv: Served) -> None:
    state = srv.idle_state()
    assert state["idle"], state
    assert state["used_blocks"] == 0, state
    assert state["pool_free"] == state["pool_capacity"], state
    srv.server.client.call_sync(lambda eng: eng.check_invariants())


@pytest.mark.parametrize("served", ["tiny", "tiny_overlap"])
def test_64_streams_with_random_disconnects(served: str, request: pytest.FixtureRequest):
    tiny: Served = request.getfixturevalue(served)
    rng = random.Random(7)
    n = 64
    leave_after = {i: rng.randrange(0, 4) for i in rng.sample(range(n), 24)}  # chunks, then leave
    prompts = [f"request {i}: " + "lorem ipsum " * rng.randrange(1, 20) for i in range(n)]
    aborted_before = _aborted(tiny)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, int] | None:
        leaving = i in leave_after
        stream = await client.completions.create(
            model=tiny.model,
            prompt=prompts[i],
            max_tokens=400 if leaving else 24,  # leavers cannot finish before they leave
            temperature=0.0 if i % 2 else 0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        text, ntok, usage, seen = [], 0, None, 0
        async for chunk in stream:
            if leaving and seen >= leave_after[i]:
                await stream.close()  # drops the connection mid-stream
                return None
            seen += 1
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for c in chunk.choices:
                text.append(c.text)
                ntok += len(c.model_extra.get("token_ids") or [])
        return "".join(text), ntok, usage

    async def main() -> list:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(limits=limits, timeout=120) as http:
            client = tiny.async_openai(http_client=http)
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    results = asyncio.run(main())
    survivors = [r for i, r in enumerate(results) if i not in leave_after]
    assert all(r is None for i, r in enumerate(results) if i in leave_after)
    assert len(survivors) == n - len(leave_after)
    for _, ntok, usage in survivors:
        assert ntok == usage == 24
    # greedy survivors got exactly what they get alone: the others' churn did not leak in
    client = tiny.openai()
    for i in [i for i in range(1, n, 2) if i not in leave_after][:6]:
        alone = client.completions.create(
            model=tiny.model, prompt=prompts[i], max_tokens=24, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert results[i][0] == alone.choices[0].text
    _assert_clean(tiny)
    assert _aborted(tiny) - aborted_before == len(leave_after)  # every leaver aborted in the engine


def test_non_streaming_client_timeout_aborts(tiny: Served):
    before = _aborted(tiny)
    body = {"model": tiny.model, "prompt": "long one", "max_tokens": 2000, "ignore_eos": True}
    t0 = time.monotonic()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(tiny.url + "/v1/completions", json=body, timeout=0.5)
    # 2000 tokens would take many seconds; the abort must land long before that
    _assert_clean(tiny)
    assert time.monotonic() - t0 < 10
    assert _aborted(tiny) - before == 1


POISON = 4321  # a token id whose prefill makes the (wrapped) forward raise


class _Poisoned:
    """Wraps runner.forward: raises whenever the step's inputs hold the POISON token, so the
    failure follows one request wherever the engine schedules it."""

    def __init__(self, runner) -> None:
        self.runner, self.forward = runner, runner.forward

    def __call__(self, inputs, *args, **kwargs):
        ids = getattr(inputs, "input_ids", None)
        if ids is not None and bool((ids == POISON).any()):
            raise RuntimeError("injected failure")
        return self.forward(inputs, *args, **kwargs)


def _arm(srv: Served) -> None:
    srv.server.client.call_sync(lambda eng: setattr(eng.runner, "forward", _Poisoned(eng.runner)))


def _disarm(srv: Served) -> None:
    def restore(eng) -> None:
        if isinstance(eng.runner.forward, _Poisoned):
            eng.runner.forward = eng.runner.forward.forward

    srv.server.client.call_sync(restore)


def test_engine_failure_fails_only_its_requests(tiny: Served):
    """A request whose inputs make the step fail gets a 500 (or a stream error event); a request
    batched with it gets exactly its normal output."""
    client = tiny.openai()
    bystander = {"model": tiny.model, "prompt": "bystander", "max_tokens": 12, "temperature": 0,
                 "extra_body": {"ignore_eos": True}}  # fmt: skip
    alone = client.completions.create(**bystander).choices[0].text
    poison = [11, POISON, 12]

    async def together() -> tuple[str, BaseException | None]:
        aclient = tiny.async_openai()

        async def bad() -> BaseException | None:
            try:
                await aclient.completions.create(model=tiny.model, prompt=poison, max_tokens=4)
            except openai.InternalServerError as e:
                return e
            return None

        good, err = await asyncio.gather(aclient.completions.create(**bystander), bad())
        return good.choices[0].text, err

    try:
        _arm(tiny)
        text, err = asyncio.run(together())
        assert text == alone
        assert err is not None and "injected failure" in err.body["message"]
        assert err.body["type"] == "internal_server_error"
        stream = client.completions.create(
            model=tiny.model, prompt=poison, max_tokens=4, stream=True
        )
        with pytest.raises(openai.APIError, match="injected failure"):
            for _ in stream:
                pass
    finally:
        _disarm(tiny)
    assert httpx.get(tiny.url + "/health").status_code == 200
    out = client.completions.create(
        model=tiny.model, prompt="after", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 5
    _assert_clean(tiny)
    errors = sample(parse_prometheus(tiny.metrics()), "request_errors_total")
    assert errors >= 2
