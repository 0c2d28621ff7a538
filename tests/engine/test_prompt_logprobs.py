"""prompt_logprobs end to end: HF transformers' log_softmax of the prompt's logits (tiny random
Llama checkpoint), whole or chunked prefill, overlap, the prefix cache, streaming, speculation,
and outputs unchanged by asking."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve import SamplingParams
from specserve.engine.outputs import Logprob
from tests.engine.conftest import make_llm, prompts_of

N = 3
PROMPTS = prompts_of([1, 9, 40, 23], seed=7)
GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama_dir: Path) -> list[torch.Tensor]:
    """HF's log_softmax over each prompt's logits: [L, V] per prompt (row i predicts token i+1)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(hf(torch.tensor([p])).logits[0], -1) for p in PROMPTS]


@pytest.fixture(scope="module")
def whole(tiny_llama_dir: Path):
    return make_llm(model=str(tiny_llama_dir), max_num_seqs=4, debug_invariants=True)


@pytest.fixture(scope="module")
def chunked(tiny_llama_dir: Path):
    # 8 rows a step: the 40-token prompt takes five chunks, others share steps with it; the
    # forward runs in the worker thread, overlapped with the ledger
    return make_llm(
        model=str(tiny_llama_dir),
        max_num_seqs=2,
        max_num_batched_tokens=8,
        overlap=True,
        debug_invariants=True,
    )


def _check_against_hf(plp: list[dict[int, Logprob] | None], prompt: list[int], ref: torch.Tensor):
    assert len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        row = ref[i - 1]  # [V]
        entry = plp[i]
        tok = prompt[i]
        want = float(row[tok])
        assert entry[tok].logprob == pytest.approx(want, abs=1e-4)
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(N)
        for rank, (tid, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert entry[tid].rank == rank
            assert entry[tid].logprob == pytest.approx(lp, abs=1e-4)
        assert len(entry) == N + (tok not in top.indices.tolist())


@pytest.mark.parametrize("engine", ["whole", "chunked"])
def test_prompt_logprobs_are_hf_log_softmax(engine, request, hf_logprobs) -> None:
    llm = request.getfixturevalue(engine)
    plain = llm.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
    outs = llm.generate(PROMPTS, SamplingParams(**GREEDY, prompt_logprobs=N), use_tqdm=False)
    for o, p, ref in zip(outs, PROMPTS, hf_logprobs):
        _check_against_hf(o.prompt_logprobs, p, ref)
    # asking changes nothing else
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)


def test_prefix_cache_is_not_used_to_skip_scored_rows(whole, hf_logprobs) -> None:
    prompt, ref = PROMPTS[2], hf_logprobs[2]  # 40 tokens: two full blocks of 16 can be cached
    whole.generate([prompt], SamplingParams(**GREEDY), use_tqdm=False)  # fills the cache
    scored = whole.generate([prompt], SamplingParams(**GREEDY, prompt_logprobs=N), use_tqdm=False)
    assert scored[0].metrics.num_cached_tokens == 0
    _check_against_hf(scored[0].prompt_logprobs, prompt, ref)
    again = whole.generate([prompt], SamplingParams(**GREEDY), use_tqdm=False)
    assert again[0].metrics.num_cached_tokens > 0  # other requests still hit it
    assert again[0].outputs[0].token_ids == scored[0].outputs[0].token_ids


def test_sampled_outputs_and_neighbours_are_unchanged() -> None:
    llm = make_llm(max_num_seqs=8, overlap=True, debug_invariants=True)
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    asking = SamplingParams(
        temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, prompt_logprobs=0
    )
    params = [sp, asking, sp, asking]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    for o, p, asked in zip(outs, PROMPTS, params):
        if asked is sp:
            assert o.prompt_logprobs is None
        else:  # N = 0: the prompt token alone
            assert len(o.prompt_logprobs) == len(p)
            assert all(list(e) == [t] for e, t in zip(o.prompt_logprobs[1:], p[1:]))


def test_streamed_on_the_first_output_and_the_same_under_speculation() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    runs = []
    for cfg in (None, spec):
        llm = make_llm(max_num_seqs=4, speculative_config=cfg, debug_invariants=True)
        prompt = PROMPTS[1] * 3  # repeats: the n-gram drafter drafts from the prompt
        sp = SamplingParams(**GREEDY, prompt_logprobs=2)
        outs = list(llm.stream([prompt], sp))
        assert outs[0].index == 0 and outs[0].prompt_logprobs is not None
        assert all(o.prompt_logprobs is None for o in outs[1:])
        runs.append((outs[0].prompt_logprobs, [o.token_id for o in outs if o.token_id >= 0]))
        assert cfg is None or llm.get_metrics()["spec_draft_tokens"] > 0
    (plp_off, ids_off), (plp_on, ids_on) = runs
    assert ids_on == ids_off
    assert len(plp_on) == len(plp_off) == len(PROMPTS[1]) * 3
    for a, b in zip(plp_off[1:], plp_on[1:]):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].rank == b[t].rank and a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5)


def test_prompt_logprobs_equal_the_logprobs_of_the_same_tokens_as_outputs(chunked) -> None:
    """Teacher forcing: tokens forced as outputs (golden_token_ids, scored on decode rows) get
    the logprobs they get as the tail of a prompt (scored on prefill rows)."""
    head, tail = PROMPTS[2][:10], PROMPTS[2][10:30]
    forced = SamplingParams(
        max_tokens=len(tail), ignore_eos=True, golden_token_ids=tail, logprobs=0
    )
    out = chunked.generate([head], forced, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tail
    sp = SamplingParams(**GREEDY, prompt_logprobs=0)
    scored = chunked.generate([head + tail], sp, use_tqdm=False)[0].prompt_logprobs
    for i, t in enumerate(tail):
        assert out.logprobs[i][t].logprob == pytest.approx(scored[10 + i][t].logprob, abs=1e-4)
        assert out.logprobs[i][t].rank == scored[10 + i][t].rank


def test_preemption_leaves_prompt_logprobs_whole() -> None:
    """KV for a few requests only: requests are preempted (some mid-prefill, some after their
    first token) and recomputed; their prompt logprobs and outputs are those of a roomy run."""
    prompts = prompts_of([30] * 6, seed=11)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=1)
    roomy = make_llm(max_num_seqs=6).generate(prompts, sp, use_tqdm=False)
    tight = make_llm(
        max_num_seqs=6,
        max_num_batched_tokens=16,
        kv_cache_memory_gb=12 * 8192 / 2**30,
        enable_prefix_caching=False,
        debug_invariants=True,
    ).generate(prompts, sp, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in tight) > 0
    for a, b in zip(roomy, tight):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(b.prompt_logprobs) == 30 and b.prompt_logprobs[0] is None
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            assert all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4) for t in x)
