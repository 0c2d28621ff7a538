"""Sliding-window attention on CUDA: the Triton kernel against the torch reference, and tiny
sliding-window checkpoints (tests/model/sliding.py) against transformers through the Triton
path, CUDA graphs, chunked prefill and speculation.

Windows from 1 key to more than the context, decode / verify / prefill rows (prefill chunks
longer than the window, so a tile's rows see different key ranges), forced split counts and
tile shapes. Keys older than every row's window are NaN in the cache (make_case poisons them),
so a kernel that loads one fails visibly: such blocks may have been freed and reused.

    pytest -m gpu tests/gpu/test_sliding_window.py
    TRITON_INTERPRET=1 pytest -m gpu tests/gpu/test_sliding_window.py   # CPU, slowly
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.model.loader import default_tokenizer, load_model
from specserve.ops import triton_attention
from specserve.ops.triton_attention import TileConfig, key_bound
from tests.gpu.conftest import interpreting
from tests.gpu.test_triton_attention import DTYPES, check_attention, make_case
from tests.model import sliding


def _cases() -> dict[str, tuple[list[int], list[int], dict]]:
    small = interpreting()
    big = 300 if small else 3000
    return {
        "decode": ([1] * 6, [1, 5, 64, 129, big, big - 7], {"hkv": 2}),
        "verify": ([4, 2, 5, 1], [9, 100, big, 3], {"hkv": 2, "group": 4}),
        "prefill_long_chunk": ([big // 2, 70], [big // 2, 300], {"hkv": 1, "group": 8}),
        "mixed_bs8_d64": (
            [1, 40, 3, 1, 17],
            [200, 40, 77, 2, 150],
            {"hkv": 2, "group": 3, "head_dim": 64, "block_size": 8, "pad_rows": 3},
        ),
    }


CASES = _cases()
WINDOWS = [1, 16, 100, 4096]  # 4096: wider than every context, the same as full attention


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("name", list(CASES))
def test_sliding_window_matches_reference(cuda, name, window, dtype):
    q_lens, c_lens, kw = CASES[name]
    case = make_case(cuda, dtype, q_lens, c_lens, window=window, **kw)
    check_attention(case, dtype, window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [3, 8])
@pytest.mark.parametrize("window", [5, 700])
def test_sliding_window_with_split_kv(cuda, dtype, splits, window):
    """The window's key range cut across splits; only splits holding keys run, and the tile
    counters are back at zero after the merge."""
    q_lens, c_lens = [1, 1, 5, 9, 40], [1, 900, 5, 650, 400]
    case = make_case(
        cuda, dtype, q_lens, c_lens, hkv=2, group=4, pad_rows=2, seed=splits, window=window
    )
    check_attention(case, dtype, window=window, num_splits=splits)
    for counters in triton_attention._counters.get(case.q.device, []):
        assert not counters.any(), counters.nonzero()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [37])
def test_sliding_window_decode_tile_on_long_rows(cuda, dtype, window):
    # the decode tile (4 rows x 4 heads) forced on long requests: each tile's rows see
    # overlapping, shifted windows (the masked head and tail of the key walk)
    q_lens, c_lens = [1, 3, 9, 40], [300, 5, 650, 400]
    case = make_case(cuda, dtype, q_lens, c_lens, hkv=2, group=4, pad_rows=3, window=window)
    block_n = 128 if dtype == torch.bfloat16 else 64
    cfg = TileConfig(block_q=4, block_m=16, block_n=block_n, num_warps=4, num_stages=2)
    check_attention(case, dtype, window=window, num_splits=2, config=cfg)


def test_window_bounds_the_keys_a_tile_reads() -> None:
    """The split count of a windowed layer follows the keys one tile can see (window +
    block_q - 1), not the context bound: a pure function of shapes, so graph-safe."""
    assert key_bound(32768, 0, 1) == 32768
    assert key_bound(32768, 4096, 1) == 4096
    assert key_bound(32768, 4096, 8) == 4103
    assert key_bound(100, 4096, 8) == 100


# -- whole models vs transformers ------------------------------------------------------------


@pytest.fixture(scope="module")
def sw_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    # Not the conftest fixture: that one needs the default GGUF (a download); this honours
    # $SPECSERVE_TOKENIZER, as the device machine (no network) sets it.
    return sliding.save_dirs(tmp_path_factory.mktemp("tiny_sliding_gpu"), default_tokenizer())


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(sliding.FAMILIES))
def test_model_logits_match_hf_on_cuda(cuda, sw_dirs, family):
    """Every row's logits through the Triton kernels (fp32: true fp32 products) vs HF on CPU."""
    if cuda.type != "cuda":
        pytest.skip("the CPU run of these checks is tests/model/test_sliding_window.py")
    path = sw_dirs[family]
    ours = load_model(str(path), torch.float32, cuda, progress=False)
    ref = sliding.hf_reference(sliding.load_hf(path), ours.config.vocab_size)
    for chunk in (None, 3, 11):
        sliding.check_logits(ours.model, ours.config, ref, chunk, cuda, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
# Qwen3's layer_types differ from Qwen2's only in parsing (CPU tests); the kernels are the same
@pytest.mark.parametrize("family", ["mistral_w4", "qwen2_w16_mixed"])
def test_engine_on_cuda_matches_hf(cuda, sw_dirs, family):
    """The CUDA engine (graphs for decode/verify, chunked prefill, n-gram and draft-model
    speculation, overlap with the device drafter) emits HF's greedy tokens."""
    if cuda.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    path = sw_dirs[family]
    hf = sliding.load_hf(path)
    graphs = sliding.check_engine_greedy(
        family, path, hf, hf.config.vocab_size, device="cuda", block_size=8,
        max_num_seqs=8, max_model_len=256, kv_cache_memory_gb=0.25,
    )  # fmt: skip
    assert all(g is not None and g.num_replays > 0 for g in graphs)
    assert graphs[2].num_verify_replays > 0  # the draft model verifies through the graphs
