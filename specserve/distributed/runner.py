"""Rank 0's model runner under tensor parallelism: each forward is replayed by every worker.

What a worker needs to run the same forward is what `prepare_rows` was given (the rows, their
positions, block tables, logit rows): a few host lists, sent down each worker's pipe as one
`StepMessage` when the forward starts (so in forward order, from whichever thread runs it; the
CPU overlap worker thread included). Each worker builds its own inputs from it, so CUDA-graph
buckets and the eager path come out the same on every rank. Tokens a step reads from the
device (overlap: `pending` rows fed by the previous step's sampled token) are broadcast from
rank 0's `next_tokens` before the forward: the host never waits for them.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from specserve.runner.cuda_graph import BucketStep, GraphBackend
from specserve.runner.model_runner import ModelRunner, StepInputs
from specserve.runner.prompt_logprobs import PromptRows

if TYPE_CHECKING:
    from specserve.distributed.launcher import TensorParallel


@dataclass
class StepMessage:
    """`prepare_rows`'s arguments, as plain host data."""

    rows: list[list[int]]
    starts: list[int]
    tables: list[list[int]]
    num_logits: list[int]
    pending: np.ndarray | None  # [T] int64 slots whose next_tokens feed the rows
    prompt: tuple[list[int], list[int], int] | None  # prompt rows, their targets, top-N

    def prompt_rows(self, device: torch.device) -> PromptRows | None:
        """A worker's PromptRows: the same lm_head calls (the logits gather needs every rank),
        no request state to hand results to."""
        if self.prompt is None:
            return None
        rows, targets, num_top = self.prompt
        return PromptRows(
            torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(targets, dtype=torch.int64, device=device),
            num_top,
            [],
        )


class TPStep(NamedTuple):
    local: StepInputs | BucketStep  # rank 0's own inputs
    message: bytes  # ("step", StepMessage), pickled when the step was prepared
    pending: bool  # the step reads next_tokens (broadcast before the forward)


class TPModelRunner(ModelRunner):
    """ModelRunner whose KV cache holds rank 0's KV heads and whose forwards run on every rank."""

    sample_tail = False

    def __init__(self, tp: TensorParallel, model: torch.nn.Module, *args: Any, **kw: Any) -> None:
        super().__init__(model, *args, **kw)
        self.tp = tp

    def init_cuda_graphs(
        self,
        max_num_seqs: int,
        max_rows_per_seq: int,
        max_model_len: int,
        capture: bool = True,
        progress: bool = True,
        backend: GraphBackend | None = None,
        drafting: None = None,  # device drafting is off under TP
        max_mixed_rows: int = 0,  # steps with prompt chunks run eager under TP
    ) -> None:
        # captures run the model (and its all-reduces) directly: every rank captures the same
        # buckets in the same order
        if backend is None:
            self.tp.send(("graphs", (max_num_seqs, max_rows_per_seq, max_model_len, capture)))
        super().init_cuda_graphs(
            max_num_seqs, max_rows_per_seq, max_model_len, capture, progress, backend
        )

    def prepare_rows(
        self,
        rows: list[list[int]],
        starts: list[int],
        tables: list[list[int]],
        num_logits: list[int],
        pending: np.ndarray | None = None,
        prompt: PromptRows | None = None,
        draft_at: np.ndarray | None = None,
        shift: np.ndarray | None = None,
    ) -> TPStep:
        # drafts are never read from a device slot pool here (device drafting is off under TP)
        assert draft_at is None and shift is None, "tensor parallelism drafts on rank 0's host"
        local = super().prepare_rows(rows, starts, tables, num_logits, pending, prompt)
        spec = None
        if prompt is not None:
            spec = (prompt.rows.tolist(), prompt.targets.tolist(), prompt.num_top)
        # pickled now: the lists are the requests' own (block tables), and under overlap the
        # ledger changes them while this step waits for its forward
        msg = StepMessage(rows, starts, tables, num_logits, pending, spec)
        blob = pickle.dumps(("step", msg), protocol=pickle.HIGHEST_PROTOCOL)
        return TPStep(local, blob, pending is not None)

    @torch.inference_mode()
    def forward(self, inputs: TPStep) -> torch.Tensor:  # [total_q, V] fp32
        assert isinstance(inputs, TPStep), "tensor-parallel steps come from prepare_rows"
        self.tp.send_bytes(inputs.message)
        if inputs.pending:
            self.tp.group.broadcast(self.next_tokens)
        return super().forward(inputs.local)


def replay_step(runner: ModelRunner, msg: StepMessage, group: Any) -> None:
    """A worker's side of one forward (its logits, gathered on every rank, are dropped)."""
    m = msg
    inputs = runner.prepare_rows(
        m.rows, m.starts, m.tables, m.num_logits, m.pending, m.prompt_rows(runner.device)
    )
    if m.pending is not None:
        group.broadcast(runner.next_tokens)
    runner.forward(inputs)
