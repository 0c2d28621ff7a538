"""The draft vocabulary: the target tokens a head may draft, and the maps vLLM and SGLang read.

A head's lm_head covers `draft_vocab_size` tokens, not the target's whole vocabulary: the
logits matmul and the head's weights shrink with it (SmolLM2's 49152 x 576 tied embedding is
113 MB in fp32; 8192 rows of it, 19 MB). The tokens kept are the most frequent ones in the
answers the head is trained on, so the mass the target puts outside the draft vocabulary is
small where it matters.

Maps, as vLLM's llama_eagle3.py and SGLang load them:
    d2t [draft_vocab] int64   target id of draft id d is d + d2t[d]
    t2d [target_vocab] bool   whether a target id is in the draft vocabulary
Draft ids are the kept target ids in increasing order, so d2t is non-decreasing and >= 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class DraftVocab:
    draft_to_target: torch.Tensor  # [Vd] int64, increasing target ids
    target_vocab_size: int

    @property
    def size(self) -> int:
        return int(self.draft_to_target.numel())

    @property
    def d2t(self) -> torch.Tensor:  # [Vd] int64 offsets: target = draft + d2t[draft]
        return self.draft_to_target - torch.arange(self.size, dtype=torch.int64)

    @property
    def t2d(self) -> torch.Tensor:  # [V] bool
        mask = torch.zeros(self.target_vocab_size, dtype=torch.bool)
        mask[self.draft_to_target] = True
        return mask

    @classmethod
    def from_maps(cls, d2t: torch.Tensor, target_vocab_size: int) -> DraftVocab:
        ids = d2t.to(torch.int64).cpu() + torch.arange(d2t.numel(), dtype=torch.int64)
        return cls(ids, target_vocab_size)


def build_draft_vocab(
    sequences: Iterable[Sequence[int]],
    draft_vocab_size: int,
    target_vocab_size: int,
    always: Sequence[int] = (),
) -> DraftVocab:
    """The `draft_vocab_size` most frequent ids of `sequences`, plus the `always` ids (EOS).

    Ties break toward the smaller id, so the same data gives the same vocabulary. When the data
    holds fewer distinct ids than asked, the smallest unused ids fill the rest: the head keeps
    the size it was configured with (its checkpoint shape does not depend on the data).
    """
    if not 1 <= draft_vocab_size <= target_vocab_size:
        raise ValueError(
            f"draft vocabulary size {draft_vocab_size} must be in [1, {target_vocab_size}]"
        )
    counts: Counter[int] = Counter()
    for seq in sequences:
        counts.update(int(t) for t in seq)
    bad = [t for t in list(counts) + list(always) if not 0 <= t < target_vocab_size]
    if bad:
        raise ValueError(
            f"token id {bad[0]} is outside the target vocabulary of {target_vocab_size}"
        )
    chosen: list[int] = list(dict.fromkeys(int(t) for t in always))[:draft_vocab_size]
    taken = set(chosen)
    for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) == draft_vocab_size:
            break
        if tok not in taken:
            chosen.append(tok)
            taken.add(tok)
    fill = 0
    while len(chosen) < draft_vocab_size:
        if fill not in taken:
            chosen.append(fill)
            taken.add(fill)
        fill += 1
    return DraftVocab(torch.tensor(sorted(chosen), dtype=torch.int64), target_vocab_size)


def coverage(vocab: DraftVocab, sequences: Iterable[Sequence[int]]) -> float:
    """Share of the tokens of `sequences` that the draft vocabulary holds."""
    mask = vocab.t2d
    total = hit = 0
    for seq in sequences:
        if len(seq):
            ids = torch.as_tensor(list(seq), dtype=torch.int64)
            total += ids.numel()
            hit += int(mask[ids].sum())
    return hit / total if total else 0.0
