"""CPU linear layers on oneDNN over packed weights (specserve.model.cpu_linear): the same
products as F.linear, every dense linear of a loaded model swapped (a tied head too), and the
engines that must keep their own layers (quantization, the switch off) keep them."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specserve import LLM, SamplingParams, env
from specserve.model.cpu_linear import PackedLinear, pack_linears, packing_available
from specserve.model.loader import load_model
from specserve.model.quant import Int8Linear
from specserve.ops import cpu_gemm, cpu_qgemm
from tests.model.harness import PagedRunner, pack_as_blocks, round_to_blocks

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    not packing_available(torch.float32), reason="torch built without oneDNN"
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1)).max())


@pytest.fixture(params=["panels", "onednn"])
def path(request, monkeypatch) -> str:
    """fp32 layers take the compiled panel GEMM; without it (no compiler), oneDNN."""
    if request.param == "panels" and cpu_gemm.kernel() is None:
        pytest.skip("no C++ compiler")
    if request.param == "onednn":
        monkeypatch.setattr(cpu_gemm, "kernel", lambda: None)
    return request.param


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 5, 64])
def test_packed_linear_computes_f_linear(rows: int, bias: bool, path: str) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(99, 40, generator=g)  # 99: a partial last panel
    b = torch.randn(99, generator=g) if bias else None
    x = torch.randn(rows, 40, generator=g)
    layer = PackedLinear(w, b)
    assert (layer.lib is not None) == (path == "panels")
    got, want = layer(x), F.linear(x, w, b)
    assert got.shape == (rows, 99) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # leading dims and a transposed (non-contiguous) input
    x3 = torch.randn(2, 3, 40, generator=g)
    torch.testing.assert_close(layer(x3), F.linear(x3, w, b), rtol=1e-5, atol=1e-5)
    xt = torch.randn(40, 7, generator=g).t()
    torch.testing.assert_close(layer(xt), F.linear(xt, w, b), rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.weight, w)  # the dense copy reads back exactly


@pytest.mark.skipif(cpu_gemm.kernel() is None, reason="no C++ compiler")
def test_a_rows_result_does_not_depend_on_the_rows_beside_it() -> None:
    """The panel GEMM sums each output over k in order whatever M is: bit-equal rows."""
    g = torch.Generator().manual_seed(5)
    layer = PackedLinear(torch.randn(200, 96, generator=g), torch.randn(200, generator=g))
    x = torch.randn(23, 96, generator=g)
    full = layer(x)
    for m in (1, 2, 5, 6, 7, 13):
        assert torch.equal(layer(x[:m]), full[:m])
        assert torch.equal(layer(x[m : m + 1])[0], full[m])


@pytest.mark.skipif(cpu_gemm.kernel() is None, reason="no C++ compiler")
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 64])
def test_bf16_values_read_as_bf16_panels_give_the_fp32_panels_result(rows: int) -> None:
    """An fp32 weight whose values are all bf16 (a bf16 checkpoint) is kept in bf16 panels: half
    the bytes, the same FMA chain: bit for bit the fp32 panels' result. Any other weight keeps
    fp32 panels."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(99, 40, generator=g).to(torch.bfloat16).float()  # 99: a partial panel
    b = torch.randn(99, generator=g)
    x = torch.randn(rows, 40, generator=g)
    layer = PackedLinear(w, b)
    assert layer.panels.dtype == torch.bfloat16
    fp32 = cpu_gemm.gemm(layer.lib, x, cpu_gemm.to_panels(w), b, 99)
    assert torch.equal(layer(x), fp32)
    torch.testing.assert_close(fp32, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.weight, w)
    w[3, 7] += 1e-3  # one value off the bf16 grid
    assert PackedLinear(w, b).panels.dtype == torch.float32


@pytest.mark.skipif(not packing_available(torch.bfloat16), reason="no native bf16 in oneDNN")
def test_packed_linear_in_bfloat16() -> None:
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(128, 64, generator=g), torch.randn(9, 64, generator=g)
    got = PackedLinear(w.bfloat16(), None)(x.bfloat16())
    assert got.dtype == torch.bfloat16
    assert _rel(got, F.linear(x, w)) < 0.02  # bf16 rounding of inputs and output


@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2"])
def test_a_packed_model_computes_the_dense_one(
    tiny_hf_dirs: dict[str, Path], family: str, path: str
) -> None:
    loaded = load_model(str(tiny_hf_dirs[family]), torch.float32, CPU, progress=False)
    dense = copy.deepcopy(loaded.model)
    packed = pack_linears(loaded.model)
    assert not any(type(m) is nn.Linear for m in packed.modules())
    assert isinstance(packed.lm_head, PackedLinear)  # tied too: a packed copy of the embedding
    assert packed.embed_tokens.weight.dtype == torch.float32  # the lookup keeps dense rows
    # fp32 accumulation in another order: ~1e-6 relative; a transposed or wrong weight gives ~1
    assert _rel(*_logits(loaded.config, packed, dense)) < 1e-4


def _logits(config, *models: nn.Module) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    batch = [
        (i, torch.randint(3, config.vocab_size, (n,), generator=g).tolist())
        for i, n in enumerate((30, 9, 17))
    ]
    return [PagedRunner(m, config).logits(batch) for m in models]


def test_the_switch_keeps_f_linear(tiny_llama_dir: Path) -> None:
    model = load_model(str(tiny_llama_dir), torch.float32, CPU, progress=False).model
    with env.override(cpu_linear="torch"):
        pack_linears(model)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_engines_pack_their_target_and_draft_model_and_quantization_keeps_its_layers(
    tiny_llama_dir: Path,
) -> None:
    prompts = [[5, 9, 300, 41, 7] * 3, [11, 12, 13]]
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": "dummy:tiny"}
    llm = LLM(str(tiny_llama_dir), device="cpu", progress=False, speculative_config=spec)
    assert isinstance(llm.engine.target_model.lm_head, PackedLinear)
    draft = llm.engine.drafter.runner.model
    assert any(isinstance(m, PackedLinear) for m in draft.modules())
    with env.override(cpu_linear="torch"):
        ref = LLM(str(tiny_llama_dir), device="cpu", progress=False)
    assert not any(isinstance(m, PackedLinear) for m in ref.engine.target_model.modules())
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want  # random tiny weights: no near-ties at this precision
    q = LLM(str(tiny_llama_dir), device="cpu", progress=False, quantization="int8")
    mods = list(q.engine.target_model.modules())
    assert any(isinstance(m, Int8Linear) for m in mods)
    assert not any(isinstance(m, PackedLinear) for m in mods)


blocks_kernel = pytest.mark.skipif(
    cpu_qgemm.kernel() is None, reason="no compiler, or no AVX512-VNNI (blocks stay panels)"
)


@blocks_kernel
@pytest.mark.parametrize("rows", [0, 1, 5, 64])
def test_integer_blocks_compute_their_weights(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(0, 16, (48, 96), generator=g)
    d, m = torch.rand(48, 3, generator=g) * 0.05, -torch.rand(48, 3, generator=g) * 0.3
    w = d.repeat_interleave(32, 1) * q + m.repeat_interleave(32, 1)
    b = torch.randn(48, generator=g)
    layer = PackedLinear(w, b, (q, d, m))
    assert layer.qlib is not None and layer.panels.dtype == torch.uint8
    assert layer.panels.numel() == w.numel() * 11 // 8  # a byte a weight, 3 words a block row
    x = torch.randn(rows, 96, generator=g)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.weight, w)
    assert "integer blocks" in repr(layer)


@blocks_kernel
@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2"])
def test_a_model_packed_as_blocks_computes_the_dense_one(
    tiny_hf_dirs: dict[str, Path], family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = load_model(str(tiny_hf_dirs[family]), torch.float32, CPU, progress=False)
    dense = copy.deepcopy(loaded.model)
    round_to_blocks(dense)  # the same values, kept in nn.Linear
    packed = pack_as_blocks(loaded.model, monkeypatch)
    linears = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.qlib is not None for m in linears)
    assert isinstance(packed.lm_head, PackedLinear) and packed.lm_head.qlib is not None
    # fp32-grade; a wrong tile layout or shard order gives ~1
    assert _rel(*_logits(loaded.config, packed, dense)) < 1e-4


@blocks_kernel
def test_only_whole_blocks_of_every_shard_become_blocks(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(str(tiny_llama_dir), torch.float32, CPU, progress=False).model
    source = {}
    monkeypatch.setattr("specserve.model.cpu_linear.gguf_blocks", lambda *a: source)
    pack_linears(model, Path("none.gguf"))  # a file without blocks: panels everywhere
    assert all(m.qlib is None for m in model.modules() if isinstance(m, PackedLinear))
    # one shard of a fused projection without blocks: that layer keeps its panels
    model = load_model(str(tiny_llama_dir), torch.float32, CPU, progress=False).model
    w = model.layers[0].self_attn.qkv_proj.weight
    q, d = torch.zeros(w.shape[0] // 2, w.shape[1], dtype=torch.int8), torch.ones(1)
    source["layers.0.self_attn.qkv_proj"] = [(q, d, d), None]
    pack_linears(model, Path("part.gguf"))
    assert model.layers[0].self_attn.qkv_proj.qlib is None
    with env.override(cpu_linear="panels"):
        assert not cpu_linear_source(model)


def cpu_linear_source(model) -> dict:
    from specserve.model.cpu_linear import _block_source

    return _block_source(model, Path("any.gguf"))


@blocks_kernel
def test_the_default_models_q4_1_and_q8_0_tensors_become_blocks(default_gguf_path: Path) -> None:
    """All 210 decoder linears (Q4_1) and the tied head (the Q8_0 embedding) of the real model
    land on their modules (q/k rows unpermuted, shards in order) as integer blocks."""
    loaded = load_model(str(default_gguf_path), torch.float32, CPU, progress=False)
    model = loaded.model
    dense = {n: m.weight.clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    embed = model.embed_tokens.weight.clone()
    pack_linears(model, default_gguf_path)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert len(linears) == 4 * loaded.config.num_hidden_layers + 1
    assert all(m.qlib is not None for m in linears.values())
    for name, w in dense.items():  # the blocks' d q + m: the loader's fp32 weights
        assert (linears[name].weight - w).abs().max() <= 1e-6 * w.abs().max(), name
    assert torch.equal(model.lm_head.weight, embed)  # Q8_0: d q exactly
