"""Request fields of OpenAI and vLLM: the honoured ones do what vLLM does, the others are refused
with a 400 that names them; vLLM's /tokenize, /detokenize and GET /v1/models/{id}."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from specserve.server.compat import CHAT, COMMON, COMPLETION
from tests.server.conftest import Served

PROMPT = "The quick brown fox jumps over"
CHAT_MSGS = [{"role": "user", "content": "Write a haiku."}]


def post(srv: Served, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60)


def completion(srv: Served, **kw) -> dict:
    body = {"model": srv.model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **kw}
    r = post(srv, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def chat(srv: Served, **kw) -> dict:
    body = {"model": srv.model, "messages": CHAT_MSGS, "max_tokens": 6, "temperature": 0, **kw}
    r = post(srv, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


# a value of each refused field that asks for the feature
ASKING = {
    "length_penalty": 0.5, "priority": 3, "thinking_token_budget": 10, "stream_interval": 4,
    "routed_experts_prompt_start": 2, "spaces_between_special_tokens": False,
    "truncation_side": "right", "function_call": "auto", "guided_decoding_backend": "outlines",
    "modalities": ["text", "audio"], "verbosity": "low", "suffix": "tail",
    "functions": [{"name": "f"}],
}  # fmt: skip
REFUSED = [(r.field, "c") for r in COMMON + COMPLETION] + [(r.field, "chat") for r in CHAT]


@pytest.mark.parametrize(("field", "endpoint"), REFUSED, ids=[f"{e}:{f}" for f, e in REFUSED])
def test_refused_fields_are_named(tiny: Served, field: str, endpoint: str):
    base = (
        {"model": tiny.model, "prompt": "x", "max_tokens": 1}
        if endpoint == "c"
        else {"model": tiny.model, "messages": CHAT_MSGS, "max_tokens": 1}
    )
    path = "/v1/completions" if endpoint == "c" else "/v1/chat/completions"
    r = post(tiny, path, {**base, field: ASKING.get(field, {"x": 1})})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


def test_off_values_and_unknown_fields_are_accepted(tiny: Served):
    off = {"use_beam_search": False, "length_penalty": 1.0, "response_format": {"type": "text"},
           "priority": 0, "truncation_side": "left", "no_such_field": {"deep": [1]}}  # fmt: skip
    completion(tiny, **off)
    chat(tiny, **off, tool_choice="none", tools=[], modalities=["text"])


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"role": "function", "content": "42", "name": "f"}, "messages[1].role"),
        ({"role": "assistant", "function_call": {"name": "f"}}, "messages[1].function_call"),
    ],
)
def test_deprecated_function_history_is_refused(tiny: Served, change: dict, param: str):
    body = {"model": tiny.model, "messages": [*CHAT_MSGS, change], "max_tokens": 1}
    r = post(tiny, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_echo_scores_the_prompt_like_generation(tiny: Served):
    """lm-eval's loglikelihood: echo + max_tokens 0 + logprobs. The logprobs of a prompt's
    tokens equal the logprobs the model gave those tokens when it generated them."""
    prompt_ids = tiny.llm.tokenizer.encode(PROMPT)
    gen = completion(tiny, prompt=prompt_ids, max_tokens=8, logprobs=1, ignore_eos=True,
                     return_token_ids=True)["choices"][0]  # fmt: skip
    out_ids, out_lps = gen["token_ids"], gen["logprobs"]["token_logprobs"]
    scored = completion(tiny, prompt=prompt_ids + out_ids, max_tokens=0, echo=True, logprobs=1)
    choice, usage = scored["choices"][0], scored["usage"]
    lp = choice["logprobs"]
    n = len(prompt_ids) + len(out_ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][-8:] == pytest.approx(out_lps, abs=2e-3)
    assert all(math.isfinite(v) and v <= 0 for v in lp["token_logprobs"][1:])
    for tok, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top[tok] == value and len(top) <= 2
    assert choice["text"] == tiny.llm.tokenizer.decode(prompt_ids + out_ids)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == n


def test_echo_prepends_the_prompt(tiny: Served):
    plain = completion(tiny)["choices"][0]["text"]
    echoed = completion(tiny, echo=True)
    assert echoed["choices"][0]["text"] == PROMPT + plain
    assert echoed["usage"]["completion_tokens"] == completion(tiny)["usage"]["completion_tokens"]
    r = httpx.post(
        tiny.url + "/v1/completions",
        json={
            "model": tiny.model,
            "prompt": PROMPT,
            "max_tokens": 6,
            "temperature": 0,
            "echo": True,
            "stream": True,
        },  # fmt: skip
        timeout=60,
    )
    events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == PROMPT + plain
    body = {"model": tiny.model, "messages": CHAT_MSGS, "max_tokens": 4, "stream": True, "ignore_eos": True,
            "stream_options": {"continuous_usage_stats": True}}  # fmt: skip
    r = post(tiny, "/v1/chat/completions", body)
    events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
    counts = [e["usage"]["completion_tokens"] for e in events if e.get("usage")]
    assert counts == sorted(counts) and counts[-1] == 4
    r = post(tiny, "/v1/completions", {"model": tiny.model, "prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs(tiny: Served):
    ids = tiny.llm.tokenizer.encode(PROMPT)
    plp = completion(tiny, prompt_logprobs=2)["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for tid, entry in zip(ids[1:], plp[1:]):
        assert str(tid) in entry and 1 <= len(entry) <= 3
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2] or ranks[0] == 1
    assert chat(tiny, prompt_logprobs=0)["prompt_logprobs"][0] is None
    body = {"model": tiny.model, "prompt": "x", "prompt_logprobs": 1, "stream": True}
    r = post(tiny, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_logit_bias_allowed_token_ids_bad_words(tiny: Served):
    kw = {"max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    free = completion(tiny, **kw)["choices"][0]
    forced = completion(tiny, **kw, logit_bias={"1234": 100})["choices"][0]
    assert forced["token_ids"] == [1234] * 8
    allowed = [free["token_ids"][-1], 77, 4000]
    only = completion(tiny, **kw, allowed_token_ids=allowed)["choices"][0]
    assert set(only["token_ids"]) <= set(allowed)
    word = tiny.llm.tokenizer.decode([free["token_ids"][0]]).strip()
    if word:
        banned = completion(tiny, **kw, bad_words=[word])["choices"][0]
        assert banned["token_ids"][0] != free["token_ids"][0]
    r = post(
        tiny, "/v1/completions", {"model": tiny.model, "prompt": "x", "logit_bias": {"5": 101}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny: Served):
    ids = list(range(100, 160))
    cut = completion(tiny, prompt=ids, truncate_prompt_tokens=10, return_token_ids=True)
    ref = completion(tiny, prompt=ids[-10:], return_token_ids=True)
    assert cut["usage"]["prompt_tokens"] == 10
    assert cut["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    long = completion(tiny, prompt=[5] * 3000, truncate_prompt_tokens=100, max_tokens=1)
    assert long["usage"]["prompt_tokens"] == 100


def test_chat_template_fields(tiny: Served):
    msgs = [*CHAT_MSGS, {"role": "assistant", "content": "Autumn leaves"}]
    cont = chat(tiny, messages=msgs, continue_final_message=True, return_prompt_text=True,
                echo=True)  # fmt: skip
    assert cont["prompt_text"].endswith("Autumn leaves")
    assert cont["choices"][0]["message"]["content"].startswith("Autumn leaves")
    fresh = chat(tiny, return_prompt_text=True)
    assert fresh["prompt_text"].endswith("<|im_start|>assistant\n")
    assert not fresh["choices"][0]["message"]["content"].startswith("Write a haiku")
    both = {"model": tiny.model, "messages": msgs, "continue_final_message": True,
            "add_generation_prompt": True}  # fmt: skip
    r = post(tiny, "/v1/chat/completions", both)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    n0 = chat(tiny)["usage"]["prompt_tokens"]
    assert chat(tiny, chat_template_kwargs={"custom_flag": True})["usage"]["prompt_tokens"] == n0
    bad = {"model": tiny.model, "messages": CHAT_MSGS, "chat_template_kwargs": {"tokenize": True}}
    r = post(tiny, "/v1/chat/completions", bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.tokenize"


def test_tokenize_detokenize_models(tiny: Served):
    tok = tiny.llm.tokenizer
    r = post(tiny, "/tokenize", {"model": tiny.model, "prompt": PROMPT, "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == tok.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    assert body["max_model_len"] == tiny.server.client.max_model_len
    back = post(tiny, "/detokenize", {"model": tiny.model, "tokens": body["tokens"]}).json()
    assert back == {"prompt": PROMPT}
    chat_tok = post(tiny, "/tokenize", {"model": tiny.model, "messages": CHAT_MSGS}).json()
    assert chat_tok["count"] == chat(tiny)["usage"]["prompt_tokens"]
    r = post(tiny, "/detokenize", {"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    card = httpx.get(f"{tiny.url}/v1/models/{tiny.model}").json()
    assert card["id"] == tiny.model and card["object"] == "model"
    r = httpx.get(f"{tiny.url}/v1/models/gpt-17")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_request_id_names_the_response(tiny: Served):
    a = completion(tiny, request_id="abc")
    b = completion(tiny, request_id="abc")  # the same id twice: engine ids stay unique
    assert a["id"] == b["id"] == "cmpl-abc"
