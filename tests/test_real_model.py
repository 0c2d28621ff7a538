"""The real default model (SmolLM2-135M-Instruct GGUF) through the whole engine: speculation is
lossless token for token, self-drafting is accepted, stop strings cut text, tokens and logprobs."""

import gc

import pytest

from specserve import LLM, SamplingParams
from specserve.bench.datasets import load_humaneval_rewrite

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "List three prime numbers greater than 10.",
    "How do I reverse a list in Python?",
    "Give me a recipe for pancakes.",
    "Translate 'good morning' into French, Spanish and German.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=128)
SMALL_KV = {"kv_cache_memory_gb": 0.5}  # room for ~11k tokens: 16 requests of 11 prompts fit


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu", progress=False, max_num_seqs=16, **SMALL_KV)


@pytest.fixture
def fresh_llm():
    """LLM(...) made inside a test and freed when it ends (engines hold reference cycles, so
    only the cyclic collector frees them, and each holds the model and its KV cache)."""
    made: list[LLM] = []

    def make(**kw) -> LLM:
        made.append(LLM(dtype="float32", device="cpu", progress=False, **SMALL_KV, **kw))
        return made[-1]

    yield make
    made.clear()
    gc.collect()


@pytest.fixture(scope="module")
def prompts(llm):
    chats = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    code = [r.prompt_token_ids for r in load_humaneval_rewrite(4, llm.tokenizer)]
    return chats + code  # 11 prompts


@pytest.fixture(scope="module")
def reference(llm, prompts):
    return llm.generate(prompts, GREEDY, use_tqdm=False)


@pytest.mark.parametrize(
    "cfg",
    [
        {"method": "ngram", "num_speculative_tokens": 4},
        {"method": "draft_model", "num_speculative_tokens": 3, "model": "self"},
    ],
    ids=["ngram", "self-draft"],
)
def test_speculation_is_lossless_on_the_real_model(prompts, reference, cfg, fresh_llm):
    spec = fresh_llm(max_num_seqs=16, speculative_config=cfg)
    outs = spec.generate(prompts, GREEDY, use_tqdm=False)
    for ref, out in zip(reference, outs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].text == ref.outputs[0].text
        assert out.outputs[0].finish_reason == ref.outputs[0].finish_reason
    m = spec.get_metrics()
    assert m["spec_accepted_tokens"] > 0
    if cfg["method"] == "draft_model":
        rate = m["spec_accepted_tokens"] / m["spec_draft_tokens"]
        assert rate >= 0.95, f"self-draft acceptance {rate:.3f}"


def test_the_shipped_eagle3_head_is_lossless_and_accepted(llm, fresh_llm):
    """method eagle3 with no model on the default model: the head shipped in the package.
    Greedy outputs equal speculation off on 12 held-out chat prompts x 128 tokens, and the head
    earns its keep (more than one token per verifying step)."""
    from specserve.bench.datasets import load_sharegpt_chat

    chats = [r.prompt_token_ids for r in load_sharegpt_chat(12, llm.tokenizer, seed=5)]
    ref = llm.generate(chats, GREEDY, use_tqdm=False)
    spec = fresh_llm(
        max_num_seqs=12,
        speculative_config={
            "method": "eagle3",
            "num_speculative_tokens": 5,
            "verify_budget": "off",
        },
    )
    outs = spec.generate(chats, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    assert spec.get_metrics()["spec_mean_acceptance_length"] > 1.3


def test_stop_string_across_tokens_trims_text_tokens_and_logprobs(
    llm, prompts, reference, fresh_llm
):
    ref = reference[1].outputs[0]
    tok = llm.tokenizer
    # a stop string made of the tail of token 5 and the whole of tokens 6-7: it spans 3 tokens
    pieces = [tok.decode(ref.token_ids[: i + 1]) for i in range(len(ref.token_ids))]
    stop = pieces[7][len(pieces[4]) + 1 :]
    assert len(stop) >= 3 and stop in ref.text
    first = ref.text.index(stop)
    end_tok = next(i for i, p in enumerate(pieces) if len(p) >= first + len(stop))
    for cfg in [None, {"method": "draft_model", "num_speculative_tokens": 4, "model": "self"}]:
        eng = llm if cfg is None else fresh_llm(speculative_config=cfg)
        sp = SamplingParams(temperature=0, max_tokens=128, stop=[stop], logprobs=2)
        c = eng.generate([prompts[1]], sp, use_tqdm=False)[0].outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.text == ref.text[:first]
        assert c.token_ids == ref.token_ids[: end_tok + 1]
        assert len(c.logprobs) == len(c.token_ids)
        sp = SamplingParams(
            temperature=0, max_tokens=128, stop=[stop], include_stop_str_in_output=True
        )
        c = eng.generate([prompts[1]], sp, use_tqdm=False)[0].outputs[0]
        assert c.text == ref.text[: first + len(stop)]


def test_streamed_text_equals_generated_text_and_usage(llm, prompts, reference):
    sp = SamplingParams(temperature=0, max_tokens=128)
    got: dict[str, list] = {}
    for out in llm.stream(prompts[:4], sp):
        got.setdefault(out.request_id, []).append(out)
    for outs, ref in zip(got.values(), reference[:4]):
        assert "".join(o.text for o in outs) == ref.outputs[0].text
        assert [o.token_id for o in outs] == ref.outputs[0].token_ids
        assert outs[-1].num_output_tokens == len(ref.outputs[0].token_ids)


# w8a8 (measured 0.936 agree, 0.098 moved) is left to tests/model/test_quant.py: one more
# quantized engine of the real model costs CI ~30 s
@pytest.mark.parametrize(("method", "min_agree", "max_moved"), [("int8", 0.9, 0.1)])
def test_int8_weights_stay_close_to_fp32(
    llm, prompts, reference, fresh_llm, method, min_agree, max_moved
):
    """quantization=int8 / w8a8 against fp32 on the 11 prompts x the first 32 tokens fp32
    generated: how often the quantized model's greedy choice is fp32's at the same context
    (teacher-forced: one divergence does not end the comparison), and how far the logprob of
    fp32's token moves. Measured: int8 0.972 agree, mean |dlogprob| 0.034; w8a8 0.936, 0.098."""
    conts = [r.outputs[0].token_ids[:32] for r in reference]
    seqs = [p + c for p, c in zip(prompts, conts)]
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def scored(eng: LLM) -> list[tuple[int, float]]:
        """(rank, logprob) of each continuation token under `eng`"""
        outs = eng.generate(seqs, score, use_tqdm=False)
        return [
            (entry[tok].rank, entry[tok].logprob)
            for o, p, c in zip(outs, prompts, conts)
            for tok, entry in zip(c, o.prompt_logprobs[len(p) :])
        ]

    want = scored(llm)
    assert all(rank == 1 for rank, _ in want)  # fp32 ranks its own greedy tokens first
    got = scored(fresh_llm(max_num_seqs=16, quantization=method))
    agree = sum(rank == 1 for rank, _ in got) / len(got)
    moved = [abs(g - w) for (_, g), (_, w) in zip(got, want)]
    assert agree >= min_agree
    assert sum(moved) / len(moved) <= max_moved
