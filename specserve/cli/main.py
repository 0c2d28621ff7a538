"""`specserve` command line: generate, chat, bench, serve, train-head."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

DTYPE_CHOICES = ("auto", "half", "float16", "fp16", "bfloat16", "bf16", "float", "float32", "fp32")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's arguments (vLLM's names), shared by generate, chat, serve and bench."""
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="HF model folder, hub id in the local HF cache (org/name), .gguf file or "
        "dummy:<preset>; default SmolLM2-135M-Instruct",
    )
    g.add_argument(
        "--tokenizer", default=None, help="tokenizer folder or hub id (default: the model's)"
    )
    g.add_argument(
        "--revision",
        default=None,
        help="hub ids: branch, tag or commit of the snapshot in the HF cache (default: main)",
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM scripts; specserve never runs a model's own code",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="weights and activations (auto: bfloat16 on CUDA, float32 on CPU; half = float16)",
    )
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="ranks one model is split over (processes started by specserve; CPU: gloo, "
        "CUDA: one GPU each, NCCL)",
    )
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="CPU only: int8 = int8 linear weights per output channel (bf16 activations into "
        "the GEMM), w8a8 = int8 activations too, int4 = 4-bit weights in groups of 32 (GGUF "
        "Q4_1 re-encoded exactly) (default: weights in --dtype)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (the model's dtype) or bfloat16 (an fp32 model's KV cache in half the memory)",
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=64, help="requests running at once (default 64)"
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + output tokens per request (default: the model's context length)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token rows in one step (default 8192 on CUDA, 2048 on CPU)",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="split long prompts over steps (default on); off: the step budget is raised to "
        "max-model-len so a prompt fits one step",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="CUDA: share of the device's memory in use once the KV cache is allocated "
        "(model + KV cache + others; default 0.9)",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    g.add_argument(
        "--seed", type=int, default=0, help="engine seed: unseeded requests draw theirs from it"
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run decode/verify steps without CUDA graphs (no capture at start-up)",
    )
    g.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        default=None,
        help="synchronous steps: no overlap of host scheduling with the device's step",
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="output tokens at most")
    g.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (the default); > 0 samples"
    )
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: all)")
    g.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability"
    )
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of the request's sampling")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeat for several)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")


# engine arguments whose flag default (None) means "the engine's default"
_UNSET_IS_DEFAULT = ("gpu_memory_utilization", "enable_chunked_prefill")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM(...) / EngineConfig(...) keyword arguments from the engine flags."""
    kw = dict(
        model=args.model,
        tokenizer=args.tokenizer,
        revision=args.revision,
        trust_remote_code=args.trust_remote_code,
        dtype=args.dtype,
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        speculative_config=args.speculative_config,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        overlap=args.overlap,
    )
    for name in _UNSET_IS_DEFAULT:
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    return kw


def engine_config(args: argparse.Namespace, **overrides: Any) -> Any:
    """The validated EngineConfig of the engine flags (InvalidRequestError on a bad one, before
    any model is loaded)."""
    from specserve.config import EngineConfig

    return EngineConfig(**{**engine_kwargs(args), **overrides})


def sampling_params(args: argparse.Namespace):
    from specserve import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def _print_spec_metrics(metrics: dict) -> None:
    if metrics.get("spec_drafts"):
        acc = ", ".join(f"{a:.2f}" for a in metrics["spec_acceptance_per_position"])
        print(
            f"[speculation] drafts {metrics['spec_drafts']}, draft tokens {metrics['spec_draft_tokens']}, "
            f"accepted {metrics['spec_accepted_tokens']}, mean acceptance length "
            f"{metrics['spec_mean_acceptance_length']:.2f}, per position [{acc}]",
            file=sys.stderr,
        )


def cmd_generate(args: argparse.Namespace) -> int:
    from specserve import LLM

    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                prompts = [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            print(f"error: cannot read --file {args.file}: {e}", file=sys.stderr)
            return 2
    elif args.prompt:
        prompts = [args.prompt]
    else:
        print("error: give a prompt or --file", file=sys.stderr)
        return 2
    params = sampling_params(args)  # a bad flag fails here, before the model loads
    llm = LLM(**engine_kwargs(args))
    use_template = not args.no_chat_template and getattr(llm.tokenizer, "chat_template", None)
    inputs = [
        llm.apply_chat_template([{"role": "user", "content": p}]) if use_template else p
        for p in prompts
    ]
    t0 = time.perf_counter()
    ntok = 0
    if len(inputs) == 1:
        for out in llm.stream(inputs, params):
            sys.stdout.write(out.text)
            sys.stdout.flush()
            ntok += out.token_id >= 0
            if out.finished:
                print(f"\n[finish_reason={out.finish_reason}]", file=sys.stderr)
    else:
        for i, res in enumerate(llm.generate(inputs, params)):
            print(
                f"=== {i}: {prompts[i]!r}\n{res.outputs[0].text}\n[finish_reason={res.outputs[0].finish_reason}]"
            )
            ntok += len(res.outputs[0].token_ids)
    dt = time.perf_counter() - t0
    print(f"[{ntok} tokens in {dt:.2f} s, {ntok / max(dt, 1e-9):.1f} tok/s]", file=sys.stderr)
    _print_spec_metrics(llm.get_metrics())
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from specserve import LLM

    params = sampling_params(args)  # a bad flag fails here, before the model loads
    llm = LLM(**engine_kwargs(args))
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("specserve chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = []
        for out in llm.stream([llm.apply_chat_template(messages)], params):
            sys.stdout.write(out.text)
            sys.stdout.flush()
            reply.append(out.text)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def build_parser() -> argparse.ArgumentParser:
    from specserve import __version__

    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"specserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate from a prompt (or a file, one prompt a line)")
    g.add_argument("prompt", nargs="?", default=None, help="the prompt text")
    g.add_argument("--file", default=None, help="a text file with one prompt per line")
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt raw")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive streaming chat")
    c.add_argument("--system", default=None, help="system message that opens the chat")
    add_engine_args(c)
    add_sampling_args(c)
    c.set_defaults(func=cmd_chat)

    try:
        from specserve.cli.bench import add_bench_parser

        add_bench_parser(sub)
    except ImportError:  # pragma: no cover - bench extras missing
        pass
    try:
        from specserve.cli.serve import add_serve_parser

        add_serve_parser(sub)
    except ImportError:  # pragma: no cover - server extras missing
        pass
    from specserve.train.cli import add_train_parser

    add_train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from specserve.model.errors import ModelLoadError
    from specserve.sampling_params import InvalidRequestError

    try:
        return int(args.func(args) or 0)
    except (ModelLoadError, InvalidRequestError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
