"""Servers for the API tests: real uvicorn on a free loopback port, in a background thread.

`smol` serves the default model (SmolLM2-135M) for exactness against the offline API; the
offline reference runs on the same engine, inside the engine thread (AsyncEngine.call_sync), so
no two threads ever step it. `tiny` serves a random 2-layer model for load, disconnect and error
tests, where only the bookkeeping matters.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from specserve import LLM, SamplingParams
from specserve.engine.outputs import RequestOutput
from specserve.server.launch import ServerOptions, ServerThread

TINY = "dummy:tiny"


@dataclass
class Served:
    server: ServerThread
    llm: LLM
    model: str

    @property
    def url(self) -> str:
        return self.server.base_url

    def openai(self, **kw: Any) -> openai.OpenAI:
        kw.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=120, **kw)

    def async_openai(self, **kw: Any) -> openai.AsyncOpenAI:
        kw.setdefault("api_key", "unused")
        return openai.AsyncOpenAI(base_url=self.url + "/v1", max_retries=0, timeout=120, **kw)

    def offline(self, prompts: Any, params: SamplingParams) -> list[RequestOutput]:
        """LLM.generate on the served engine, run in the engine thread between steps."""
        return self.server.client.call_sync(
            lambda _eng: self.llm.generate(prompts, params, use_tqdm=False), timeout=300
        )

    def offline_chat(self, messages: list[dict], params: SamplingParams) -> RequestOutput:
        return self.server.client.call_sync(
            lambda _eng: self.llm.chat(messages, params, use_tqdm=False)[0], timeout=300
        )

    def idle_state(self, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until the engine is idle with its idle flush done; return its resource counts."""
        client = self.server.client
        deadline = time.monotonic() + timeout
        while True:
            state = client.call_sync(client.idle_state, timeout=timeout)
            if state["idle"] or time.monotonic() > deadline:
                return state
            time.sleep(0.05)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=30).text


def _serve(llm: LLM, **opts: Any) -> Iterator[Served]:
    server = ServerThread(llm.engine, ServerOptions(port=0, log_level="warning", **opts)).start()
    try:
        yield Served(server, llm, server.client.model_name)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def smol() -> Iterator[Served]:
    # a KV cache of 0.5 GiB (room for ~11k tokens) instead of the CPU default's 2 GiB: this
    # engine lives for the whole session
    llm = LLM(
        progress=False, device="cpu", max_num_seqs=16, debug_invariants=True, kv_cache_memory_gb=0.5
    )
    yield from _serve(llm)


def tiny_llm(**kw: Any) -> LLM:
    kw.setdefault("max_num_seqs", 32)
    return LLM(TINY, device="cpu", dtype="float32", progress=False, debug_invariants=True, **kw)


@pytest.fixture(scope="session")
def tiny() -> Iterator[Served]:
    yield from _serve(tiny_llm())


@pytest.fixture(scope="session")
def tiny_overlap() -> Iterator[Served]:
    """The tiny engine with overlap scheduling forced on (the GPU default): the ledger runs one
    step late behind the server's engine thread."""
    yield from _serve(tiny_llm(overlap=True))
