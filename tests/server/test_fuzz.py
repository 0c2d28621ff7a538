"""Hypothesis fuzz of the request bodies: whatever a client sends, the answer is never a 5xx
(nor an internal error inside a stream), and an innocent request running at the same time gets
exactly its normal output."""

from __future__ import annotations

import json
import threading

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import Served

FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stream",
    "stream_options", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
    "logprobs", "top_logprobs", "echo", "logit_bias", "allowed_token_ids", "bad_words",
    "prompt_logprobs", "truncate_prompt_tokens", "add_special_tokens", "continue_final_message",
    "add_generation_prompt", "chat_template_kwargs", "return_token_ids", "request_id",
    "return_tokens_as_token_ids", "stream_granularity", "include_stop_str_in_output",
    "skip_special_tokens", "best_of", "tools", "tool_choice", "response_format", "documents",
    "reasoning_effort", "return_prompt_text", "suffix", "use_beam_search", "length_penalty",
    "structured_outputs", "priority", "spaces_between_special_tokens", "truncation_side",
    "no_such_field",
]  # fmt: skip

small_ints = st.integers(-3, 8)
odd_ints = st.sampled_from([2**31, 2**63, -(2**63) - 1, 10**30, 49151, 49152, 2047, 2048])
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 0.5, 1.0, 2.0])
text = st.text(max_size=12) | st.sampled_from(["", "\ud800", "<|im_end|>", "text", "step"])
scalars = st.none() | st.booleans() | small_ints | odd_ints | floats | text
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]), "content": values}
    ),
    max_size=3,
)


@st.composite
def bodies(draw) -> tuple[str, bytes]:
    chat = draw(st.booleans())
    body: dict = {"max_tokens": 3, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hello"
    for _ in range(draw(st.integers(1, 4))):
        field = draw(st.sampled_from(FIELDS))
        if field == "messages":
            body[field] = draw(messages | values)
        elif draw(st.integers(0, 9)) == 0:
            body.pop(field, None)
        else:
            body[field] = draw(values)
    raw = json.dumps(body).encode()  # NaN / Infinity / lone surrogates go out as JSON allows
    if draw(st.integers(0, 19)) == 0:
        raw = draw(st.sampled_from([raw[: len(raw) // 2], b"[" * 5000, b"null", b'"x"', b"\xff"]))
    return ("/v1/chat/completions" if chat else "/v1/completions"), raw


class Innocent(threading.Thread):
    """Sends the same greedy request over and over while the fuzz runs."""

    def __init__(self, srv: Served, reference: str) -> None:
        super().__init__(daemon=True)
        self.srv, self.reference = srv, reference
        self.stop = threading.Event()
        self.count, self.wrong = 0, []

    def run(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self.stop.is_set():
                text = _innocent(http, self.srv)
                self.count += 1
                if text != self.reference:
                    self.wrong.append(text)


def _innocent(http: httpx.Client, srv: Served) -> str:
    body = {"model": srv.model, "prompt": "innocent bystander", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    r = http.post(srv.url + "/v1/completions", json=body)
    return r.json()["choices"][0]["text"] if r.status_code == 200 else f"HTTP {r.status_code}"


def test_fuzzed_bodies_never_5xx(tiny: Served):
    with httpx.Client(timeout=60) as http:
        reference = _innocent(http, tiny)
    bystander = Innocent(tiny, reference)
    bystander.start()
    seen: dict[int, int] = {}

    @settings(
        max_examples=200,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(bodies())
    def one(case: tuple[str, bytes]) -> None:
        path, raw = case
        headers = {"Content-Type": "application/json"}
        with httpx.Client(timeout=60) as http:
            r = http.post(tiny.url + path, content=raw, headers=headers)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (raw[:300], r.text[:500])
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            assert "internal_server_error" not in r.text, (raw[:300], r.text[-500:])

    try:
        one()
    finally:
        bystander.stop.set()
        bystander.join(60)
    assert bystander.wrong == [] and bystander.count > 0
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen  # the fuzz reached both sides
    state = tiny.idle_state()
    assert state["idle"] and state["used_blocks"] == 0, state
