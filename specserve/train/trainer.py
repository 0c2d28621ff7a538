"""The training loop: batches of whole sequences, the target captured on the fly, TTT losses,
AdamW with warm-up and cosine decay, resumable checkpoints and progress bars.

Batches are fixed by the seed and the epoch (a shuffled order, then length-sorted runs cut
under the batch and token limits), so a resumed run sees the batches an uninterrupted one
would: the checkpoint (`<out>/checkpoint/state.pt`) holds the head, the optimizer and
scheduler state, and where in which epoch to go on.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specserve.model.eagle3 import Eagle3Config, Eagle3Head
from specserve.train.capture import aux_layer_ids_for, capture_target
from specserve.train.data import Sample
from specserve.train.errors import TrainHeadError
from specserve.train.ttt import TTTBatch, ttt_loss
from specserve.train.vocab import DraftVocab

CHECKPOINT_FORMAT = 1
SORT_WINDOW = 16  # batches' worth of samples sorted by length together (less padding)
PROBE_STEPS = 10  # --train-seconds: steps timed (after the first, which warms up) to size the run


@dataclass
class TrainOptions:
    ttt_steps: int = 7
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps in all; None: `epochs` passes over the data
    batch_size: int = 16  # sequences per batch at most
    max_tokens_per_batch: int = 8192  # padded tokens (sequences x longest) per batch at most
    lr: float = 3e-4
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    step_decay: float = 0.8
    confidence_weight: float = 1.0
    seed: int = 0
    save_every: int = 200  # optimizer steps between checkpoints (also one at every epoch end)
    # seconds of training in all: the schedule (steps, warm-up, cosine) is sized from the speed
    # of the first PROBE_STEPS steps so that it ends in about this time (at most `epochs`)
    train_seconds: float | None = None

    # the fields a resumed run must share with the checkpoint (the rest may change)
    RESUME_FIXED = (
        "ttt_steps",
        "epochs",
        "max_steps",
        "batch_size",
        "max_tokens_per_batch",
        "lr",
        "warmup_ratio",
        "weight_decay",
        "step_decay",
        "confidence_weight",
        "seed",
        "train_seconds",
    )


def head_config(target_config: Any, draft_vocab_size: int) -> Eagle3Config:
    """An EAGLE-3 head shaped like one layer of the target (SpecForge's configs do the same)."""
    tc = target_config
    return Eagle3Config(
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.head_dim,
        vocab_size=tc.vocab_size,
        draft_vocab_size=draft_vocab_size,
        rms_norm_eps=tc.rms_norm_eps,
        rope_theta=tc.rope_theta,
        rope_scaling=tc.rope_scaling,
        max_position_embeddings=tc.max_position_embeddings,
        aux_layer_ids=aux_layer_ids_for(tc.num_hidden_layers),
    )


@torch.no_grad()
def build_head(target: torch.nn.Module, vocab: DraftVocab, seed: int) -> Eagle3Head:
    """A fresh head (fp32) on the target's device, sharing its embedding. Its final norm and
    lm_head start as the target's own (the rows of the draft vocabulary): the head then begins
    by reading its hidden state the way the target reads its last one, which saves the many
    steps a random lm_head needs to learn what tokens look like."""
    device = next(target.parameters()).device
    cfg = head_config(target.config, vocab.size)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        head = Eagle3Head(cfg, embed_tokens=target.embed_tokens).to(device)
    finally:
        torch.random.set_rng_state(gen_state)
    ids = vocab.draft_to_target.to(device)
    out_w = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
    head.lm_head.weight.copy_(out_w.index_select(0, ids).float())
    head.norm.weight.copy_(target.norm.weight.float())
    head.d2t.copy_(vocab.d2t.to(device))
    head.t2d.copy_(vocab.t2d.to(device))
    return head


def _cut(run: list[Sample], batch_size: int, max_tokens: int) -> list[list[Sample]]:
    """Consecutive samples into batches, each cut before it would pass batch_size samples or
    max_tokens padded tokens (samples x the longest)."""
    batches: list[list[Sample]] = []
    cur: list[Sample] = []
    for s in run:
        longest = max([s.num_tokens] + [c.num_tokens for c in cur])
        if cur and (len(cur) + 1 > batch_size or (len(cur) + 1) * longest > max_tokens):
            batches.append(cur)
            cur = []
        cur.append(s)
    if cur:
        batches.append(cur)
    return batches


def make_batches(
    samples: Sequence[Sample], batch_size: int, max_tokens: int, seed: int
) -> list[list[Sample]]:
    """One epoch's batches: a `seed`-shuffled order, runs of SORT_WINDOW batches sorted by
    length (similar lengths pad less), each run cut greedily under both limits."""
    order = list(samples)
    random.Random(seed).shuffle(order)
    batches: list[list[Sample]] = []
    window = max(1, batch_size * SORT_WINDOW)
    for start in range(0, len(order), window):
        run = sorted(order[start : start + window], key=lambda s: s.num_tokens)
        batches += _cut(run, batch_size, max_tokens)
    # the runs come out short-to-long; shuffle the batches so the loss curve is not sawtoothed
    random.Random(seed + 7).shuffle(batches)
    return batches


def prepare_batch(target: torch.nn.Module, head: Eagle3Head, samples: Sequence[Sample]) -> TTTBatch:
    seqs = [s.token_ids for s in samples]
    layer_ids = head.config.layer_ids(target.config.num_hidden_layers)
    rows = capture_target(target, seqs, layer_ids, head.draft_to_target())
    return TTTBatch.build(seqs, [len(s.prompt_ids) for s in samples], rows, torch.float32)


def lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch in progress
    batch: int = 0  # batches of that epoch done
    total_steps: int | None = None  # the run's length once fixed (--train-seconds sizes it)


class Trainer:
    def __init__(
        self,
        target: torch.nn.Module,
        head: Eagle3Head,
        train: Sequence[Sample],
        opts: TrainOptions,
        out_dir: Path,
        progress: bool = True,
    ) -> None:
        self.target, self.head, self.opts = target, head, opts
        self.train_samples = list(train)
        self.out_dir = out_dir
        self.progress = progress
        self.ckpt_path = out_dir / "checkpoint" / "state.pt"
        self.log_path = out_dir / "train_log.jsonl"
        self.optimizer = torch.optim.AdamW(
            [p for p in head.parameters() if p.requires_grad],
            lr=opts.lr,
            weight_decay=opts.weight_decay,
            betas=(0.9, 0.95),
        )
        self.batches_per_epoch = len(self._epoch_batches(0))
        self.state = TrainState()
        self.state.total_steps = None if opts.train_seconds else self._max_steps()
        # read at every step: a run sized by --train-seconds fixes its length after the probe
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(
                s, self.total_steps, max(1, round(opts.warmup_ratio * self.total_steps))
            ),
        )

    def _max_steps(self) -> int:
        return self.opts.max_steps or self.opts.epochs * self.batches_per_epoch

    @property
    def total_steps(self) -> int:
        """Steps of the whole run (the most the options allow until a timed run is sized)."""
        return self.state.total_steps or self._max_steps()

    def _size_by_time(self, seconds_per_step: float) -> None:
        budget = self.opts.train_seconds
        assert budget is not None
        fit = max(self.state.step + 1, int(budget / max(seconds_per_step, 1e-9)))
        self.state.total_steps = min(self._max_steps(), fit)

    def _epoch_batches(self, epoch: int) -> list[list[Sample]]:
        o = self.opts
        return make_batches(
            self.train_samples, o.batch_size, o.max_tokens_per_batch, o.seed * 1000 + epoch
        )

    # -- checkpoints --------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        self.ckpt_path.parent.mkdir(parents=True, exist_ok=True)
        blob = {
            "format": CHECKPOINT_FORMAT,
            "state": asdict(self.state),
            "options": asdict(self.opts),
            "head": self.head.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }
        tmp = self.ckpt_path.with_suffix(f".tmp{os.getpid()}")
        torch.save(blob, tmp)
        os.replace(tmp, self.ckpt_path)  # a crash mid-save keeps the previous checkpoint

    def load_checkpoint(self) -> None:
        blob = torch.load(self.ckpt_path, map_location="cpu", weights_only=True)
        if blob.get("format") != CHECKPOINT_FORMAT:
            raise TrainHeadError(f"{self.ckpt_path}: checkpoint format {blob.get('format')!r}")
        saved, now = blob["options"], asdict(self.opts)
        diff = [k for k in TrainOptions.RESUME_FIXED if saved.get(k) != now[k]]
        if diff:
            shown = ", ".join(f"{k}: checkpoint {saved.get(k)!r}, now {now[k]!r}" for k in diff)
            raise TrainHeadError(f"cannot resume {self.ckpt_path} with other settings ({shown})")
        self.head.load_state_dict(blob["head"])
        self.optimizer.load_state_dict(blob["optimizer"])
        self.scheduler.load_state_dict(blob["scheduler"])
        self.state = TrainState(**blob["state"])

    # -- the loop -----------------------------------------------------------------------
    def train_step(self, samples: Sequence[Sample]) -> dict[str, Any]:
        """One optimizer step; its record says where the step's seconds went (the target's
        capture, the unrolled head's forward, backward + update), each timed to the device's
        end of it: the stats already read the device back several times a step."""
        self.head.train()
        cuda, clock = self.head.fc.weight.is_cuda, [time.perf_counter()]

        def lap() -> None:
            if cuda:
                torch.cuda.synchronize()
            clock.append(time.perf_counter())

        batch = prepare_batch(self.target, self.head, samples)
        lap()
        res = ttt_loss(
            self.head, batch, self.opts.ttt_steps, self.opts.step_decay, self.opts.confidence_weight
        )
        lap()
        self.optimizer.zero_grad(set_to_none=True)
        res.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.opts.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        lap()
        seconds = [round(b - a, 4) for a, b in zip(clock, clock[1:])]
        return {
            "seconds": dict(zip(("capture", "head", "update"), seconds)),
            "tokens": int(batch.lens.sum()),
            "loss": float(res.loss.detach()),
            "grad_norm": float(grad_norm),
            "lr": self.scheduler.get_last_lr()[0],
            "ce": [s.ce for s in res.steps],
            "acc": [s.acc for s in res.steps],
            "bce": [s.bce for s in res.steps],
            "rows": res.steps[0].rows,
        }

    def run(self, stop_after: int | None = None, time_limit: float | None = None) -> TrainState:
        """Train to `total_steps`; `stop_after` (steps in this call) or `time_limit` (seconds)
        end the call early, with a checkpoint to resume from."""
        st = self.state
        start_step, t0 = st.step, time.monotonic()
        # --train-seconds: when the timed probe steps began, and at which step; the probe runs
        # in whichever call first trains unsized (a call may end before its probe is done)
        t_probe, probe_from = None, 0
        bar = tqdm(
            total=self.total_steps,
            initial=st.step,
            desc="training head",
            unit="step",
            disable=not self.progress,
        )
        self.out_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "a", encoding="utf-8")
        try:
            while st.step < self.total_steps:
                batches = self._epoch_batches(st.epoch)
                if st.batch >= len(batches):
                    st.epoch, st.batch = st.epoch + 1, 0
                    continue
                sizing = self.opts.train_seconds is not None and st.total_steps is None
                if sizing and t_probe is None and st.step > start_step:  # after the warm-up
                    t_probe, probe_from = time.monotonic(), st.step
                rec = self.train_step(batches[st.batch])
                st.step += 1
                if sizing and t_probe is not None and st.step - probe_from >= PROBE_STEPS:
                    self._size_by_time((time.monotonic() - t_probe) / (st.step - probe_from))
                    bar.total = self.total_steps
                st.batch += 1
                rec.update(step=st.step, epoch=st.epoch)
                log.write(json.dumps(rec) + "\n")
                log.flush()  # readable while the run goes on
                bar.update(1)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", acc0=f"{rec['acc'][0]:.2f}")
                epoch_end = st.batch >= len(batches)
                if st.step % self.opts.save_every == 0 or epoch_end:
                    self.save_checkpoint()
                done_here = st.step - start_step
                if (stop_after is not None and done_here >= stop_after) or (
                    time_limit is not None and time.monotonic() - t0 >= time_limit
                ):
                    break
            self.save_checkpoint()
        finally:
            bar.close()
            log.close()
        return st

    @property
    def finished(self) -> bool:
        return self.state.step >= self.total_steps


def run_batches(
    fn: Callable[[TTTBatch], Any],
    target: torch.nn.Module,
    head: Eagle3Head,
    samples: Sequence[Sample],
    batch_size: int,
    max_tokens: int,
    desc: str,
    progress: bool,
) -> list[Any]:
    """`fn` over batches of `samples` in their order (evaluation; no shuffle)."""
    batches = _cut(list(samples), batch_size, max_tokens)
    head.eval()
    return [
        fn(prepare_batch(target, head, b))
        for b in tqdm(batches, desc=desc, unit="batch", disable=not progress)
    ]
