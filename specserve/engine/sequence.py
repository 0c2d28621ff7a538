"""One request's state: tokens, the KV ledger, stopping state and metrics."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from specserve.engine.block_manager import BlockTable
from specserve.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    # a step failed because of this request's inputs (the engine isolated it; vLLM's "error")
    ERROR = "error"
    PROMPT_LENGTH_EXCEEDED = "prompt_length_exceeded"


@dataclass
class SpecStats:
    """Speculation counters of one request (only tokens actually emitted count as accepted)."""

    num_drafts: int = 0  # steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class Sequence:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # effective RNG seed (params.seed or one drawn at arrival)
    arrival_time: float = field(default_factory=time.perf_counter)
    token_ids: list[int] = field(init=False)
    status: SeqStatus = SeqStatus.WAITING
    # KV ledger: positions [0, num_computed_tokens) have valid KV. advance_optimistically() moves it
    # forward by the rows scheduled in a step; commit_processed_tokens() sets what was kept.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    block_table: BlockTable = field(default_factory=BlockTable)
    slot: int = 0  # draft slot; 0 = none (slot 0 is padding and never handed out)
    # Overlap scheduling: tokens the step in flight will append once the ledger processes it
    # (their ids live on the device meanwhile), and a counter bumped at each preemption so the
    # ledger can tell a step scheduled before the preemption from one after it.
    num_pending: int = 0
    # Device drafters under overlap: drafts the steps in flight verify. The host schedules as
    # if all were accepted (an upper bound on the tokens pending); the ledger, reading the step
    # back, takes them off again, and the device shifts the next step by the rows rejected.
    num_pending_drafts: int = 0
    epoch: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # finish_reason error: what failed, as text
    num_preemptions: int = 0
    first_token_time: float | None = None
    finished_time: float | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    detokenizer: object | None = None  # IncrementalDetokenizer, set by the engine
    # prompt_logprobs requests: runner.prompt_logprobs.PromptLogprobs, made by the model runner
    prompt_logprobs_state: object | None = None
    # structured outputs: specserve.structured.matcher.RequestGrammar, set by the engine
    grammar: object | None = None
    # the ledger's view of params (ledger.StopRules), made at its first step
    stop_rules: object | None = None
    # its sampling parameters and seed packed for the sampler's upload (runner/sampler_inputs.py)
    sampling_row: bytes | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is still to be written (pending ones included); the last one is fed as
        this step's anchor row."""
        return (
            self.num_tokens + self.num_pending + self.num_pending_drafts - self.num_computed_tokens
        )

    def advance_optimistically(self, num_rows: int) -> None:
        self.num_computed_tokens += num_rows

    def commit_processed_tokens(self, num_rows: int, num_kept_rows: int) -> None:
        """The ledger keeps num_kept_rows of the num_rows a step advanced by: roll back the rest.
        Relative, because under overlap scheduling a later step may already have advanced the
        ledger again (its rows start after all of this step's rows, as scheduled)."""
        self.num_computed_tokens -= num_rows - num_kept_rows
