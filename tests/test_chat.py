"""Offline LLM.chat: vLLM's template arguments honoured, tool calling and other unsupported
arguments refused by name (specserve/chat.py is shared with the server)."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.sampling_params import InvalidRequestError

CONV = [{"role": "user", "content": "Name a colour."}]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("dummy:tiny", dtype="float32", device="cpu", progress=False)


def _text(llm: LLM, ids: list[int]) -> str:
    return llm.get_tokenizer().decode(ids)


def test_chat_renders_the_template_with_a_generation_prompt(llm: LLM) -> None:
    ids = llm.apply_chat_template(CONV)
    assert _text(llm, ids).rstrip().endswith("assistant")
    plain = llm.apply_chat_template(CONV, add_generation_prompt=False)
    assert ids[: len(plain)] == plain and len(ids) > len(plain)
    out = llm.chat(CONV, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids and len(out.outputs[0].token_ids) == 4


def test_continue_final_message_leaves_the_last_turn_open(llm: LLM) -> None:
    conv = [*CONV, {"role": "assistant", "content": "The colour is"}]
    ids = llm.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True)
    assert _text(llm, ids).endswith("The colour is")
    closed = llm.apply_chat_template(conv, add_generation_prompt=False)
    assert not _text(llm, closed).endswith("The colour is")
    with pytest.raises(InvalidRequestError) as e:
        llm.apply_chat_template(conv, continue_final_message=True)  # generation prompt too
    assert e.value.param == "continue_final_message"


def test_template_kwargs_and_a_template_of_ones_own(llm: LLM) -> None:
    tpl = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ suffix }}"
    ids = llm.apply_chat_template(CONV, chat_template=tpl, chat_template_kwargs={"suffix": "!"})
    assert _text(llm, ids) == "<user>Name a colour.!"
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}]  # fmt: skip
    assert llm.apply_chat_template(parts) == llm.apply_chat_template(CONV)
    with pytest.raises(InvalidRequestError) as e:
        llm.apply_chat_template(CONV, chat_template_kwargs={"tokenize": True})
    assert e.value.param == "chat_template_kwargs.tokenize"


@pytest.mark.parametrize(
    ("messages", "kwargs", "param"),
    [
        (CONV, {"tools": [{"type": "retrieval"}]}, "tools[0]"),
        (
            CONV,
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "sometimes",
            },
            "tool_choice",
        ),  # fmt: skip
        (CONV, {"lora_request": object()}, "lora_request"),
        (CONV, {"mm_processor_kwargs": {"x": 1}}, "mm_processor_kwargs"),
        (CONV, {"chat_template_content_format": "openai"}, "chat_template_content_format"),
        ([*CONV, {"role": "function", "content": "42"}], {}, "messages[1].role"),
        (
            [*CONV, {"role": "assistant", "content": "", "function_call": {"name": "f"}}],
            {},
            "messages[1].function_call",
        ),
        (
            [*CONV, {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}],
            {},
            "messages[1].tool_calls[0]",
        ),
        ([{"role": "user", "content": [{"type": "image_url"}]}], {}, "messages[0].content"),
        ([{"content": "no role"}], {}, "messages"),
    ],
)
def test_unsupported_chat_arguments_are_refused_by_name(
    llm: LLM, messages: list, kwargs: dict, param: str
) -> None:
    with pytest.raises(InvalidRequestError) as e:
        llm.chat(messages, GREEDY, use_tqdm=False, **kwargs)
    assert e.value.param == param
    assert not llm.engine.has_unfinished()
