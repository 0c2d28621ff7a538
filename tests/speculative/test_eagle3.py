"""EAGLE-3 speculation end to end on a tiny random Llama target with random heads written in the
vLLM/SGLang format (eagle3_heads.py, targets and heads in conftest.py), the host drafter: greedy
outputs equal speculation off (sync, overlap, preemption, prefix cache), the head packed or
quantized as the target, seeded sampling repeats itself, and the config names a missing head.
The capture costs nothing when no head is loaded (the ref fixture). Drafts inside the step:
test_eagle3_device.py; exactness of the drafts and of q: test_eagle3_exact.py."""

from __future__ import annotations

import pytest
import torch

from specserve import SamplingParams, env
from specserve.config import SpeculativeConfig
from specserve.sampling_params import InvalidRequestError
from tests.engine.conftest import make_llm
from tests.speculative.eagle3_heads import SP, _ids, _spec


@pytest.mark.parametrize(
    "head,kw",
    [
        ("copy", {"overlap": True}),
        ("copy", {"preempt": True}),
    ],
    ids=["copy-overlap", "copy-preempt"],
)
def test_greedy_eagle3_is_token_for_token_identical(target, prompts, ref, heads, head, kw):
    kw = dict(kw)
    # 8 requests at most: the auto budget's start-up calibration times few buckets
    engine_kw: dict = {"debug_invariants": True, "max_num_batched_tokens": 48, "max_num_seqs": 8}
    if kw.pop("overlap", False):
        engine_kw["overlap"] = True
    if kw.pop("preempt", False):
        # 4 layers x 16 slots x 2 kv heads x 16 x 2 (k, v) x 4 B = 16 KiB a block
        engine_kw |= {"kv_cache_memory_gb": 10 * 16384 / 2**30}
    llm = make_llm(model=target[0], speculative_config=_spec(heads[head], **kw), **engine_kw)
    outs = llm.generate(prompts, SP, use_tqdm=False)
    assert _ids(outs) == ref
    m = llm.get_metrics()
    assert m["spec_drafts"] > 0
    if head == "copy":
        assert m["spec_accepted_tokens"] > m["spec_draft_tokens"] / 4
        assert max(m["spec_acceptance_per_position"][1:]) > 0  # multi-token accepts
    if "kv_cache_memory_gb" in engine_kw:
        assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert llm.engine.block_manager.num_used_blocks == 0
    assert llm.engine.slot_pool.num_in_use == 0


def test_a_cpu_head_serves_packed_and_drafts_what_the_dense_head_drafts(
    target, prompts, ref, heads
):
    """On the CPU the head's linears are packed as the target's (model/cpu_linear.py): its
    drafts, hence the accepted counts, are the dense head's (and outputs the target's)."""
    from specserve.model.cpu_linear import PackedLinear, packing_available

    if not packing_available(torch.float32):
        pytest.skip("no oneDNN in this torch build")
    accepted = {}
    for mode in ("auto", "torch"):
        with env.override(cpu_linear=mode):
            spec = _spec(heads["copy"], verify_budget="off")  # no timing in the choice
            llm = make_llm(model=target[0], speculative_config=spec)
        packed = [m for m in llm.engine.drafter.head.modules() if isinstance(m, PackedLinear)]
        assert bool(packed) == (mode == "auto")
        assert _ids(llm.generate(prompts, SP, use_tqdm=False)) == ref
        m = llm.get_metrics()
        accepted[mode] = (m["spec_draft_tokens"], m["spec_accepted_tokens"])
    assert accepted["auto"] == accepted["torch"] and accepted["auto"][1] > 0


@pytest.mark.parametrize("overlap", [False, True], ids=["host", "device"])
def test_a_quantized_engine_quantizes_its_head(target, prompts, heads, overlap):
    """quantization="int8": the head's linears are int8 like the target's (host drafting and
    drafting inside the step alike); greedy outputs stay the quantized target's own."""
    from specserve.model.quant import Int8Linear

    kw = dict(model=target[0], quantization="int8", overlap=overlap)
    ref = _ids(make_llm(**kw).generate(prompts, SP, use_tqdm=False))
    llm = make_llm(**kw, speculative_config=_spec(heads["copy"], verify_budget="off"))
    eng = llm.engine
    head = (eng.device_drafting.model_drafter if overlap else eng.drafter).head
    layers = [m for m in head.modules() if isinstance(m, (Int8Linear, torch.nn.Linear))]
    assert layers and all(isinstance(m, Int8Linear) for m in layers)
    assert _ids(llm.generate(prompts, SP, use_tqdm=False)) == ref
    assert llm.get_metrics()["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("overlap", [False, True], ids=["host", "device"])
def test_speculative_quantization_quantizes_the_head_alone(target, prompts, ref, heads, overlap):
    """speculative_config.quantization="int8" (vLLM's field for the drafter's weights): an int8
    head drafting for an fp32 target; greedy outputs stay the fp32 target's own."""
    from specserve.model.quant import Int8Linear

    spec = _spec(heads["copy"], verify_budget="off", quantization="int8")
    llm = make_llm(model=target[0], overlap=overlap, speculative_config=spec)
    eng = llm.engine
    head = (eng.device_drafting.model_drafter if overlap else eng.drafter).head
    layers = [m for m in head.modules() if isinstance(m, (Int8Linear, torch.nn.Linear))]
    assert layers and all(isinstance(m, Int8Linear) for m in layers)
    assert not any(isinstance(m, Int8Linear) for m in eng.target_model.modules())
    assert _ids(llm.generate(prompts, SP, use_tqdm=False)) == ref
    assert llm.get_metrics()["spec_accepted_tokens"] > 0


def test_sampling_with_eagle3_runs_seeded_and_reproducibly(target, prompts, heads):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    spec = _spec(heads["copy"], verify_budget="off")
    a = _ids(
        make_llm(model=target[0], speculative_config=spec, max_num_seqs=2).generate(
            prompts[:2], sp, use_tqdm=False
        )
    )
    b = _ids(
        make_llm(model=target[0], speculative_config=spec, max_num_seqs=2).generate(
            prompts[:2], sp, use_tqdm=False
        )
    )
    assert a == b and all(len(x) == 10 for x in a)


def test_eagle3_without_a_model_names_the_field(tiny_llama_dir):
    """No head named: only the default model has one shipped; any other target is an error
    naming the field, before anything loads."""
    from specserve.config import EngineConfig

    spec = {"method": "eagle3", "num_speculative_tokens": 3}
    assert SpeculativeConfig.parse(spec).model is None
    with pytest.raises(InvalidRequestError, match=r"speculative_config\.model") as e:
        EngineConfig(model=str(tiny_llama_dir), speculative_config=spec)
    assert e.value.param == "speculative_config.model"
    assert EngineConfig(speculative_config=spec).speculative_config.model is None
    cfg = SpeculativeConfig.parse(
        '{"method": "eagle3", "model": "/h", "num_speculative_tokens": 2}'
    )
    assert cfg.method == "eagle3" and cfg.model == "/h"


def test_greedy_drafting_writes_no_q_and_verifies_without_it(target, prompts, ref, heads):
    """Greedy requests alone: the head drafts the argmax of its vocabulary, mapped, and neither
    writes q to the pool nor hands q to verification (greedy verification reads none); the
    outputs stay the target's. A sampling request drafts with q, as before."""
    llm = make_llm(model=target[0], speculative_config=_spec(heads["copy"]), max_num_seqs=8)
    pool, spec = llm.engine.slot_pool, llm.engine.speculator
    seen: list[bool] = []
    draft_q = spec.draft_q
    spec.draft_q = lambda seqs, drafts: seen.append(draft_q(seqs, drafts) is None) or None
    assert _ids(llm.generate(prompts, SP, use_tqdm=False)) == ref
    assert seen and all(seen) and llm.get_metrics()["spec_drafts"] > 0
    assert not pool.q.any()  # nothing written: the pool's q starts at zero
    spec.draft_q = draft_q
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=8)
    llm.generate(prompts[:1], sampled, use_tqdm=False)
    assert pool.q.any()
