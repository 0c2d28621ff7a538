"""Host-side launch choices of the Triton attention (no GPU, no triton import needed): the tile
config and the split count are pure functions of shapes, so a CUDA graph replays what it
captured."""

import torch

from specserve.ops.triton_attention import (
    MAX_SPLITS,
    choose_num_splits,
    choose_tile_config,
    grid_is_wide,
)

CPU = torch.device("cpu")  # off CUDA the heuristics assume an H200's 132 SMs


def test_decode_tile_depends_on_whether_the_grid_fills_the_gpu() -> None:
    # 8B heads: 32 query heads over 8 KV heads, one row per request
    narrow = choose_tile_config(1, 4, 128)
    wide = choose_tile_config(1, 4, 128, wide_grid=True)
    assert (narrow.block_m, narrow.block_n, narrow.num_warps) == (16, 128, 4)
    assert (wide.block_m, wide.block_n, wide.num_warps) == (16, 64, 2)
    # batch 16 x 8 KV heads splits its keys; batch 64 x 8 does not and takes the wide tile
    assert not grid_is_wide(16 * 8, CPU) and grid_is_wide(64 * 8, CPU)
    assert choose_num_splits(16 * 8, 4096, CPU) > 1
    assert choose_num_splits(64 * 8, 4096, CPU) == 1


def test_verify_and_prefill_tiles_ignore_the_grid_width() -> None:
    for rows in (5, 64, 512):  # a verify step of 1 + 4 rows, prefill chunks
        assert choose_tile_config(rows, 4, 128) == choose_tile_config(rows, 4, 128, wide_grid=True)


def test_split_count_is_bounded_by_occupancy_length_and_the_maximum() -> None:
    assert choose_num_splits(8, 4096, CPU) == MAX_SPLITS  # batch 1, long bound
    assert choose_num_splits(8, 300, CPU) == 2  # 300 keys: at most one split per 128 keys
    assert choose_num_splits(8, 100, CPU) == 1
    assert choose_num_splits(200, 4096, CPU) == 2  # 264 programs wanted, 200 there
