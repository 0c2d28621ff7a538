"""The draft vocabulary: most frequent answer tokens, and d2t / t2d as vLLM and SGLang read
them (target id = draft id + d2t[draft id]; t2d marks exactly the draft vocabulary)."""

from __future__ import annotations

import pytest
import torch

from specserve.train.vocab import DraftVocab, build_draft_vocab, coverage


def test_most_frequent_tokens_ties_to_smaller_ids_and_forced_ids() -> None:
    seqs = [[7, 7, 7, 3, 3, 9, 9, 5], [5, 1]]  # counts: 7:3, 3:2, 9:2, 5:2, 1:1
    v = build_draft_vocab(seqs, 4, 20, always=[2])
    # 2 forced; then 7 (3x), then the 2x ties 3, 5 by id; 9 loses the tie
    assert v.draft_to_target.tolist() == [2, 3, 5, 7]


def test_maps_are_the_vllm_layout() -> None:
    v = build_draft_vocab([[10, 4, 4, 17, 10, 10]], 3, 32)
    d2t, t2d = v.d2t, v.t2d
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert (torch.arange(3) + d2t).tolist() == [4, 10, 17]
    assert t2d.nonzero().flatten().tolist() == [4, 10, 17] and t2d.shape == (32,)
    assert bool((d2t >= 0).all()) and bool((d2t[1:] >= d2t[:-1]).all())
    back = DraftVocab.from_maps(d2t, 32)
    assert torch.equal(back.draft_to_target, v.draft_to_target)


def test_fewer_distinct_tokens_than_asked_fills_with_small_unused_ids() -> None:
    v = build_draft_vocab([[5, 5, 8]], 4, 10)
    assert v.draft_to_target.tolist() == [0, 1, 5, 8]
    assert coverage(v, [[5, 8, 9]]) == pytest.approx(2 / 3)


def test_bad_sizes_and_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="draft vocabulary size"):
        build_draft_vocab([[1]], 0, 10)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        build_draft_vocab([[12]], 2, 10)
