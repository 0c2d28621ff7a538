"""EAGLE-3 speculation on CUDA: the hidden-state capture runs inside the decode/verify CUDA graphs
(its drafts equal those of the same engine run eagerly, bit for bit), and greedy outputs equal
speculation off, with the overlapped plain steps of rounds the budget kept no drafts in too.

    pytest -m gpu tests/gpu/test_eagle3.py     (SPECSERVE_TOKENIZER set where there is no hub)
"""

from __future__ import annotations

import json

import pytest
import torch

from specserve import LLM, SamplingParams, env
from specserve.model.config import ModelConfig
from specserve.model.loader.dummy import PRESETS
from tests.gpu.conftest import steps_without_host_sync
from tests.model.test_eagle3_format import write_tiny_head
from tests.speculative.eagle3_heads import LAYERS, _copy_head, _ids, _spec, _spy

pytestmark = pytest.mark.gpu

SP = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (CUDA graphs)")
    root = tmp_path_factory.mktemp("e3gpu")
    # head_dim 64: the Triton attention path; fp32 so graphs, eager and spec off agree exactly
    cfg = dict(PRESETS["tiny"], num_hidden_layers=4, hidden_size=256, head_dim=64)
    (root / "config.json").write_text(json.dumps(cfg))
    return f"dummy:{root}", ModelConfig.from_hf(cfg)


def _llm(model: str, spec: dict | None = None, device_drafts: bool = False, **kw) -> LLM:
    """The host drafter unless device_drafts (the head inside the step: the CUDA default)."""
    kw = dict(max_num_seqs=8, max_model_len=256, kv_cache_memory_gb=0.25) | kw
    with env.override(device_drafts=device_drafts):
        return LLM(
            model,
            dtype="float32",
            device="cuda",
            speculative_config=spec,
            debug_invariants=True,
            progress=False,
            **kw,
        )


@pytest.fixture(scope="module")
def prompts():
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 17, 40, 64, 9, 3, 33, 12)]


@pytest.fixture(scope="module")
def ref(target, prompts):
    return _ids(_llm(target[0]).generate(prompts, SP, use_tqdm=False))


def test_capture_inside_cuda_graphs_drafts_as_eager(target, prompts, ref, tmp_path):
    head = _copy_head(tmp_path / "copy", target, ref, device="cuda")
    spec = _spec(head, k=3, verify_budget="off")
    runs = {}
    for eager in (False, True):
        llm = _llm(target[0], spec, enforce_eager=eager)
        records = _spy(llm)
        assert _ids(llm.generate(prompts, SP, use_tqdm=False)) == ref
        graphs = llm.engine.runner.graphs
        if not eager:
            assert graphs.num_verify_replays > 0  # verify steps captured hidden states in graphs
        m = llm.get_metrics()
        runs[eager] = ([(t, d) for t, d, _, _ in records], m["spec_accepted_tokens"])
    assert runs[False][1] > 0
    assert runs[False] == runs[True]


def test_greedy_eagle3_with_plain_steps_and_overlap_on_cuda(target, prompts, ref, tmp_path):
    ids = sorted(set(range(100, 140)) | {t for r in ref for t in r[:2]})
    head = write_tiny_head(tmp_path / "random", target[1], ids, LAYERS, confidence=True)
    llm = _llm(target[0], _spec(head, k=4))
    assert llm.engine.overlap_when_paused  # steps without drafts overlap on CUDA
    assert _ids(llm.generate(prompts, SP, use_tqdm=False)) == ref
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_greedy_device_eagle3_with_overlap_on_cuda(target, prompts, ref, tmp_path, enforce_eager):
    """The head drafting inside the step (device drafting, overlap: the CUDA default): greedy
    outputs equal speculation off, every step launched behind the one in flight."""
    head = _copy_head(tmp_path / "copy", target, ref, device="cuda")
    llm = _llm(target[0], _spec(head, k=3), device_drafts=True, enforce_eager=enforce_eager)
    eng = llm.engine
    assert eng.device_drafting is not None and eng.device_drafting.model_drafter is not None
    assert _ids(llm.generate(prompts, SP, use_tqdm=False)) == ref
    assert eng.num_sync_steps == 0
    assert llm.get_metrics()["spec_accepted_tokens"] > 0
    assert eng.block_manager.num_used_blocks == 0


def test_greedy_device_eagle3_with_mixed_graphs(target, prompts, tmp_path):
    """SPECSERVE_MIXED_GRAPHS=1: steps with a prompt chunk beside decodes (4 slots for 8
    prompts: admissions mid-run) replay mixed-bucket graphs, the hidden states the head reads
    captured inside them; greedy outputs equal speculation off's with the same graphs."""
    with env.override(mixed_graphs=True):
        off = _llm(target[0], max_num_seqs=4)
        mixed_ref = _ids(off.generate(prompts, SP, use_tqdm=False))
        head = _copy_head(tmp_path / "copy", target, mixed_ref, device="cuda")
        llm = _llm(target[0], _spec(head, k=3), device_drafts=True, max_num_seqs=4)
    assert off.engine.runner.graphs.num_mixed_runs > 0
    assert _ids(llm.generate(prompts, SP, use_tqdm=False)) == mixed_ref
    eng = llm.engine
    assert eng.runner.graphs.num_mixed_runs > 0 and eng.num_sync_steps == 0
    # the prompts' catch-ups (and any gap's) replayed in the head's rows buckets
    assert eng.device_drafting.model_drafter.catch_up.num_replays > 0
    assert llm.get_metrics()["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_device_eagle3_chain_graphs_draft_as_eager(target, prompts, ref, tmp_path, temperature):
    """The head's steps (the chain, and in the steady state the catch-up too) replay CUDA graphs
    (eagle3_chain.py) and draft, bit for bit, what the same padded bodies run eagerly draft:
    same outputs, same accepted drafts."""
    ids = sorted(set(range(100, 140)) | {t for r in ref for t in r[:2]})
    head = write_tiny_head(tmp_path / "random", target[1], ids, LAYERS, confidence=True)
    sp = SamplingParams(temperature=temperature, seed=3, max_tokens=40, ignore_eos=True)
    runs = {}
    for eager in (False, True):
        llm = _llm(
            target[0],
            _spec(head, k=4, verify_budget="off"),
            device_drafts=True,
            enforce_eager=eager,
        )
        outs = _ids(llm.generate(prompts, sp, use_tqdm=False))
        chain = llm.engine.device_drafting.model_drafter.chain
        assert (chain.num_replays > 0) == (not eager)
        assert chain.num_steady > 0  # the catch-up inside the graph (or its eager twin)
        spec = llm.engine.ledger.spec
        runs[eager] = (outs, spec.num_draft_tokens, spec.num_accepted_tokens)
    assert runs[False] == runs[True]
    if temperature == 0.0:
        assert runs[False][0] == ref


def test_no_host_sync_inside_a_device_eagle3_step(target, prompts, ref, tmp_path):
    head = _copy_head(tmp_path / "copy", target, ref, device="cuda")
    llm = _llm(target[0], _spec(head, k=3), device_drafts=True)
    eng = llm.engine
    llm.generate(prompts, SP, use_tqdm=False)  # warm-up
    steps_without_host_sync(eng, prompts, [SP] * len(prompts))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_device_eagle3_steps_draft_in_the_graph_tail_as_eagerly(
    target, prompts, ref, tmp_path, temperature
):
    """Steady greedy steps write the chain's inputs inside the target's graph tail and replay
    the chain's graph behind it (runner/graph_tail.py): the outputs and the drafts verified and
    accepted per position are those of the eager sampler's steps. Sampled steps keep the eager
    sampler."""
    ids = sorted(set(range(100, 140)) | {t for r in ref for t in r[:2]})
    head = write_tiny_head(tmp_path / "random", target[1], ids, LAYERS, confidence=True)
    sp = SamplingParams(temperature=temperature, seed=3, max_tokens=40, ignore_eos=True)
    runs = {}
    for tail in (True, False):
        with env.override(graph_tail=tail):
            llm = _llm(target[0], _spec(head, k=4, verify_budget="off"), device_drafts=True)
        outs = _ids(llm.generate(prompts, sp, use_tqdm=False))
        g = llm.engine.runner.graphs
        assert (g.num_drafted_tail_runs > 0) == (tail and temperature == 0.0)
        assert llm.engine.num_sync_steps == 0
        runs[tail] = (outs, llm.engine.ledger.spec)
    assert runs[True] == runs[False]
    assert runs[True][1].num_draft_tokens > 0
    if temperature == 0.0:
        assert runs[True][0] == ref
