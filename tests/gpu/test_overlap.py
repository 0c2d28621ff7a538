"""Overlap scheduling on the GPU: outputs with overlap on == off (graphs and eager), and the sync
guard: the device portion of a step never synchronises with the host except at the one designed
point (`ops/transfer.designed_sync`, the wait for the step in flight's results). Requests that
read their output tokens on the host (grammars, penalties, bad words) overlap too: their
sampling is queued after the ledger of the step in flight (step_launch.py)."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from specserve import LLM, SamplingParams
from tests.engine.test_deferred_sampling import CHOICES, REGEX, SCHEMA
from tests.gpu.conftest import steps_without_host_sync

pytestmark = pytest.mark.gpu

MODEL = "dummy:smollm2-135m"  # head_dim 64: the Triton attention path


def _llm(overlap: bool, enforce_eager: bool = False) -> LLM:
    return LLM(
        MODEL,
        dtype="bfloat16",
        max_num_seqs=16,
        max_model_len=512,
        kv_cache_memory_gb=1.0,
        overlap=overlap,
        enforce_eager=enforce_eager,
        debug_invariants=True,
        progress=False,
    )


def _workload():
    rng = random.Random(0)
    lens = [5, 17, 40, 64, 100, 9, 3, 33, 70, 12]
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in lens]
    params = [
        SamplingParams(max_tokens=60, ignore_eos=True),
        SamplingParams(max_tokens=45, temperature=1.0, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.7, top_p=0.9, seed=9),
        SamplingParams(max_tokens=80, stop_token_ids=list(range(3, 20000)), min_tokens=3),
        SamplingParams(max_tokens=25, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=1, ignore_eos=True),
        SamplingParams(max_tokens=50, temperature=1.0, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=20, golden_token_ids=list(range(100, 140))),
        SamplingParams(max_tokens=40, ignore_eos=True),
        SamplingParams(max_tokens=35, temperature=1.0, seed=2, ignore_eos=True),
    ]
    return prompts, params


def _run(llm: LLM):
    prompts, params = _workload()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_overlap_matches_synchronous_on_gpu(cuda: torch.device, enforce_eager: bool) -> None:
    if cuda.type != "cuda":
        pytest.skip("needs a CUDA device")
    sync_llm = _llm(False, enforce_eager)
    over_llm = _llm(True, enforce_eager)
    assert over_llm.engine.overlap and not sync_llm.engine.overlap
    sync, over = _run(sync_llm), _run(over_llm)
    for i, (a, b) in enumerate(zip(sync, over)):
        assert a == b, f"request {i} differs with overlap"
    assert sync[3][1] == "stop" and len(sync[3][0]) < 80  # stopped while its next step flew


def test_overlap_is_the_cuda_default(cuda: torch.device) -> None:
    if cuda.type != "cuda":
        pytest.skip("needs a CUDA device")
    assert LLM(MODEL, max_num_seqs=2, kv_cache_memory_gb=0.2, progress=False).engine.overlap


def test_no_host_sync_inside_a_step(cuda: torch.device) -> None:
    """Steps run under torch.cuda.set_sync_debug_mode("error"): any synchronising call in the
    step (a .item(), .tolist() of a device tensor, a pageable copy) raises. The wait for the
    step in flight lifts the mode for itself only (designed_sync)."""
    if cuda.type != "cuda":
        pytest.skip("needs a CUDA device")
    llm = _llm(True)
    eng = llm.engine
    prompts, params = _workload()
    _run(llm)  # warm-up: Triton JIT, lazily built tables, allocator pools
    # prefill chunks, mixed steps, decode graphs, stops in flight, drain
    assert steps_without_host_sync(eng, prompts, params) > 20


def test_sync_guard_catches_a_sync(cuda: torch.device) -> None:
    """The guard itself works: a .item() inside a step is an error."""
    if cuda.type != "cuda":
        pytest.skip("needs a CUDA device")
    llm = _llm(True)
    eng = llm.engine
    real = eng.runner.forward

    def syncing_forward(inputs):
        logits = real(inputs)
        logits.sum().item()
        return logits

    eng.runner.forward = syncing_forward
    seq = eng.add_request([5, 6, 7], SamplingParams(max_tokens=4))
    torch.cuda.set_sync_debug_mode("error")
    try:
        # the engine isolates a failing step: the request it belongs to ends with the error
        ends = []
        for _ in range(20):
            ends += [o for o in eng.step() if o.request_id == seq.request_id and o.finished]
            if ends:
                break
        assert ends and ends[0].finish_reason == "error", ends
        assert "synchroniz" in str(ends[0].stop_reason), ends[0].stop_reason
    finally:
        torch.cuda.set_sync_debug_mode(0)
        eng.runner.forward = real
        eng.fail_all()


# -- requests that read their output tokens on the host (deferred sampling, step_launch.py) --


def _host_token_workload():
    """Grammars, penalties and bad words next to plain requests; some end by content (grammar
    complete, stop string, stop id) while their next step is already queued."""
    rng = random.Random(1)
    lens = [5, 17, 40, 64, 9, 3, 33, 70, 12, 21]
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in lens]
    json_so = {"json": SCHEMA, "disable_any_whitespace": True}
    params = [
        SamplingParams(max_tokens=48, structured_outputs=json_so),
        SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured_outputs={"regex": REGEX}),
        SamplingParams(max_tokens=30, structured_outputs={"choice": CHOICES}, ignore_eos=True),
        SamplingParams(
            max_tokens=40, temperature=1.0, seed=4, repetition_penalty=1.3, frequency_penalty=0.3
        ),
        SamplingParams(max_tokens=40, presence_penalty=0.5, stop=["e", "a"]),
        SamplingParams(max_tokens=40, bad_words=["the", " the"], ignore_eos=True),
        SamplingParams(max_tokens=60, ignore_eos=True),
        SamplingParams(max_tokens=45, temperature=1.0, seed=5, ignore_eos=True),
        SamplingParams(
            max_tokens=80,
            repetition_penalty=1.2,
            stop_token_ids=list(range(3, 20000)),
            min_tokens=3,
        ),
        SamplingParams(max_tokens=25, logprobs=2, ignore_eos=True),
    ]
    return prompts, params


def _check_grammars(params, outs) -> None:
    for sp, o in zip(params, outs):
        so, text, reason = sp.structured_outputs, o.outputs[0].text, o.outputs[0].finish_reason
        if so is None or reason != "stop":
            continue
        if so.json is not None:
            jsonschema.validate(json.loads(text), SCHEMA)
        elif so.regex is not None:
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in CHOICES, text


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_host_token_requests_overlap_and_match_on_gpu(
    cuda: torch.device, enforce_eager: bool
) -> None:
    """Every step launches behind the one in flight: the forward first, the sampling once the
    ledger has advanced the grammars and output tokens. Tokens equal the synchronous engine's
    (greedy and seeded), usage equals the tokens streamed."""
    if cuda.type != "cuda":
        pytest.skip("needs a CUDA device")
    prompts, params = _host_token_workload()
    sync_outs = _llm(False, enforce_eager).generate(prompts, params, use_tqdm=False)
    llm = _llm(True, enforce_eager)
    eng = llm.engine
    in_flight_at_launch = []
    real_launch = eng._launch

    def launch(batch, overlap):
        in_flight_at_launch.append(eng._inflight is not None)
        launched = real_launch(batch, overlap)
        assert launched.behind == in_flight_at_launch[-1]
        return launched

    eng._launch = launch
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (a, b) in enumerate(zip(sync_outs, outs)):
        got, want = b.outputs[0], a.outputs[0]
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), i
        assert b.metrics.num_output_tokens == len(got.token_ids)
    _check_grammars(params, outs)
    assert eng.num_deferred_steps > 0 and eng.num_sync_steps == 0
    # only the first step found nothing in flight: no step waited for a readback to launch
    assert in_flight_at_launch.count(False) == 1
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 3


def test_no_host_sync_inside_a_deferred_step(cuda: torch.device) -> None:
    """The deferred steps (forward queued, ledger, grammar bitmask / penalty / bad-word inputs
    uploaded, sampling queued) run under torch.cuda.set_sync_debug_mode("error") too."""
    if cuda.type != "cuda":
        pytest.skip("needs a CUDA device")
    llm = _llm(True)
    eng = llm.engine
    prompts, params = _host_token_workload()
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: JIT, grammars compiled, pools
    for p, sp in zip(prompts, params):
        eng.add_request(p, sp)
    deferred = eng.num_deferred_steps
    torch.cuda.synchronize()
    steps = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        while eng.has_unfinished():
            outs = eng.step()
            assert not any(o.finish_reason == "error" for o in outs), outs
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert steps > 20 and eng.num_deferred_steps - deferred > 10


def test_uploads_are_exact_and_never_sync(cuda: torch.device) -> None:
    """h2d and h2d_packed stage through pinned memory they fill in place: the values arrive
    whole, with a step in flight and the sync guard on."""
    from specserve.ops.transfer import h2d, h2d_packed

    if cuda.type != "cuda":
        pytest.skip("pinned staging is CUDA's")
    busy = torch.randn(2048, 2048, device=cuda)
    rng = random.Random(0)
    for n in (0, 1, 7, 1000):
        ints = [rng.randrange(-(2**40), 2**40) for _ in range(n)]
        floats = [rng.random() for _ in range(n + 3)]
        torch.cuda.set_sync_debug_mode("error")
        try:
            busy = busy @ busy  # a device still running when the uploads are queued
            a = h2d(ints, torch.int64, cuda)
            b, c, d = h2d_packed(
                [(ints, torch.int64), (floats, torch.float32), ([True] * n, torch.bool)], cuda
            )
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert a.tolist() == ints == b.tolist()
        assert c.cpu().tolist() == torch.tensor(floats, dtype=torch.float32).tolist()
        assert d.tolist() == [True] * n and d.dtype == torch.bool
