"""The decoder layers in one compiled call (specserve.model.cpu_stack): the per-op path's
logits bit for bit on prefill, verify, decode and padding rows (fp32 and bf16 caches, biases,
sliding windows, hidden-state capture), and the per-op path wherever the call does not apply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from specserve import LLM, SamplingParams, env
from specserve.model import cpu_stack
from specserve.model.aux_capture import AuxCapture
from specserve.model.cpu_linear import pack_linears
from specserve.model.loader import load_model
from specserve.model.quant import Int8Linear
from specserve.ops import cpu_layer, cpu_qgemm
from tests.model import sliding
from tests.model.harness import PagedRunner, pack_as_blocks

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(cpu_layer.kernels() is None, reason="no C++ compiler")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every compiled stack call."""
    seen: list[int] = []
    run = cpu_layer.run_stack

    def counted(*args: Any, **kwargs: Any) -> Any:
        seen.append(args[3].shape[0])
        return run(*args, **kwargs)

    monkeypatch.setattr(cpu_layer, "run_stack", counted)
    return seen


def _packed(path: Path) -> Any:
    loaded = load_model(str(path), torch.float32, CPU, progress=False)
    pack_linears(loaded.model)
    return loaded


def _steps(vocab: int) -> list[tuple[list[tuple[int, list[int]]], int]]:
    """(batch, padding rows) per forward: chunked prefill beside a decode row, a verify-shaped
    step (4 rows a request), one-row decode, and a step with padding rows."""
    g = torch.Generator().manual_seed(3)

    def toks(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    return [
        ([(0, toks(40)), (1, toks(9))], 0),
        ([(0, toks(1)), (1, toks(23)), (2, toks(5))], 0),
        ([(0, toks(4)), (1, toks(4)), (2, toks(4))], 0),
        ([(0, toks(1)), (1, toks(1)), (2, toks(1))], 0),
        ([(0, toks(1)), (2, toks(3))], 3),
        ([(1, toks(1))], 0),
    ]


def _run(loaded: Any, kv_dtype: torch.dtype, mode: str) -> list[torch.Tensor]:
    runner = PagedRunner(loaded.model, loaded.config, dtype=kv_dtype)  # same block order
    with env.override(cpu_layer=mode):
        return [runner.logits(b, pad) for b, pad in _steps(loaded.config.vocab_size)]


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"forward {i}: max diff {float((a - b).abs().max()):.3g}"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2", "mistral"])
def test_the_stack_gives_the_per_op_logits_bit_for_bit(
    tiny_hf_dirs: dict[str, Path],
    family: str,
    kv_dtype: torch.dtype,
    threads: int,
    calls: list[int],
) -> None:
    loaded = _packed(tiny_hf_dirs[family])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = _run(loaded, kv_dtype, "off")
        assert not calls
        got = _run(loaded, kv_dtype, "auto")
    finally:
        torch.set_num_threads(before)
    assert calls == [49, 29, 12, 3, 7, 1]  # every forward, padding rows included
    _assert_same(got, want)


def test_layers_of_bf16_values_run_bf16_panels_in_the_stack(
    tiny_hf_dirs: dict[str, Path], calls: list[int]
) -> None:
    """A model whose weights are bf16 values (a bf16 checkpoint run in fp32) packs bf16 panels;
    the stack calls the bf16 GEMM for them, the per-op path's logits bit for bit."""
    loaded = load_model(str(tiny_hf_dirs["llama"]), torch.float32, CPU, progress=False)
    with torch.no_grad():
        for name, p in loaded.model.named_parameters():
            if name.endswith("proj.weight") and "layers.0." not in name:  # layer 0 stays fp32
                p.copy_(p.to(torch.bfloat16))
    pack_linears(loaded.model)
    kinds = {layer.mlp.down_proj.panels.dtype for layer in loaded.model.layers}
    assert kinds == {torch.float32, torch.bfloat16}
    want = _run(loaded, torch.float32, "off")
    got = _run(loaded, torch.float32, "auto")
    assert calls
    _assert_same(got, want)


@pytest.mark.skipif(cpu_qgemm.kernel() is None, reason="no AVX512-VNNI: blocks stay panels")
@pytest.mark.parametrize("threads", [1, 2])
def test_layers_of_integer_blocks_run_the_block_gemm_in_the_stack(
    tiny_hf_dirs: dict[str, Path], threads: int, calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF-style model (integer blocks, a tied head) in the stack: the per-op logits bit for
    bit, the block GEMM's rows as independent there as in the per-op path."""
    loaded = load_model(str(tiny_hf_dirs["llama_tied"]), torch.float32, CPU, progress=False)
    pack_as_blocks(loaded.model, monkeypatch)
    assert loaded.model.layers[0].mlp.down_proj.panels.dtype == torch.uint8
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = _run(loaded, torch.float32, "off")
        got = _run(loaded, torch.float32, "auto")
    finally:
        torch.set_num_threads(before)
    assert calls
    _assert_same(got, want)


@pytest.fixture(scope="module")
def sw_dirs(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any) -> dict[str, Path]:
    return sliding.save_dirs(tmp_path_factory.mktemp("tiny_sliding_stack"), default_tokenizer)


@pytest.mark.parametrize("family", ["mistral_w4", "qwen2_w16_mixed"])
def test_sliding_windows_per_layer(sw_dirs: dict[str, Path], family: str, calls: list[int]) -> None:
    loaded = _packed(sw_dirs[family])
    want = _run(loaded, torch.float32, "off")
    got = _run(loaded, torch.float32, "auto")
    assert calls
    _assert_same(got, want)


def test_the_capture_of_layer_inputs_is_the_per_op_one(
    tiny_hf_dirs: dict[str, Path], calls: list[int]
) -> None:
    loaded = _packed(tiny_hf_dirs["llama"])
    cfg = loaded.config
    layers = tuple(sorted({0, cfg.num_hidden_layers // 2, cfg.num_hidden_layers - 1}))
    rows = {}
    for mode in ("off", "auto"):
        cap = AuxCapture(layers, cfg.hidden_size, 64, torch.float32, CPU)
        cap.rows.fill_(float("nan"))
        loaded.model.aux_capture = cap
        seen = []
        runner = PagedRunner(loaded.model, cfg)
        with env.override(cpu_layer=mode):
            for batch, pad in _steps(cfg.vocab_size):
                runner.logits(batch, pad)
                seen.append(cap.rows[: cap.num_rows].clone())
        rows[mode] = seen
    assert calls
    _assert_same(rows["auto"], rows["off"])
    assert not any(r.isnan().any() for r in rows["auto"])


def _uses_stack(loaded: Any, calls: list[int], mode: str = "auto") -> bool:
    calls.clear()
    runner = PagedRunner(loaded.model, loaded.config)
    with env.override(cpu_layer=mode):
        runner.logits([(0, [5, 6, 7])])
    return bool(calls)


def test_where_it_does_not_apply_the_per_op_path_runs(
    tiny_hf_dirs: dict[str, Path], calls: list[int]
) -> None:
    loaded = _packed(tiny_hf_dirs["llama"])
    assert _uses_stack(loaded, calls)
    assert not _uses_stack(loaded, calls, mode="off")
    with env.override(fused_ops=False):
        assert not _uses_stack(loaded, calls)
    with env.override(cpu_attention="torch"):
        assert not _uses_stack(loaded, calls)
    # per-head q/k norms (Qwen3) run torch's rms_norm between the kernels
    assert not _uses_stack(_packed(tiny_hf_dirs["qwen3"]), calls)
    # dense layers (SPECSERVE_CPU_LINEAR=torch), bf16
    dense = load_model(str(tiny_hf_dirs["llama"]), torch.float32, CPU, progress=False)
    assert not _uses_stack(dense, calls)
    bf16 = load_model(str(tiny_hf_dirs["llama"]), torch.bfloat16, CPU, progress=False)
    pack_linears(bf16.model)
    assert not _uses_stack(bf16, calls)


def test_layers_swapped_after_a_forward_are_noticed(
    tiny_hf_dirs: dict[str, Path], calls: list[int]
) -> None:
    """As LLM quantizing an engine's layers after its start-up forwards: the stack would
    otherwise run the old weights."""
    loaded = _packed(tiny_hf_dirs["llama"])
    assert _uses_stack(loaded, calls)
    ref = _packed(tiny_hf_dirs["llama"])
    mlp = loaded.model.layers[-1].mlp
    mlp.down_proj = Int8Linear(mlp.down_proj.weight, None, "int8")
    assert not _uses_stack(loaded, calls)
    assert _uses_stack(ref, calls)


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_an_engine_decodes_the_same_tokens_with_speculation(
    tiny_llama_dir: Path, calls: list[int]
) -> None:
    prompts = [[5, 9, 300, 41, 7] * 3, [11, 12, 13]]
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": "dummy:tiny"}
    llm = LLM(str(tiny_llama_dir), device="cpu", progress=False, speculative_config=spec)
    out = {}
    for mode in ("off", "auto"):
        calls.clear()
        with env.override(cpu_layer=mode):
            res = llm.generate(prompts, GREEDY, use_tqdm=False)
        out[mode] = [o.outputs[0].token_ids for o in res]
        assert bool(calls) == (mode == "auto")
    assert out["auto"] == out["off"]
    assert cpu_stack.stack_for  # the module the engine's target and draft go through
