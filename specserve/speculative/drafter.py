"""The drafter interface and its construction from the speculative config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from specserve.config import SpeculativeConfig
from specserve.engine.sequence import Sequence

if TYPE_CHECKING:
    from specserve.llm_engine import LLMEngine


class Drafter(Protocol):
    has_q: bool  # stores a draft distribution per draft (else q is one-hot)

    def propose(
        self, seqs: list[Sequence], limits: list[int]
    ) -> list[tuple[list[int], list[float]]]:
        """Up to limits[i] drafts for each request, with a confidence per draft (limits[i] = 0:
        none, and no work done for it). Drafters with q write it into the slot pool rows of
        each request's slot."""
        ...

    def observe(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """Verification outcome of the drafts a request just verified."""
        ...

    def release(self, seq: Sequence) -> None: ...

    def plan_confidences(self, seq: Sequence, k: int) -> list[float] | None:
        """The confidences of a request's next k drafts, known before drafting them (n-gram:
        its acceptance estimate; golden: the dialled rate), for the verify budget's plan; None
        for a drafter whose confidences come with its drafts (a model's probabilities): the
        plan then uses those of its most recent drafts (speculator.py)."""
        ...


class DraftKVMarks:
    """Per request, which positions of a model drafter's own KV are valid: those before `done`
    hold the request's tokens, those from `done` on the drafts `fed` there, valid as far as they
    equal the tokens the request has since committed (an accepted draft's KV is kept, a
    rejected one's is rewritten). Read against the tokens, never told the outcome: a request
    that skipped drafting, or whose drafts the step verified only in part, is right by
    construction. And the preemption count they were computed under (a preemption frees the
    blocks they lived in)."""

    def __init__(self) -> None:
        self._marks: dict[str, tuple[int, list[int], int]] = {}

    def valid(self, seq: Sequence) -> int:
        mark = self._marks.get(seq.request_id)
        if mark is None or mark[2] != seq.num_preemptions:
            return 0
        done, fed, _ = mark
        tokens = seq.token_ids
        for t in fed:
            if done >= len(tokens) or tokens[done] != t:
                break
            done += 1
        return done

    def set(self, seq: Sequence, done: int, fed: list[int] | None = None) -> None:
        self._marks[seq.request_id] = (done, fed or [], seq.num_preemptions)

    def release(self, seq: Sequence) -> None:
        self._marks.pop(seq.request_id, None)


def reserve_draft_blocks(
    engine: LLMEngine, seqs: list[Sequence], limits: list[int], min_tokens: int = 1
) -> list[int]:
    """Before a model drafter writes its own KV for k drafts (up to position num_tokens + k - 2,
    plus one row of slack), make sure the blocks exist: k shrinks to what the pool can give.
    limits is updated in place; returns the indices that draft at all."""
    bm = engine.block_manager
    active: list[int] = []
    for i, (seq, k) in enumerate(zip(seqs, limits)):
        if k <= 0 or seq.num_tokens < min_tokens:
            limits[i] = 0
            continue
        while k > 0 and not bm.can_allocate(seq.block_table, seq.num_tokens + k - 1):
            k -= 1
        limits[i] = k
        if k > 0:
            bm.allocate(seq.block_table, seq.num_tokens + k - 1)
            active.append(i)
    return active


def build_drafter(spec: SpeculativeConfig, engine: LLMEngine) -> Drafter:
    if spec.method == "golden":
        from specserve.speculative.golden import GoldenDrafter

        return GoldenDrafter(
            spec.acceptance_rate, engine.model_config.vocab_size, engine.config.seed
        )
    if spec.method == "ngram":
        from specserve.speculative.ngram import NgramDrafter

        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "eagle3":
        from specserve.speculative.eagle3 import Eagle3Drafter

        return Eagle3Drafter(spec, engine)
    from specserve.speculative.draft_model import DraftModelDrafter

    return DraftModelDrafter(spec, engine)
