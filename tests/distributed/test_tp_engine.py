"""Engines at tensor_parallel_size=2 on the CPU (gloo, one spawned worker each) against the same
model at tensor_parallel_size=1, fp32: logits equal to a tight tolerance, greedy outputs equal
token for token (tiny uneven-heads model with overlap scheduling on; the default model,
SmolLM2-135M, 9 heads / 3 KV heads, with n-gram speculation on), aborts and stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.block_manager import BlockTable
from specserve.model.cpu_linear import PackedLinear
from tests.distributed.conftest import ENGINE, close

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "one two three one two three one two three one two",
    "Once upon a time, in a small village,",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


# small steps: the longer prompts are prefilled in chunks
TINY = {**ENGINE, "max_num_seqs": 4, "max_num_batched_tokens": 8}


@pytest.fixture(scope="module")
def tiny_tp2(uneven_llama_dir: Path):
    # overlap on: the CPU worker thread runs rank 0's forwards, next tokens broadcast
    llm = LLM(str(uneven_llama_dir), tensor_parallel_size=2, overlap=True, **TINY)
    yield llm
    close(llm)


@pytest.fixture(scope="module")
def tiny_tp1(uneven_llama_dir: Path):
    return LLM(str(uneven_llama_dir), **TINY)


@pytest.fixture(scope="module")
def default_tp2():
    spec = {"method": "ngram", "num_speculative_tokens": 3, "verify_budget": "off"}
    llm = LLM(tensor_parallel_size=2, speculative_config=spec, **ENGINE)
    yield llm
    close(llm)


@pytest.fixture(scope="module")
def default_tp1():
    return LLM(**ENGINE)


def _tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _logits(llm: LLM, prompt: str) -> torch.Tensor:
    """Every row's logits of one prefill through the engine's runner (rank 0 and its worker),
    in blocks taken from the block manager and given back."""
    eng = llm.engine
    ids = eng.tokenizer.encode(prompt)
    table = BlockTable()
    eng.block_manager.allocate(table, len(ids))
    try:
        inputs = eng.runner.prepare_rows([ids], [0], [table.blocks], [len(ids)])
        return eng.runner.forward(inputs)
    finally:
        eng.block_manager.free(table)


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_logits_equal_tp1(which: str, request: pytest.FixtureRequest) -> None:
    tp2 = request.getfixturevalue(f"{which}_tp2")
    tp1 = request.getfixturevalue(f"{which}_tp1")
    assert tp2.engine.tp is not None and tp1.engine.tp is None
    want = _logits(tp1, PROMPTS[1])
    got = _logits(tp2, PROMPTS[1])
    assert got.shape == want.shape and want.shape[1] == 49152
    scale = want.abs().max().item()
    # the all-reduces only reorder fp32 sums
    torch.testing.assert_close(got, want, atol=1e-4 * scale, rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_greedy_equal_tp1_uneven_heads_with_overlap(tiny_tp2: LLM, tiny_tp1: LLM) -> None:
    assert tiny_tp2.engine.tp.plan.ranks[1].num_kv_heads == 1  # the uneven split is exercised
    assert _tokens(tiny_tp2) == _tokens(tiny_tp1)
    assert tiny_tp2.engine.num_sync_steps < tiny_tp2.engine.num_steps  # steps did overlap


def test_default_model_with_speculation_equals_tp1_without(
    default_tp2: LLM, default_tp1: LLM
) -> None:
    outs = default_tp2.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _tokens(default_tp1)
    # speculation ran: some drafts were verified and accepted under TP
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


def test_abort_leaves_the_others_exact(tiny_tp2: LLM, tiny_tp1: LLM) -> None:
    want = _tokens(tiny_tp1)
    eng = tiny_tp2.engine
    seqs = [eng.add_request(p, GREEDY) for p in PROMPTS]
    got: dict[str, list[int]] = {s.request_id: [] for s in seqs}
    finished: dict[str, str] = {}
    steps = 0
    while eng.has_unfinished():
        steps += 1
        if steps == 4:
            assert eng.abort(seqs[2].request_id)
        for out in eng.step():
            if out.token_id >= 0:
                got[out.request_id].append(out.token_id)
            if out.finished:
                finished[out.request_id] = out.finish_reason
    eng.release_outputs()
    assert finished[seqs[2].request_id] == "abort"
    assert want[2][: len(got[seqs[2].request_id])] == got[seqs[2].request_id]
    for i in (0, 1, 3):
        assert got[seqs[i].request_id] == want[i]
    assert eng.block_manager.num_used_blocks == 0


def test_stop_strings_equal_tp1(tiny_tp2: LLM, tiny_tp1: LLM) -> None:
    plain = tiny_tp1.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    stops = [o.outputs[0].text[8:14] for o in plain]  # text from the middle of each output
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[s]) for s in stops
    ]
    want = tiny_tp1.generate(PROMPTS[:2], params, use_tqdm=False)
    got = tiny_tp2.generate(PROMPTS[:2], params, use_tqdm=False)
    for w, g, s in zip(want, got, stops):
        wo, go = w.outputs[0], g.outputs[0]
        assert (go.text, go.token_ids, go.finish_reason) == (wo.text, wo.token_ids, "stop")
        assert s not in go.text


def test_the_target_as_its_own_draft_model_is_refused() -> None:
    from specserve.sampling_params import InvalidRequestError

    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": "self"}
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size") as e:
        LLM("dummy:tiny", tensor_parallel_size=2, speculative_config=spec, **ENGINE)
    assert e.value.param == "speculative_config"


def _params_of(llm: Any) -> int:
    # a TP=1 CPU engine repacks its linears (model/cpu_linear.py): their weights leave parameters()
    model = llm.engine.target_model
    packed = sum(
        m.out_features * m.in_features for m in model.modules() if isinstance(m, PackedLinear)
    )
    return packed + sum(p.numel() for p in model.parameters())


def test_rank0_holds_a_shard(tiny_tp2: LLM, tiny_tp1: LLM) -> None:
    assert _params_of(tiny_tp2) < 0.7 * _params_of(tiny_tp1)
    kv = tiny_tp2.engine.runner.kv_caches[0].k.shape[2]
    assert kv == 2  # rank 0's 2 of the 3 KV heads


def test_served_at_tp2(tiny_tp2: LLM, tiny_tp1: LLM) -> None:
    httpx = pytest.importorskip("httpx")
    from specserve.server.launch import ServerThread

    want = tiny_tp1.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].text
    server = ServerThread(tiny_tp2.engine).start()
    try:
        body = {
            "model": tiny_tp2.model_name,
            "prompt": PROMPTS[0],
            "max_tokens": GREEDY.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    finally:
        server.stop()


def _flat(entries: list) -> list[tuple[int, float, int | None]]:
    return [(t, lp.logprob, lp.rank) for e in entries if e for t, lp in sorted(e.items())]


def test_logprobs_and_prompt_logprobs_equal_tp1(tiny_tp2: LLM, tiny_tp1: LLM) -> None:
    """Prompt rows are scored on every rank's lm_head shard (the workers replay the same
    gathers; PROMPTS[1] takes several chunks), sampled-token logprobs on rank 0."""
    params = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    (want,) = tiny_tp1.generate(PROMPTS[1], params, use_tqdm=False)
    (got,) = tiny_tp2.generate(PROMPTS[1], params, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for g, w in (
        (got.prompt_logprobs, want.prompt_logprobs),
        (got.outputs[0].logprobs, want.outputs[0].logprobs),
    ):
        fg, fw = _flat(g), _flat(w)
        assert len(fg) == len(fw) > 0
        assert [(t, r) for t, _, r in fg] == [(t, r) for t, _, r in fw]
        assert [lp for _, lp, _ in fg] == pytest.approx([lp for _, lp, _ in fw], abs=1e-4)
