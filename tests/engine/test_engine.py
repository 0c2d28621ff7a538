"""Engine behaviour on a tiny random model: batch/chunk invariance, preemption, prefix cache,
stops, bad input, idle state."""

import pytest

from specserve import InvalidRequestError, SamplingParams
from tests.engine.conftest import make_llm, prompts_of

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_idle(llm):
    eng = llm.engine
    assert not eng.requests
    assert eng.block_manager.num_used_blocks == 0
    assert eng.pool.num_free == eng.pool.capacity
    eng.check_invariants()


def test_greedy_is_independent_of_batch_composition_and_chunk_size(tiny_llm):
    prompts = prompts_of([5, 17, 33, 64, 2, 40])
    alone = [_tokens(tiny_llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    together = _tokens(tiny_llm.generate(prompts, GREEDY, use_tqdm=False))
    assert together == alone
    chunked = make_llm(max_num_batched_tokens=16, max_num_seqs=4)
    assert _tokens(chunked.generate(prompts, GREEDY, use_tqdm=False)) == alone
    assert_idle(chunked)
    assert_idle(tiny_llm)


def test_preemption_recomputes_to_the_same_output():
    prompts = prompts_of([30, 31, 29, 33, 35, 28, 40, 27], seed=3)
    ref = _tokens(make_llm(max_num_seqs=8).generate(prompts, GREEDY, use_tqdm=False))
    # 14 usable blocks of 16 tokens cannot hold 8 requests of ~55 tokens: preemption must happen
    small = make_llm(
        max_num_seqs=8, kv_cache_memory_gb=15 * 8192 / 2**30, enable_prefix_caching=False
    )
    assert small.engine.block_manager.num_usable_blocks == 14
    outs = small.generate(prompts, GREEDY, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert _tokens(outs) == ref
    assert_idle(small)


def test_prefix_cache_serves_a_repeated_prompt(tiny_llm):
    prompt = prompts_of([70], seed=5)[0]
    first = tiny_llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    second = tiny_llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert second.metrics.num_cached_tokens == 64  # 4 full blocks of 16, last token recomputed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    prompts = prompts_of([10, 20, 30], seed=9)
    alone = _tokens(tiny_llm.generate([prompts[1]], sp, use_tqdm=False))[0]
    other = SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)
    mixed = tiny_llm.generate(prompts, [other, sp, other], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    a, b = _tokens(tiny_llm.generate([prompts[1]] * 2, unseeded, use_tqdm=False))
    assert a != b  # distinct requests draw distinct seeds


def test_stop_token_ids_and_min_tokens(tiny_llm):
    prompt = prompts_of([12], seed=11)[0]
    ref = tiny_llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = ref[3]
    first = ref.index(stop_tok)
    out = tiny_llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok]),
        use_tqdm=False,
    )[0]
    c = out.outputs[0]
    assert c.token_ids == ref[: first + 1]  # the stop token is the last token, nothing after
    assert c.finish_reason == "stop" and c.stop_reason == stop_tok
    assert out.metrics.num_output_tokens == len(c.token_ids)
    # min_tokens masks the stop id until min_tokens tokens are out
    sp = SamplingParams(
        temperature=0, max_tokens=24, stop_token_ids=[stop_tok], min_tokens=first + 2
    )
    c = tiny_llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert stop_tok not in c.token_ids[: first + 2]
    assert len(c.token_ids) >= first + 2


def test_max_tokens_and_max_model_len():
    llm = make_llm(max_model_len=40)
    prompt = prompts_of([30], seed=2)[0]
    c = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(c.token_ids) == 5 and c.finish_reason == "length"
    c = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(c.token_ids) == 10 and c.finish_reason == "length"  # 30 + 10 = max_model_len
    outs = llm.generate(
        [prompts_of([41])[0], prompt],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    assert outs[0].outputs[0].finish_reason == "prompt_length_exceeded"
    assert outs[0].outputs[0].token_ids == []
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 4
    assert_idle(llm)


def test_stream_yields_one_output_per_token_and_finish_on_the_last(tiny_llm):
    prompts = prompts_of([8, 9, 10], seed=4)
    sp = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    seen: dict[str, list] = {}
    for out in tiny_llm.stream(prompts, sp):
        seen.setdefault(out.request_id, []).append(out)
    assert len(seen) == 3
    for outs in seen.values():
        assert [o.index for o in outs] == list(range(7))
        assert [o.num_output_tokens for o in outs] == list(range(1, 8))
        assert [o.finished for o in outs] == [False] * 6 + [True]
        assert outs[-1].finish_reason == "length"
    assert_idle(tiny_llm)


def test_abort_mid_stream_frees_everything(tiny_llm):
    prompts = prompts_of([8, 9], seed=6)
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    it = tiny_llm.stream(prompts, sp)
    first = next(it)
    tiny_llm.abort(first.request_id)
    rest = list(it)
    aborted = [o for o in rest if o.request_id == first.request_id]
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort" and aborted[0].token_id == -1
    other = [o for o in rest if o.request_id != first.request_id]
    assert other[-1].finish_reason == "length"
    assert_idle(tiny_llm)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-1.0), "temperature"),
        (dict(min_tokens=10, max_tokens=5), "min_tokens"),
        (dict(logprobs=99), "logprobs"),
    ],
)
def test_bad_sampling_params_are_named(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_bad_prompts_harm_no_other_request(tiny_llm):
    good = prompts_of([6], seed=8)[0]
    with pytest.raises(InvalidRequestError):
        tiny_llm.generate(["", "hello"], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError):
        tiny_llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError):
        tiny_llm.generate([[10**9]], GREEDY, use_tqdm=False)
    assert_idle(tiny_llm)
    assert len(tiny_llm.generate([good], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 24


def test_unknown_model_and_corrupt_gguf_are_clear_errors(tmp_path):
    from specserve.model.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="not found"):
        make_llm(model=str(tmp_path / "nope"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError):
        make_llm(model=str(bad))
    with pytest.raises(ModelLoadError):
        make_llm(model="dummy:no-such-preset")


def test_eager_warm_up_runs_each_tile_class_and_changes_no_output():
    """The CUDA start-up warm-up (one eager forward per attention tile class, before any request
    exists, over blocks no request owns yet) leaves greedy outputs exactly as they were: run
    here on the CPU path, against an engine that did not warm up."""
    prompts = prompts_of([5, 40, 17, 3], seed=3)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    warmed = make_llm(max_num_seqs=4)
    eng = warmed.engine
    assert eng.runner.warm_up_eager(eng.max_num_batched_tokens, eng.max_model_len) >= 6
    want = [
        o.outputs[0].token_ids
        for o in make_llm(max_num_seqs=4).generate(prompts, sp, use_tqdm=False)
    ]
    assert [o.outputs[0].token_ids for o in warmed.generate(prompts, sp, use_tqdm=False)] == want


def test_a_bf16_kv_cache_under_an_fp32_model():
    """kv_cache_dtype="bfloat16" (vLLM's field): K/V stored in bf16, the model and attention
    math in fp32. Speculation stays lossless against the same engine without it (both read
    the same rounded K/V), and the first step's logits stay close to an fp32 cache's."""
    import torch

    prompts = [p * 3 for p in prompts_of([7, 12, 5], seed=21)]  # repeats: n-gram drafts
    half = make_llm(kv_cache_dtype="bfloat16", max_num_seqs=4)
    cache = half.engine.runner.kv_caches[0]
    assert cache.k.dtype == cache.v.dtype == torch.bfloat16
    spec = make_llm(
        kv_cache_dtype="bfloat16",
        max_num_seqs=4,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "verify_budget": "off"},
    )
    plain = _tokens(half.generate(prompts, GREEDY, use_tqdm=False))
    assert _tokens(spec.generate(prompts, GREEDY, use_tqdm=False)) == plain
    assert spec.get_metrics()["spec_accepted_tokens"] > 0
    full = make_llm(max_num_seqs=4)
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    a = full.generate(prompts, one, use_tqdm=False)
    b = half.generate(prompts, one, use_tqdm=False)
    for x, y in zip(a, b):
        la, lb = x.outputs[0].logprobs[0], y.outputs[0].logprobs[0]
        assert set(la) & set(lb)
        assert all(abs(la[t].logprob - lb[t].logprob) < 0.05 for t in set(la) & set(lb))
