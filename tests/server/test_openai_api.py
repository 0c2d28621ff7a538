"""The OpenAI client against a real server on the default model: greedy outputs equal the offline
API, streamed text and usage equal the non-streamed ones, stop strings, logprobs, granularity."""

from __future__ import annotations

import math

import pytest

from specserve import SamplingParams
from specserve.server.launch import ServerOptions, ServerThread
from tests.server.conftest import Served

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
IDS = {"return_token_ids": True}


def stream_completion(srv: Served, **kw):
    """(text, token ids, usage, chunks with content, finish_reason, stop_reason) of a stream."""
    chunks = list(
        srv.openai().completions.create(
            model=srv.model, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    body = [c for c in chunks[:-1]]
    assert all(c.usage is None for c in body)
    text = "".join(c.choices[0].text for c in body)
    ids = [t for c in body for t in (c.choices[0].model_extra or {}).get("token_ids") or []]
    finals = [c.choices[0] for c in body if c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0] is body[-1].choices[0]
    return text, ids, usage, body, finals[0].finish_reason, finals[0].model_extra.get("stop_reason")


def test_completions_greedy_equal_offline(smol: Served):
    ref = smol.offline(PROMPTS, GREEDY)
    client = smol.openai()
    # one HTTP request with all prompts: choices come back in prompt order
    batch = client.completions.create(
        model=smol.model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0, extra_body=IDS
    )
    assert [c.index for c in batch.choices] == [0, 1, 2]
    for r, c in zip(ref, batch.choices):
        assert c.text == r.outputs[0].text
        assert c.model_extra["token_ids"] == r.outputs[0].token_ids
        assert c.finish_reason == r.outputs[0].finish_reason
    assert batch.usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in ref)
    assert batch.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)
    for prompt, r in zip(PROMPTS, ref):
        single = client.completions.create(
            model=smol.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert single.choices[0].text == r.outputs[0].text
        assert single.usage.completion_tokens == len(r.outputs[0].token_ids)
        text, ids, usage, _, finish, _ = stream_completion(
            smol, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body=IDS
        )
        assert text == r.outputs[0].text
        assert ids == r.outputs[0].token_ids
        assert usage.completion_tokens == len(ids)
        assert usage.prompt_tokens == len(r.prompt_token_ids)
        assert finish == r.outputs[0].finish_reason
    # token ids as the prompt: same as the text it came from
    ids_prompt = client.completions.create(
        model=smol.model, prompt=ref[0].prompt_token_ids, max_tokens=MAX_TOKENS, temperature=0
    )
    assert ids_prompt.choices[0].text == ref[0].outputs[0].text


def test_chat_greedy_equal_offline(smol: Served):
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ]
    ref = smol.offline_chat(messages, SamplingParams(temperature=0.0, max_tokens=32))
    client = smol.openai()
    full = client.chat.completions.create(
        model=smol.model, messages=messages, max_completion_tokens=32, temperature=0
    )
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == ref.outputs[0].text
    assert full.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert full.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert full.usage.prompt_tokens == len(ref.prompt_token_ids)
    chunks = list(
        client.chat.completions.create(
            model=smol.model,
            messages=messages,
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IDS,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    body = chunks[:-1]
    text = "".join(c.choices[0].delta.content or "" for c in body)
    ids = [t for c in body for t in c.choices[0].model_extra.get("token_ids") or []]
    assert text == ref.outputs[0].text
    assert ids == ref.outputs[0].token_ids
    assert chunks[-1].usage.completion_tokens == len(ids)
    assert body[-1].choices[0].finish_reason == ref.outputs[0].finish_reason


def test_stop_strings_trim_text_and_report_the_match(smol: Served):
    prompt = PROMPTS[2]
    plain = smol.offline([prompt], GREEDY)[0].outputs[0]
    words = plain.text.split()
    stop = next(w for w in words[2:] if len(w) >= 3)  # a word from the middle of the output
    cut = plain.text[: plain.text.index(stop)]
    ref = smol.offline(
        [prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop])
    )
    assert ref[0].outputs[0].text == cut  # the engine's own trimming
    full = smol.openai().completions.create(
        model=smol.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stop=[stop, "@@@"],
        logprobs=1, extra_body=IDS,
    )  # fmt: skip
    choice = full.choices[0]
    assert choice.text == cut
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    assert choice.model_extra["token_ids"] == ref[0].outputs[0].token_ids
    assert len(choice.logprobs.tokens) == full.usage.completion_tokens  # logprobs trimmed too
    text, ids, usage, _, finish, stop_reason = stream_completion(
        smol, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stop=stop, extra_body=IDS
    )
    assert (text, finish, stop_reason) == (cut, "stop", stop)
    assert usage.completion_tokens == len(ids) == full.usage.completion_tokens


def test_completion_logprobs(smol: Served):
    ref = smol.offline([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=12, logprobs=3))
    out = smol.openai().completions.create(
        model=smol.model, prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    n = out.usage.completion_tokens
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    )
    ref_lps = [
        d[t].logprob for d, t in zip(ref[0].outputs[0].logprobs, ref[0].outputs[0].token_ids)
    ]
    assert lp.token_logprobs == pytest.approx(ref_lps, abs=1e-5)
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and all(math.isfinite(v) and v <= 0 for v in top.values())
        assert top[tok] == value == max(top.values())  # greedy: the sampled token is the argmax
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == out.choices[0].text


def test_chat_logprobs(smol: Served):
    out = smol.openai().chat.completions.create(
        model=smol.model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy picks rank 1
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes == list(entry.token.encode())


def test_per_token_granularity(smol: Served):
    kw = dict(prompt=PROMPTS[1], max_tokens=16, temperature=0)
    whole = smol.openai().completions.create(model=smol.model, **kw).choices[0].text
    text, ids, usage, body, _, _ = stream_completion(
        smol, extra_body={**IDS, "stream_granularity": "token"}, **kw
    )
    assert text == whole
    assert [len(c.choices[0].model_extra["token_ids"]) for c in body] == [1] * len(body)
    assert len(body) == usage.completion_tokens == len(ids)
    # the same as a server default (a second app on the same engine thread)
    per_token = ServerThread(smol.server.client, ServerOptions(port=0, stream_granularity="token"))
    per_token.start()
    try:
        served = Served(per_token, smol.llm, smol.model)
        text2, ids2, usage2, body2, _, _ = stream_completion(served, extra_body=IDS, **kw)
    finally:
        per_token.stop()
    assert (text2, ids2) == (text, ids) and len(body2) == usage2.completion_tokens


def test_n_choices_get_distinct_seeds(smol: Served):
    client = smol.openai()
    kw = dict(model=smol.model, prompt=PROMPTS[2], max_tokens=12, temperature=1.0, seed=1234)
    many = client.completions.create(n=3, extra_body=IDS, **kw)
    again = client.completions.create(n=3, **kw)
    one = client.completions.create(n=1, **kw)
    texts = [c.text for c in many.choices]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert texts == [c.text for c in again.choices]  # seeded: reproducible
    assert texts[0] == one.choices[0].text  # choice 0 uses the request's own seed
    assert len(set(texts)) > 1  # the others derive different seeds
    counts = [len(c.model_extra["token_ids"]) for c in many.choices]
    assert many.usage.completion_tokens == sum(counts)


def test_token_chunks_carry_their_own_text(smol: Served):
    _, _, _, body, _, _ = stream_completion(
        smol,
        prompt=PROMPTS[0],
        max_tokens=6,
        temperature=0,
        extra_body={**IDS, "stream_granularity": "token"},
    )
    tok = smol.llm.tokenizer
    first = body[0].choices[0]
    assert first.text == tok.decode(first.model_extra["token_ids"])
