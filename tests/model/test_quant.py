"""quantization="int8" / "w8a8" (specserve.model.quant): the model's linears swapped for int8
ones, close to full precision on tiny checkpoints, lossless speculation through the engine, and
refused where it cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from specserve import LLM, SamplingParams
from specserve.config import QUANTIZATION_METHODS, check_quantization
from specserve.model.loader import load_model
from specserve.model.quant import Int8Linear, quantize_model
from specserve.ops import cpu_qgemm
from specserve.ops.int8 import dequantize, quantize_per_row
from specserve.sampling_params import InvalidRequestError
from tests.model.harness import PagedRunner, one_thread

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (30, 9, 17)]


def _dequantized_reference(model: nn.Module) -> nn.Module:
    """The full-precision model with every linear weight (and a tied head) replaced by its
    int8 round trip: what the int8 layers compute, up to activation rounding."""
    for child in list(model.modules()):
        if isinstance(child, nn.Linear):
            child.weight.data = dequantize(*quantize_per_row(child.weight))
    if model.lm_head is None:
        w = dequantize(*quantize_per_row(model.embed_tokens.weight))
        model.lm_head = nn.Linear(w.shape[1], w.shape[0], bias=False)
        model.lm_head.weight.data = w
    return model


@pytest.mark.parametrize("method", ["int8", "w8a8"])  # int4: tests/model/test_quant_int4.py
@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2"])
def test_quantized_model_computes_its_dequantized_weights(
    tiny_hf_dirs: dict[str, Path], family: str, method: str
) -> None:
    path = str(tiny_hf_dirs[family])
    full = load_model(path, torch.float32, CPU, progress=False)
    ref = _dequantized_reference(load_model(path, torch.float32, CPU, progress=False).model)
    m = quantize_model(load_model(path, torch.float32, CPU, progress=False).model, method)
    assert not any(isinstance(mod, nn.Linear) for mod in m.modules())
    assert isinstance(m.lm_head, Int8Linear)  # tied too: its own int8 copy of the embedding
    assert m.embed_tokens.weight.dtype == torch.float32  # the lookup stays full precision
    if full.config.attention_bias:
        assert m.layers[0].self_attn.qkv_proj.bias is not None
    batch = list(enumerate(_prompts(full.config.vocab_size)))

    def logits(model: nn.Module) -> torch.Tensor:
        return PagedRunner(model, full.config).logits(batch)

    got, want, orig = logits(m), logits(ref), logits(full.model)
    assert got.dtype == torch.float32 and got.shape == want.shape

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())

    # int8: bf16 rounding of the GEMM inputs and outputs (measured <= 0.024 here); w8a8: int8
    # activations too (<= 0.075). A wrong scale or a transposed weight gives ~1.
    assert rel(got, want) < (0.05 if method == "int8" else 0.15)
    assert rel(got, orig) < 0.25  # the weights' own rounding on top (measured <= 0.095)


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SPECS = [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    {"method": "draft_model", "num_speculative_tokens": 3, "model": "self"},
]


@pytest.mark.parametrize("method", QUANTIZATION_METHODS)
def test_speculation_is_lossless_on_the_quantized_model(tiny_llama_dir: Path, method: str) -> None:
    """Greedy outputs with speculation equal those of the same quantized model without it."""
    # repeated spans give the n-gram drafter something to propose
    prompts = [p * 3 for p in _prompts(49152, seed=1)]

    def run(spec: dict | None) -> tuple[list[list[int]], LLM]:
        llm = LLM(
            str(tiny_llama_dir),
            device="cpu",
            quantization=method,
            speculative_config=spec,
            progress=False,
            max_num_seqs=4,
            debug_invariants=True,
        )
        assert isinstance(llm.engine.target_model.lm_head, Int8Linear)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm

    plain, _ = run(None)
    for spec in SPECS:
        got, llm = run(spec)
        assert got == plain, spec["method"]
        if spec["method"] == "draft_model":
            # the target drafts for itself through the same layers: every draft accepted. int4
            # switches kernels above 16 rows (ops/int4.py), so a draft computed in a step of
            # another size may differ in its last bits (measured: 48 of 49 accepted)
            m = llm.get_metrics()
            assert m["spec_draft_tokens"] > 0
            if method == "int4":
                assert m["spec_accepted_tokens"] >= 0.9 * m["spec_draft_tokens"]
            else:
                assert m["spec_accepted_tokens"] == m["spec_draft_tokens"]


needs_blocks = pytest.mark.skipif(
    cpu_qgemm.kernel() is None, reason="int8 runs as integer blocks only with AVX512-VNNI"
)


@needs_blocks
@pytest.mark.parametrize("shape", [(1024, 576), (64, 1536)])
def test_int8_rows_do_not_depend_on_the_rows_beside_them(shape: tuple[int, int]) -> None:
    """With the integer-block kernel a row's outputs are the same bits at any row count (one
    kernel, exact integer sums), and within fp32 rounding of the dequantized weights. (torch's
    int8 kernels move a few outputs of the first shape past 8 rows.)"""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(shape, generator=g), torch.randn(shape[0], generator=g)
    lin = Int8Linear(w, b, "int8")
    assert "integer blocks" in lin.extra_repr()
    x = torch.randn(40, shape[1], generator=g)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(len(x))])
    for rows in (2, 7, 9, 16, 40):
        assert torch.equal(lin(x[:rows]), alone[:rows]), rows
    want = x.double() @ dequantize(*quantize_per_row(w)).double().T + b.double()
    assert (
        float(((alone - want).abs().max(dim=1).values / want.abs().max(dim=1).values).max()) < 1e-5
    )


@needs_blocks
def test_int8_greedy_outputs_do_not_change_on_a_prefix_cache_hit(tiny_llama_dir: Path) -> None:
    """The same greedy requests again, their prompts now cached: the tail of each prompt is
    computed in a step of a few rows instead of the whole prompt's, and answers stay the same."""
    llm = LLM(str(tiny_llama_dir), device="cpu", quantization="int8", progress=False)
    prompts = [p * 4 for p in _prompts(49152, seed=2)]  # 36-120 tokens: whole blocks to reuse
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert sum(o.metrics.num_cached_tokens for o in again) > 0
    assert [o.outputs[0].token_ids for o in again] == first


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"quantization": "awq"}, ["'awq'", "int8"]),
        ({"quantization": "int8", "tensor_parallel_size": 2}, ["tensor_parallel_size"]),
    ],
)
def test_unsupported_quantization_is_refused_before_loading(kwargs: dict, words: list[str]):
    with pytest.raises(InvalidRequestError) as e:
        LLM("dummy:tiny", device="cpu", progress=False, **kwargs)
    assert e.value.param == "quantization"
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_quantization_is_refused_on_cuda(device: str) -> None:
    with pytest.raises(InvalidRequestError, match="CPU only") as e:
        check_quantization("int8", device, 1)
    assert e.value.param == "quantization"


def test_quantization_on_auto_device_follows_the_machine() -> None:
    if torch.cuda.is_available():
        with pytest.raises(InvalidRequestError):
            check_quantization("w8a8", "auto", 1)
    else:
        check_quantization("w8a8", "auto", 1)  # auto is the CPU here
    check_quantization(None, "cuda", 4)  # unset: nothing to check
