"""EAGLE-3 speculation end to end on a tiny random Llama target with random heads written in the
vLLM/SGLang format: greedy outputs equal speculation off (sync, overlap, preemption, prefix
cache), every draft equals a from-scratch recomputation of the head over the target's own hidden
states (exact KV/store bookkeeping), rejection sampling with the head's q is lossless, and the
capture costs nothing when no head is loaded."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from specserve import SamplingParams, env
from specserve.config import SpeculativeConfig
from specserve.model.aux_capture import AuxCapture
from specserve.model.config import ModelConfig
from specserve.model.loader import load_model
from specserve.model.loader.dummy import PRESETS
from specserve.ops.sampling import SamplingTensors, target_probs
from specserve.sample.layout import build_layout
from specserve.sample.verify import verify
from specserve.sampling_params import InvalidRequestError
from specserve.speculative.draft_graphs import _SHAPES, chain_buckets
from specserve.speculative.eagle3_chain import Eagle3Chain
from tests.engine.conftest import make_llm, prompts_of
from tests.model.harness import PagedRunner
from tests.model.test_eagle3_format import head_config, write_head, write_tiny_head
from tests.speculative.fake_graphs import FakeGraphs
from tests.speculative.test_lossless import CHI2_CRIT, _chi2

LAYERS = [0, 2, 3]  # explicit: a 4-layer target's default ids (2, 2, 1) repeat a layer
SP = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[str, ModelConfig]:
    root = tmp_path_factory.mktemp("e3target")
    cfg = dict(PRESETS["tiny"], num_hidden_layers=4)
    (root / "config.json").write_text(json.dumps(cfg))
    return f"dummy:{root}", ModelConfig.from_hf(cfg)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    base = prompts_of([5, 12, 30, 3, 17, 9], seed=11)
    return base + [base[2][:20] + p for p in prompts_of([4, 8], seed=12)]  # shared prefixes


@pytest.fixture(scope="module")
def ref(target, prompts) -> list[list[int]]:
    off = make_llm(model=target[0])
    assert off.engine.target_model.aux_capture is None  # no head: no capture, no buffer
    return _ids(off.generate(prompts, SP, use_tqdm=False))


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _copy_head(path: Path, target: tuple[str, ModelConfig], ref, device: str = "cpu") -> Path:
    """A head that drafts the context's majority token (fc = 0, uniform attention over the
    normed embeddings, lm_head rows = normed target embeddings): it is often right on the
    repetitive outputs of a random target, so accepts of every length happen."""
    tc = target[1]
    h = tc.hidden_size
    counts = Counter(t for r in ref for t in r)
    ids = sorted({t for t, _ in counts.most_common(12)} | set(range(200, 212)))
    # the embedding the target has on `device` (a dummy model's weights depend on the device)
    emb = load_model(target[0], torch.float32, torch.device(device), progress=False)
    e = emb.model.embed_tokens.weight.detach().cpu()
    e = e / e.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
    z = torch.zeros
    g = torch.Generator().manual_seed(3)
    qk = torch.randn(h, 2 * h, generator=g) * 0.02  # near-uniform attention, rope still matters
    t = {
        "fc.weight": z(h, 3 * h),
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.self_attn.q_proj.weight": qk,
        "midlayer.self_attn.k_proj.weight": qk.clone(),
        "midlayer.self_attn.v_proj.weight": torch.cat([torch.eye(h), z(h, h)], 1),
        "midlayer.self_attn.o_proj.weight": torch.eye(h),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "midlayer.mlp.gate_proj.weight": z(2 * h, h),
        "midlayer.mlp.up_proj.weight": z(2 * h, h),
        "midlayer.mlp.down_proj.weight": z(h, 2 * h),
        "norm.weight": torch.ones(h),
        "lm_head.weight": e[ids] * 4,
        "d2t": torch.tensor(ids) - torch.arange(len(ids)),
        "t2d": torch.zeros(tc.vocab_size, dtype=torch.bool).index_fill_(0, torch.tensor(ids), 1),
    }
    cfg = head_config(h, 2 * h, h // 16, h // 16, 16, tc.vocab_size, len(ids))
    cfg["eagle_aux_hidden_state_layer_ids"] = LAYERS
    return write_head(path, cfg, t)


@pytest.fixture(scope="module")
def heads(tmp_path_factory, target, ref) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e3heads")
    counts = Counter(t for r in ref for t in r)
    ids = sorted({t for t, _ in counts.most_common(8)} | set(range(100, 140)))
    return {
        "copy": _copy_head(root / "copy", target, ref),
        "random": _with_temperatures(
            write_tiny_head(root / "random", target[1], ids, LAYERS, confidence=True)
        ),
    }


TEMPS = [0.5, 2.0]  # per draft position; the last one for the positions after


def _with_temperatures(path: Path) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    cfg["confidence_temperatures"] = TEMPS
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _spec(path: Path, k: int = 3, **kw) -> dict:
    return {"method": "eagle3", "model": str(path), "num_speculative_tokens": k, **kw}


def _spy(llm) -> list[tuple[list[int], list[int], list[float], int]]:
    """Record (tokens at drafting time, drafts, confidences, positions caught up after the
    first output token, else 0) of every proposal."""
    drafter = llm.engine.drafter
    orig, records = drafter.propose, []

    def spy(seqs, limits):
        snap = [list(s.token_ids) for s in seqs]
        late = [
            s.num_tokens - 1 - drafter._marks.valid(s) if s.num_output_tokens > 1 else 0
            for s in seqs
        ]
        out = orig(seqs, limits)
        records.extend((t, d, c, n) for t, (d, c), n in zip(snap, out, late) if d)
        return out

    drafter.propose = spy
    return records


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


@pytest.mark.parametrize("head", ["copy", "random"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_device_eagle3_drafts_inside_the_step(target, prompts, ref, heads, head, temperature):
    """With overlap the head drafts inside the step (eagle3_device.py): every step launched
    behind the one in flight, drafts accepted, preemption on the way. Greedy: the outputs of
    speculation off; sampled: rejection sampling against the head's q, seeded, so the run
    repeats itself (a flat random target accepts next to nothing there; test_lossless.py
    checks the distribution, absent drafts included)."""
    llm = make_llm(
        model=target[0],
        speculative_config=_spec(heads[head], k=3, verify_budget="off"),
        kv_cache_memory_gb=10 * 16384 / 2**30,
        max_num_batched_tokens=48,
        max_num_seqs=8,
        overlap=True,
        debug_invariants=True,
    )
    eng = llm.engine
    assert eng.device_drafting is not None and eng.device_drafting.model_drafter is not None
    sp = SamplingParams(temperature=temperature, seed=3, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    if temperature == 0.0:
        assert _ids(outs) == ref
    else:
        assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == _ids(outs)
    assert eng.num_sync_steps == 0
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    m = llm.get_metrics()
    assert m["spec_draft_tokens"] > 0
    if head == "copy" and temperature == 0.0:
        assert m["spec_accepted_tokens"] > m["spec_draft_tokens"] / 4
        assert max(m["spec_acceptance_per_position"][1:]) > 0  # multi-token accepts
    assert eng.block_manager.num_used_blocks == 0 and eng.slot_pool.num_in_use == 0


def test_device_eagle3_drafts_are_the_host_drafters(target, prompts, ref, heads):
    """Synchronous host drafting and device drafting with overlap draft the same tokens: the
    catch-up over the step's rows (prompt rows at a request's first drafting) and the chain
    leave the head's KV as the host drafter's."""
    spec = _spec(heads["random"], k=3, verify_budget="off")
    host = make_llm(model=target[0], speculative_config=spec, max_num_seqs=8)
    dev = make_llm(model=target[0], speculative_config=spec, max_num_seqs=8, overlap=True)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert _ids(dev.generate(prompts, sp, use_tqdm=False)) == _ids(
        host.generate(prompts, sp, use_tqdm=False)
    )
    a, b = dev.engine.ledger.spec, host.engine.ledger.spec
    assert a.num_accepted_tokens == b.num_accepted_tokens > 0


def _reference_drafts(llm, loaded, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
    """The head recomputed from scratch: the target's aux streams from one fresh prefill, then
    each chain step a dense causal pass over the whole extended sequence."""
    head = llm.engine.drafter.head
    cap = AuxCapture(tuple(LAYERS), loaded.config.hidden_size, 256, torch.float32, "cpu")
    loaded.model.aux_capture = cap
    n = len(tokens)
    PagedRunner(loaded.model, loaded.config).forward([(0, tokens[: n - 1])])
    with torch.no_grad():
        hidden = head.fc(cap.rows[: n - 1])  # [N-1, H] g at positions 0..N-2
        ids, drafts, confs = list(tokens[1:]), [], []
        for _ in range(k):
            pos = torch.arange(len(ids))[None]
            out = head(torch.tensor([ids]), hidden[None], pos)
            d = int(head.draft_to_target()[out.logits[0, -1].argmax()])
            drafts.append(d)
            # no confidence head: the drafted token's q, 1 for a greedy (one-hot) draft
            c, temp = out.confidence, TEMPS[min(len(drafts) - 1, len(TEMPS) - 1)]
            confs.append(1.0 if c is None else float(torch.sigmoid(c[0, -1] / temp)))
            ids.append(d)
            hidden = torch.cat([hidden, out.prenorm[0, -1:]])
    return drafts, confs


def _plan_every(llm, n: int) -> None:
    """The verify budget plans no drafts for n - 1 rounds in n (nothing is drafted, a plain
    step follows: overlapped where the engine overlaps) and all of each request's room in the
    other, independent of timing."""
    calls = [0]

    def allot(surv, base_rows, room=None):
        calls[0] += 1
        return list(room) if calls[0] % n == 0 else [0] * len(room)

    llm.engine.budget.allot = allot


@pytest.mark.parametrize("head,every", [("copy", 1), ("random", 2), ("random", 4)])
def test_every_draft_is_the_head_recomputed_from_scratch(target, prompts, ref, heads, head, every):
    """Catch-up, chain, rollback after accepts and rejects, preemption, prefix-cache reuse and
    the plain steps between drafting rounds (forced for the random head: overlapped when every
    other round drafts; synchronous, three plain steps in a row that draft nothing, when every
    fourth does) leave the head's KV and the stored hidden states exactly what a fresh
    computation gives."""
    kw = {"verify_budget": "off"} if every == 1 else {}
    with env.override(device_drafts=False):  # the host drafter (its proposals are spied on)
        llm = make_llm(
            model=target[0],
            speculative_config=_spec(heads[head], k=3, **kw),
            kv_cache_memory_gb=10 * 16384 / 2**30,
            max_num_batched_tokens=48,
            max_num_seqs=8,
            overlap=every == 2,
            debug_invariants=True,
        )
    records = _spy(llm)
    if every > 1:
        _plan_every(llm, every)
    outs = llm.generate(prompts, SP, use_tqdm=False)
    assert _ids(outs) == ref
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    if head == "copy":
        assert llm.get_metrics()["spec_accepted_tokens"] > 0
    else:
        if every == 2:
            assert llm.engine.num_sync_steps < llm.engine.num_steps  # some ran overlapped
        # drafting resumed after plain steps: its catch-up read g stored by those steps
        assert max(r[3] for r in records) > 4
    loaded = load_model(target[0], torch.float32, torch.device("cpu"), progress=False)
    checked = 0
    late = [r for r in records if r[3] > 4]
    for tokens, drafts, confs, _ in records[:: max(1, len(records) // 12)] + late[:3]:
        want, want_c = _reference_drafts(llm, loaded, tokens, len(drafts))
        assert drafts == want
        assert confs == pytest.approx(want_c, abs=1e-4)
        checked += 1
    assert checked >= 10


def test_capture_is_the_residual_stream_entering_each_layer(tiny_llama_dir):
    """vLLM's aux hidden state of layer i is layer i's input: HF's hidden_states[i]."""
    from tests.conftest import make_tiny_hf_model

    hf = make_tiny_hf_model("llama")
    loaded = load_model(str(tiny_llama_dir), torch.float32, torch.device("cpu"), progress=False)
    cap = AuxCapture((1, 0), loaded.config.hidden_size, 64, torch.float32, "cpu")
    loaded.model.aux_capture = cap
    ids = prompts_of([11], seed=5)[0]
    ids = [i % loaded.config.vocab_size for i in ids]
    PagedRunner(loaded.model, loaded.config).forward([(0, ids)])
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    h = loaded.config.hidden_size
    assert cap.num_rows == 11
    torch.testing.assert_close(cap.rows[:11, :h], hs[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cap.rows[:11, h : 2 * h], hs[1][0], rtol=1e-5, atol=1e-5)


def test_rejection_sampling_with_the_heads_q_is_lossless(tmp_path):
    """q = the head's distribution over its draft vocabulary, mapped into the target's (0 off it):
    the first emitted token is distributed as the target p (chi-square, as test_lossless)."""
    from specserve.model.loader.eagle3 import load_eagle3_head
    from specserve.ops.random import hashed_uniform
    from specserve.ops.sampling import DRAFT_SALT
    from tests.model.test_eagle3_format import head_tensors
    from tests.speculative.test_lossless import N, V

    tc = ModelConfig("LlamaForCausalLM", V, 16, 32, 4, 2, 1, 8)
    draft_ids = [1, 2, 4, 6, 7]  # 0, 3, 5 lie outside the draft vocabulary: q = 0 there
    cfg = head_config(
        16, 32, 2, 1, 8, V, len(draft_ids), eagle_aux_hidden_state_layer_ids=[0, 1, 3]
    )
    path = write_head(tmp_path / "h", cfg, head_tensors(16, 16, 32, 2, 1, 8, V, draft_ids, seed=4))
    torch.manual_seed(0)
    head = load_eagle3_head(path, tc, "cpu", torch.float32, torch.nn.Embedding(V, 16))
    with torch.no_grad():
        out = head(torch.tensor([[3]]), torch.randn(1, 1, 48), torch.zeros(1, 1, dtype=torch.long))
    head_logits = head.target_logits(out.logits[0])  # [1, V], -inf off the draft vocab
    g = torch.Generator().manual_seed(1)
    target_logits = torch.randn(V, generator=g) * 1.5
    params = SamplingParams(temperature=1.0)
    seqlens = torch.full((N,), 2, dtype=torch.int64)
    layout = build_layout(seqlens, 2 * N, 1)
    t = SamplingTensors.build(
        [params] * (2 * N), [s for s in range(N) for _ in range(2)], [0, 1] * N, "cpu"
    )
    q = target_probs(head_logits.expand(2 * N, V).contiguous(), t)
    assert (q[:, [0, 3, 5]] == 0).all() and q[0, draft_ids].sum() == pytest.approx(1.0)
    u = hashed_uniform(t.seed, t.counter, DRAFT_SALT, V)
    drafts = (q / -torch.log(u)).argmax(-1)
    drafts = torch.stack([drafts[0::2], torch.zeros(N, dtype=torch.int64)], 1).reshape(-1)
    res = verify(target_logits.expand(2 * N, V).contiguous(), drafts, q, t, layout)
    first = torch.where(
        res.verified_token_ids[0::2] >= 0,
        res.verified_token_ids[0::2].long(),
        res.sampled_token_ids,
    )
    p = target_probs(target_logits[None], SamplingTensors.build([params], [0], [0], "cpu"))[0]
    assert _chi2(first, p) < CHI2_CRIT
    # and some drafts were rejected, others accepted: both branches were exercised
    acc = (res.verified_token_ids[0::2] >= 0).float().mean()
    assert 0.05 < float(acc) < 0.95


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


def _padded(llm) -> FakeGraphs:
    md = llm.engine.device_drafting.model_drafter
    old = md.chain
    md.chain = Eagle3Chain(
        md._step, md._confidence, md.pool, old.hidden.shape[1], old.hidden.dtype, md.width,
        md.block_size, md.trash, padded=True, store=md.inner.store,
    )  # fmt: skip
    fake = FakeGraphs()
    md.chain.capture(fake, md.head.rotary._table)
    return fake


@pytest.mark.parametrize("head", ["random", "copy"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padded_replayed_chain_drafts_what_the_eager_chain_drafts(
    target,
    prompts,
    ref,
    heads,
    temperature,
    head,
):
    """The graphs' bodies (chain, and steady catch-up + chain, padded to buckets) replayed on
    the CPU draft what the eager catch-up and chain draft, to the token."""
    spec = _spec(heads[head], k=3, verify_budget="off")
    kw = dict(model=target[0], speculative_config=spec, max_num_seqs=8, overlap=True)
    eager, graphs = make_llm(**kw), make_llm(**kw)
    fake = _padded(graphs)
    assert fake.captured == 2 * len(chain_buckets(8)) * len(_SHAPES)  # chain, steady
    sp = SamplingParams(temperature=temperature, seed=5, max_tokens=24, ignore_eos=True)
    a = eager.generate(prompts, sp, use_tqdm=False)
    b = graphs.generate(prompts, sp, use_tqdm=False)
    assert fake.replays > 0
    # most steps caught up inside the graph (the steady state), the rest eagerly (admissions)
    chain = graphs.engine.device_drafting.model_drafter.chain
    assert chain.num_steady > chain.num_replays / 2
    assert _ids(a) == _ids(b)
    if temperature == 0.0:
        assert _ids(b) == ref
    sa, sb = eager.engine.ledger.spec, graphs.engine.ledger.spec
    assert (sa.num_draft_tokens, sa.num_accepted_tokens) == (
        sb.num_draft_tokens,
        sb.num_accepted_tokens,
    )
    assert sb.num_draft_tokens > 0
