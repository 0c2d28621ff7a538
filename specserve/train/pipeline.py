"""`specserve train-head` end to end: data, draft vocabulary, training, calibration, evaluation,
the head folder and a JSON report.

    <out>/data/           the prompts' answers by the target (cached; a rerun reads them back)
    <out>/checkpoint/     the resumable training state
    <out>/train_log.jsonl one line per optimizer step
    <out>/head/           the trained head in vLLM / SGLang's EAGLE-3 format
    <out>/report.json     data, training, calibration and held-out evaluation numbers
"""

from __future__ import annotations

import gc
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specserve.train.calibrate import Calibration, calibrate
from specserve.train.code_prompts import code_task_prompts, source_tag
from specserve.train.data import (
    AnswerCache,
    DataSpec,
    Prompt,
    Sample,
    file_prompts,
    regenerate,
    sharegpt_prompts,
    sharegpt_turn_prompts,
    split_samples,
    tokenize_prompts,
)
from specserve.train.errors import TrainHeadError
from specserve.train.evaluate import EVAL_K, EvalReport, draft_chains, summarize
from specserve.train.trainer import Trainer, TrainOptions, build_head, run_batches
from specserve.train.ttt import ttt_loss
from specserve.train.vocab import build_draft_vocab, coverage

SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class HeadTrainingJob:
    out: Path
    model: str | None = None  # None: the default model
    prompts_file: Path | None = None  # None: ShareGPT first turns
    turns: str = "first"  # ShareGPT: "first" turns, or "all" (later turns with their history)
    code_prompts: int = 0  # code-task prompts from the standard library, besides num_prompts
    num_prompts: int = 2000
    max_prompt_tokens: int = 512
    max_answer_tokens: int = 256
    gen_temperature: float = 0.0
    draft_vocab_size: int = 8192
    heldout_fraction: float = 0.05
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 64
    # CUDA: the engine's share of the device (weights + KV cache); the rest is training's
    gpu_memory_utilization: float = 0.3
    resume: bool = False
    stop_after: int | None = None  # optimizer steps in this run, then a checkpoint and exit
    # seconds for this run (answering prompts and training), then a checkpoint and exit
    time_limit: float | None = None
    save_dtype: str = "bfloat16"
    engine_eval_k: int = 5  # > 0: also speculate with the saved head through the engine
    progress: bool = True
    train: TrainOptions = field(default_factory=TrainOptions)


def check_job(job: HeadTrainingJob) -> None:
    """User errors, before any model is loaded (ValueError with a one-line message)."""
    t = job.train
    if job.num_prompts < 2:
        raise TrainHeadError(f"--num-prompts {job.num_prompts}: need at least 2")
    if job.max_answer_tokens < 2 or job.max_prompt_tokens < 4:
        raise TrainHeadError("--max-answer-tokens must be >= 2 and --max-prompt-tokens >= 4")
    if job.draft_vocab_size < 1:
        raise TrainHeadError(f"--draft-vocab-size {job.draft_vocab_size}: need >= 1")
    if not 1 <= t.ttt_steps <= 16:
        raise TrainHeadError(f"--ttt-steps {t.ttt_steps}: need 1..16")
    if not 0.0 <= job.heldout_fraction < 1.0:
        raise TrainHeadError(f"--heldout-fraction {job.heldout_fraction}: need [0, 1)")
    if t.epochs < 1 or (t.max_steps is not None and t.max_steps < 1):
        raise TrainHeadError("--epochs and --steps must be >= 1")
    if t.train_seconds is not None and not t.train_seconds > 0:
        raise TrainHeadError(f"--train-seconds {t.train_seconds}: need > 0")
    if t.batch_size < 1 or t.max_tokens_per_batch < 1:
        raise TrainHeadError("--batch-size and --max-tokens-per-batch must be >= 1")
    if not t.lr > 0:
        raise TrainHeadError(f"--lr {t.lr}: need > 0")
    if job.engine_eval_k < 0 or job.engine_eval_k > 16:
        raise TrainHeadError(f"--engine-eval-k {job.engine_eval_k}: need 0..16")
    if not 0.0 < job.gpu_memory_utilization <= 1.0:
        raise TrainHeadError(f"--gpu-memory-utilization {job.gpu_memory_utilization}: need (0, 1]")
    if job.save_dtype not in SAVE_DTYPES:
        raise TrainHeadError(f"--save-dtype {job.save_dtype!r}: one of {', '.join(SAVE_DTYPES)}")
    if job.turns not in ("first", "all"):
        raise TrainHeadError(f"--turns {job.turns!r}: use first or all")
    if job.turns == "all" and job.prompts_file is not None:
        raise TrainHeadError("--turns all reads ShareGPT conversations; drop --prompts")
    if job.code_prompts < 0:
        raise TrainHeadError(f"--code-prompts {job.code_prompts}: need >= 0")
    if job.prompts_file is not None and not job.prompts_file.is_file():
        raise TrainHeadError(f"--prompts {job.prompts_file}: no such file")
    ckpt = job.out / "checkpoint" / "state.pt"
    if ckpt.is_file() and not job.resume:
        raise TrainHeadError(
            f"{job.out} already holds a training checkpoint: pass --resume to go on from it, "
            "or choose another --out"
        )


_START = time.perf_counter()


def _log(msg: str) -> None:
    # seconds since start: a device call's time limit is spent across these stages
    print(f"[train-head {time.perf_counter() - _START:.0f} s] {msg}", file=sys.stderr, flush=True)


def data_source(job: HeadTrainingJob) -> str:
    if job.prompts_file is not None:
        base = str(job.prompts_file)
    else:
        base = "sharegpt" if job.turns == "first" else "sharegpt-all-turns"
    return f"{base}+code{job.code_prompts}-{source_tag()}" if job.code_prompts else base


def build_data(job: HeadTrainingJob, llm: Any, deadline: float | None) -> list[Sample] | None:
    source = data_source(job)
    spec = DataSpec(
        model=llm.model_name,
        source=source,
        num_prompts=job.num_prompts,
        max_prompt_tokens=job.max_prompt_tokens,
        max_answer_tokens=job.max_answer_tokens,
        temperature=job.gen_temperature,
        seed=job.train.seed,
    )
    cache = AnswerCache(job.out / "data", spec)
    cache.check_spec()
    done = cache.num_complete()
    if done is not None:
        _log(f"all {done} prompts answered already ({cache.root})")
        return cache.load_complete(done)
    texts: list[Prompt]
    if job.prompts_file is None:
        # more than asked: the length filter drops many (tokenizing stops once enough pass)
        texts = list(sharegpt_prompts(10 * job.num_prompts + 64, job.train.seed))
        if job.turns == "all":  # after every first turn
            texts += sharegpt_turn_prompts(10 * job.num_prompts + 64, job.train.seed)
    else:
        texts = list(file_prompts(job.prompts_file))
    prompts = tokenize_prompts(llm.tokenizer, texts, job.num_prompts, job.max_prompt_tokens)
    if job.code_prompts:
        code = code_task_prompts(2 * job.code_prompts + 64, job.train.seed)
        code_ids = tokenize_prompts(llm.tokenizer, code, job.code_prompts, job.max_prompt_tokens)
        if len(code_ids) < job.code_prompts:
            _log(f"{len(code_ids)} code prompts pass the length filter ({job.code_prompts} asked)")
        prompts += code_ids
    if len(prompts) < 2:
        raise TrainHeadError(f"only {len(prompts)} prompts pass the length filter; need >= 2")
    if len(prompts) < job.num_prompts:
        _log(f"{len(prompts)} prompts pass the length filter ({job.num_prompts} asked)")
    samples = regenerate(
        llm,
        prompts,
        cache,
        job.max_answer_tokens,
        job.gen_temperature,
        job.train.seed,
        job.progress,
        deadline,
    )
    if samples is not None:
        cache.mark_complete(len(prompts))
    return samples


def evaluate_head(
    target: torch.nn.Module,
    head: torch.nn.Module,
    calib: list[Sample],
    held: list[Sample],
    opts: TrainOptions,
    progress: bool,
) -> tuple[EvalReport, Calibration | None, list[float]]:
    """Chains on the held-out samples; temperatures fit on `calib`, ECE and tokens per step on
    `held`; also the teacher-forced top-1 accuracy per TTT step on `held`."""
    k = max(EVAL_K, opts.ttt_steps)

    def chains(samples: list[Sample], desc: str):
        return run_batches(
            lambda b: draft_chains(head, b, k),
            target,
            head,
            samples,
            opts.batch_size,
            opts.max_tokens_per_batch,
            desc,
            progress,
        )

    held_rows = chains(held, "evaluating")
    report = summarize([a for r in held_rows for a in r.accepted], EVAL_K)

    def pooled(rows, attr):
        return [torch.cat([getattr(r, attr)[i] for r in rows]) for i in range(k)] if rows else []

    cal = None
    if calib and head.confidence_head is not None:
        calib_rows = chains(calib, "calibrating")
        cal = calibrate(
            pooled(calib_rows, "conf_logits"),
            pooled(calib_rows, "labels"),
            pooled(held_rows, "conf_logits"),
            pooled(held_rows, "labels"),
        )

    def tf_acc(b):
        with torch.no_grad():
            res = ttt_loss(head, b, opts.ttt_steps, opts.step_decay, opts.confidence_weight)
        return [(s.acc * s.rows, s.rows) for s in res.steps]

    per = run_batches(
        tf_acc,
        target,
        head,
        held,
        opts.batch_size,
        opts.max_tokens_per_batch,
        "teacher-forced",
        progress,
    )
    acc = [
        sum(p[i][0] for p in per) / max(1, sum(p[i][1] for p in per)) for i in range(opts.ttt_steps)
    ]
    return report, cal, acc


def save_head(head: torch.nn.Module, cal: Calibration | None, path: Path, dtype: str) -> int:
    """The head folder; returns its size in bytes. Per-position confidence temperatures go in
    config.json (`confidence_temperatures`), a key other engines ignore."""
    from specserve.model.loader.eagle3 import save_eagle3_head

    cfg = head.config
    if cal is not None:
        cfg.raw["confidence_temperatures"] = cal.temperatures
    saved = {k: v.detach().clone() for k, v in head.state_dict().items()}
    try:
        with torch.no_grad():
            for p in head.parameters():
                p.data = p.data.to(SAVE_DTYPES[dtype])
        save_eagle3_head(head, cfg, path)
    finally:
        for name, p in head.named_parameters():
            p.data = saved[name].to(p.device)
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def engine_eval(job: HeadTrainingJob, head_dir: Path, samples: list[Sample]) -> dict[str, Any]:
    """The saved head as the engine serves it: method "eagle3" with k drafts per step and the
    verify budget off (every step verifies k), greedy, on the held-out prompts. Greedy answers
    must come out identical to the target's own (the cached ones, when those are greedy)."""
    from specserve import LLM, SamplingParams

    k = job.engine_eval_k
    llm = LLM(
        model=job.model,
        dtype=job.dtype,
        device=job.device,
        seed=job.train.seed,
        max_num_seqs=job.max_num_seqs,
        gpu_memory_utilization=job.gpu_memory_utilization,
        progress=False,
        speculative_config={
            "method": "eagle3",
            "model": str(head_dir),
            "num_speculative_tokens": k,
            "verify_budget": "off",
        },
    )
    params = SamplingParams(temperature=0.0, max_tokens=job.max_answer_tokens)
    t0 = time.perf_counter()
    outs = llm.generate([s.prompt_ids for s in samples], params, use_tqdm=job.progress)
    seconds = time.perf_counter() - t0
    m = llm.get_metrics()
    out: dict[str, Any] = {
        "k": k,
        "prompts": len(samples),
        # 1 + accepted / steps that drafted (the engine's metric: a request's last step, with
        # no room left to draft, is not counted; evaluate.py's walk counts it)
        "tokens_per_step": m["spec_mean_acceptance_length"],
        "accepted_tokens": m["spec_accepted_tokens"],
        "acceptance_per_position": m["spec_acceptance_per_position"],
        "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "seconds": round(seconds, 2),
    }
    if job.gen_temperature == 0.0:
        out["identical_to_target_greedy"] = sum(
            list(o.outputs[0].token_ids) == s.answer_ids for o, s in zip(outs, samples)
        )
    return out


def train_head(job: HeadTrainingJob, command: str = "") -> dict[str, Any]:
    """The whole job; returns (and writes) the report."""
    from specserve import LLM

    check_job(job)
    job.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(job.train.seed)
    t_start = time.perf_counter()
    deadline = None if job.time_limit is None else time.monotonic() + job.time_limit
    # every prompt answered: the engine only lends its model (training runs its own forward),
    # so no CUDA graphs and a token KV cache (build_data still checks the cache's spec)
    answered = AnswerCache(job.out / "data", None).num_complete() is not None
    lean: dict[str, Any] = {"enforce_eager": True, "kv_cache_memory_gb": 0.01} if answered else {}
    llm = LLM(
        model=job.model,
        dtype=job.dtype,
        device=job.device,
        seed=job.train.seed,
        max_num_seqs=job.max_num_seqs,
        gpu_memory_utilization=job.gpu_memory_utilization,
        progress=job.progress,
        **lean,
    )
    target = llm.engine.target_model
    _log("target engine ready")
    t0 = time.perf_counter()
    samples = build_data(job, llm, deadline)
    t_data = time.perf_counter() - t0
    if samples is None:
        done = len(AnswerCache(job.out / "data", None).load())
        _log(
            f"--time-limit reached while answering prompts ({done} cached); rerun the same "
            "command to go on"
        )
        return {"data": {"answered": done}, "finished": False}
    split = split_samples(samples, job.heldout_fraction, job.train.seed)
    if not split.train:
        raise TrainHeadError("no training samples (every answer is shorter than 2 tokens)")
    eos = list(llm.engine.eos_ids) if hasattr(llm.engine, "eos_ids") else []
    vocab_size = target.config.vocab_size
    vocab = build_draft_vocab(
        [s.answer_ids for s in split.train],
        min(job.draft_vocab_size, vocab_size),
        vocab_size,
        always=[e for e in eos if 0 <= e < vocab_size],
    )
    cov_train = coverage(vocab, [s.answer_ids for s in split.train])
    cov_eval = coverage(vocab, [s.answer_ids for s in split.eval])
    _log(
        f"{len(split.train)} train / {len(split.calib)} calibration / {len(split.eval)} eval "
        f"prompts; draft vocabulary {vocab.size} covers {cov_train:.1%} of training answer "
        f"tokens, {cov_eval:.1%} of held-out ones"
    )
    head = build_head(target, vocab, job.train.seed)
    trainer = Trainer(target, head, split.train, job.train, job.out, job.progress)
    if job.resume and trainer.ckpt_path.is_file():
        trainer.load_checkpoint()
        if not torch.equal(head.d2t.cpu(), vocab.d2t):
            raise TrainHeadError("the checkpoint's draft vocabulary differs from this data's")
        _log(f"resumed at step {trainer.state.step}/{trainer.total_steps}")
    elif job.resume:
        _log(f"--resume: no checkpoint in {job.out} yet; training from the start")
    t0 = time.perf_counter()
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    trainer.run(job.stop_after, left)
    t_train = time.perf_counter() - t0
    report: dict[str, Any] = {
        "command": command,
        "model": llm.model_name,
        "device": str(next(target.parameters()).device),
        "data": {
            "source": data_source(job),
            "prompts": len(samples),
            "train": len(split.train),
            "calibration": len(split.calib),
            "eval": len(split.eval),
            "train_tokens": sum(s.num_tokens for s in split.train),
            "answer_tokens": sum(len(s.answer_ids) for s in samples),
            "max_answer_tokens": job.max_answer_tokens,
            "seconds": round(t_data, 1),
        },
        "draft_vocab": {
            "size": vocab.size,
            "coverage_train": cov_train,
            "coverage_eval": cov_eval,
        },
        "train": {
            **asdict(job.train),
            "steps_done": trainer.state.step,
            "total_steps": trainer.total_steps,
            "seconds_this_run": round(t_train, 1),
            "finished": trainer.finished,
        },
    }
    if not trainer.finished:
        _log(
            f"stopped at step {trainer.state.step}/{trainer.total_steps}; checkpoint saved, "
            "rerun with --resume to go on"
        )
        return report
    ev, cal, tf_acc = evaluate_head(target, head, split.calib, split.eval, job.train, job.progress)
    size = save_head(head, cal, job.out / "head", job.save_dtype)
    report["eval"] = {**ev.as_dict(), "teacher_forced_acc_per_step": tf_acc}
    report["calibration"] = cal.as_dict() if cal is not None else None
    report["head"] = {"path": str(job.out / "head"), "bytes": size, "dtype": job.save_dtype}
    if job.engine_eval_k > 0 and split.eval:
        # the training engine (its KV cache), the trainer and the head go before a new engine
        # loads the head from disk
        del llm, trainer, head, target
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        try:
            report["engine_eval"] = engine_eval(job, job.out / "head", split.eval)
        except Exception as e:  # the head is saved either way; say why the check did not run
            report["engine_eval"] = {"error": f"{type(e).__name__}: {e}"}
            _log(f"engine evaluation failed: {type(e).__name__}: {e}")
    report["seconds_total"] = round(time.perf_counter() - t_start, 1)
    (job.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"held-out evaluation ({ev.num_sequences} prompts, {ev.num_chains} chains, greedy):")
    print(ev.table())
    if cal is not None:
        print(
            "confidence calibration error (ECE, held-out): "
            f"before {cal.ece_before_all:.4f}, after {cal.ece_after_all:.4f}; per position "
            + " ".join(f"{a:.3f}->{b:.3f}" for a, b in zip(cal.ece_before, cal.ece_after))
        )
        print("temperatures per position: " + " ".join(f"{t:.3f}" for t in cal.temperatures))
    eng = report.get("engine_eval")
    if eng and "error" not in eng:
        same = eng.get("identical_to_target_greedy")
        print(
            f"through the engine (eagle3, k={eng['k']}, greedy): {eng['tokens_per_step']:.3f} "
            "tokens per step; acceptance per position "
            + " ".join(f"{a:.3f}" for a in eng["acceptance_per_position"])
            + (
                f"; {same}/{eng['prompts']} answers identical to the target's"
                if same is not None
                else ""
            )
        )
    print(f"head: {job.out / 'head'} ({size / 2**20:.1f} MiB); report: {job.out / 'report.json'}")
    return report
