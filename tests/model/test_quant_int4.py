"""quantization="int4" (specserve.model.quant_int4): GGUF Q4_1 re-encoded exactly, other weights
quantized per group of 32, close to fp32 on tiny checkpoints, refused where it cannot run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from specserve import LLM, SamplingParams, env
from specserve.config import check_quantization
from specserve.model.loader import load_model
from specserve.model.loader.gguf_file import split_q4_1
from specserve.model.quant import Int8Linear, quantize_model
from specserve.model.quant_int4 import Int4Linear, gguf_groups, q4_1_groups
from specserve.ops.int4 import GROUP, dequantize, quantize_groups
from specserve.sampling_params import InvalidRequestError
from tests.model.harness import PagedRunner, greedy, one_thread

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


def _q4_1_bytes(d: np.ndarray, m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """llama.cpp's Q4_1 layout: per block fp16 d, fp16 m, byte j = q[j] | q[j + 16] << 4."""
    n, nb = d.shape
    qb = q.reshape(n, nb, 32).astype(np.uint8)
    qs = qb[..., :16] | (qb[..., 16:] << 4)
    head = np.stack([d.astype(np.float16), m.astype(np.float16)], axis=-1).view(np.uint8)
    return np.concatenate([head.reshape(n, nb, 4), qs], axis=-1).reshape(n, nb * 20)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 20),
    blocks=st.integers(1, 4),
    log_d=st.floats(-12, 2),
    m_over_d=st.floats(-12, 4),
    seed=st.integers(0, 2**16),
)
def test_q4_1_blocks_are_re_encoded_exactly(
    rows: int, blocks: int, log_d: float, m_over_d: float, seed: int
) -> None:
    """dequant(int4pack) == GGUF's own dequant (gguf.quants), up to fp32 rounding of the zero
    m + 8d; the kernel's bf16 copy of scale and zero adds at most 2^-8 of them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    rng = np.random.default_rng(seed)
    d = (2.0**log_d * rng.uniform(0.5, 1.5, (rows, blocks))).astype(np.float16)
    m = (d.astype(np.float32) * m_over_d * rng.uniform(0.5, 1.5, (rows, blocks))).astype(np.float16)
    q = rng.integers(0, 16, (rows, blocks * GROUP))
    raw = _q4_1_bytes(d, m, q)
    want = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType.Q4_1).reshape(rows, -1))

    qt, dt, mt = split_q4_1(torch.from_numpy(raw))
    assert torch.equal(qt, torch.from_numpy(q).to(torch.uint8))  # the same 4-bit values
    q4, scale, zero = q4_1_groups(qt, dt, mt)
    bound = (zero.abs() + 8 * scale.abs()).t().repeat_interleave(GROUP, dim=1)
    exact = dequantize(q4, scale, zero)
    assert ((exact - want).abs() <= 2**-22 * bound).all()
    sb, zb = scale.bfloat16().float(), zero.bfloat16().float()
    assert ((dequantize(q4, sb, zb) - want).abs() <= 2**-8 * bound * (1 + 1e-3)).all()
    # the kernel: identity activations read the weights back (one bf16 rounding of outputs)
    layer = Int4Linear((q4, scale, zero), None, blocks * GROUP)
    eye = torch.eye(blocks * GROUP)
    got = torch.cat([layer(eye[i : i + 16]) for i in range(0, len(eye), 16)]).t()  # int4pack
    assert torch.equal(layer(eye).t(), got)  # the many-row copy holds the same bf16 weights
    kernel_ref = dequantize(q4, sb, zb)
    assert ((got - kernel_ref).abs() <= 2**-8 * kernel_ref.abs() + 1e-30).all()


@pytest.mark.parametrize(("n", "k"), [(50, 70), (16, 32), (5, 100)])
def test_int4_linear_pads_any_shape(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n)
    w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(3, 2, k)
    layer = Int4Linear.from_float(w, b)
    y = layer(x)
    q, scale, zero = quantize_groups(w)
    ref = torch.nn.functional.linear(x.bfloat16().float(), dequantize(q, scale, zero)[:, :k], b)
    assert y.shape == (3, 2, n)
    assert (y - ref).abs().max() <= 1e-2 * ref.abs().max()


def test_default_gguf_q4_1_tensors_map_onto_the_loaded_weights(default_gguf_path: Path) -> None:
    """Every Q4_1 tensor of the real model lands on its module and shard (q/k rows unpermuted)
    and dequantizes to the fp32 weights the loader produced, to fp32 rounding."""
    model = load_model(str(default_gguf_path), torch.float32, CPU, progress=False).model
    source = gguf_groups(model, default_gguf_path)
    assert len(source) == 4 * model.config.num_hidden_layers  # qkv, o, gate_up, down
    assert "lm_head" not in source  # the tied embedding is Q8_0 in this file
    modules = dict(model.named_modules())
    for name, shards in source.items():
        weight = modules[name].weight
        got = torch.cat([dequantize(*g) for g in shards])  # every shard is Q4_1 here
        assert got.shape == weight.shape, name
        assert (got - weight).abs().max() <= 1e-6 * weight.abs().max(), name
    quantize_model(model, "int4", default_gguf_path)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.layers[0].mlp.gate_up_proj, Int4Linear)
    assert isinstance(model.lm_head, Int8Linear)  # SPECSERVE_INT4_HEAD=auto: not Q4_1 -> int8


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (30, 9, 17)]


def _on_the_int4_grid(model: nn.Module) -> nn.Module:
    """The model with every linear weight but the head replaced by its int4 groups' values: a
    checkpoint that ships 4-bit, as the default model does (its Q4_1 blocks)."""
    for mod in model.modules():
        if isinstance(mod, nn.Linear) and mod is not getattr(model, "lm_head", None):
            k = mod.weight.shape[1]
            mod.weight.data = dequantize(*quantize_groups(mod.weight))[:, :k]
    return model


def _teacher_forced(model: nn.Module, ref: nn.Module, config) -> tuple[float, float]:
    """(top-1 agreement with `ref` on `ref`'s own greedy continuations, max relative logit
    error) over the rows that predict the continuations."""
    prompts = _prompts(config.vocab_size)
    conts = greedy(PagedRunner(ref, config), prompts, max_new=16)
    batch = [(i, p + c) for i, (p, c) in enumerate(zip(prompts, conts))]
    want = PagedRunner(ref, config).logits(batch)
    got = PagedRunner(model, config).logits(batch)
    rows, start = [], 0
    for p, c in zip(prompts, conts):
        rows += range(start + len(p) - 1, start + len(p) + len(c) - 1)
        start += len(p) + len(c)
    agree = (got[rows].argmax(-1) == want[rows].argmax(-1)).float().mean()
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max()
    return float(agree), float(rel)


@pytest.mark.parametrize("head", ["auto", "int4"])
@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2"])
def test_int4_model_computes_its_dequantized_weights(
    tiny_hf_dirs: dict[str, Path], family: str, head: str
) -> None:
    path = str(tiny_hf_dirs[family])
    full = load_model(path, torch.float32, CPU, progress=False)
    with env.override(int4_head=head):
        m = quantize_model(load_model(path, torch.float32, CPU, progress=False).model, "int4")
    assert isinstance(m.lm_head, Int4Linear if head == "int4" else Int8Linear)
    assert m.embed_tokens.weight.dtype == torch.float32  # the lookup stays full precision
    ref = _on_the_int4_grid(full.model)
    if head == "int4":
        w = ref.embed_tokens.weight if ref.lm_head is None else ref.lm_head.weight
        ref.lm_head = nn.Linear(w.shape[1], w.shape[0], bias=False)
        ref.lm_head.weight.data = dequantize(*quantize_groups(w))
    _, rel = _teacher_forced(m, ref, full.config)
    # bf16 activations and outputs, and the int8 head (auto) (measured <= 0.03); a wrong layout
    # or scale ~1. Against the fp32 weights these random tiny models move ~0.8: 4-bit rounding
    # of Gaussian weights is ~8 % a layer, and they amplify it.
    assert rel < 0.1


@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2"])
def test_a_4_bit_checkpoint_keeps_its_greedy_tokens(tiny_hf_dirs: dict[str, Path], family: str):
    """A model whose weights are 4-bit already (as the default model's Q4_1 blocks) keeps fp32's
    greedy token at most positions once quantization="int4" runs it: only bf16 activations,
    bf16 scales and the int8 head are added."""
    path = str(tiny_hf_dirs[family])
    full = load_model(path, torch.float32, CPU, progress=False)
    ref = _on_the_int4_grid(full.model)
    m = quantize_model(
        _on_the_int4_grid(load_model(path, torch.float32, CPU, progress=False).model), "int4"
    )
    agree, rel = _teacher_forced(m, ref, full.config)
    assert agree >= 0.85  # measured 0.94-1.0
    assert rel < 0.1


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_int4_engine_generates_and_speculation_stays_lossless(tiny_llama_dir: Path) -> None:
    prompts = [p * 3 for p in _prompts(49152)]

    def run(spec: dict | None) -> list[list[int]]:
        llm = LLM(
            str(tiny_llama_dir),
            device="cpu",
            quantization="int4",
            speculative_config=spec,
            progress=False,
            max_num_seqs=4,
        )
        assert isinstance(llm.engine.target_model.layers[0].self_attn.qkv_proj, Int4Linear)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    plain = run(None)
    assert all(len(t) == 24 for t in plain)
    assert run({"method": "draft_model", "num_speculative_tokens": 3, "model": "self"}) == plain


def test_int4_is_refused_on_cuda_and_under_tensor_parallelism() -> None:
    with pytest.raises(InvalidRequestError, match="CPU only") as e:
        check_quantization("int4", "cuda", 1)
    assert e.value.param == "quantization"
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size") as e:
        LLM("dummy:tiny", device="cpu", progress=False, quantization="int4", tensor_parallel_size=2)
    assert e.value.param == "quantization"


def test_int4_is_refused_without_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    import specserve.ops.int4 as int4

    monkeypatch.setattr(int4, "int4_kernels_available", lambda: False)
    with pytest.raises(InvalidRequestError, match="_weight_int4pack_mm_for_cpu") as e:
        LLM("dummy:tiny", device="cpu", progress=False, quantization="int4")
    assert e.value.param == "quantization"
    assert "int8" in str(e.value)  # says what to use instead
