"""The HF `transformers` baseline: the same checkpoint, prompts and settings run through
`model.generate`, so `specserve bench throughput` can report a ratio measured in one process.

Prompts are passed as token ids (never re-tokenized) so both sides see identical inputs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specserve.bench.datasets import BenchRequest
from specserve.bench.report import RunResult

DUMMY_PREFIX = "dummy:"
NAME = "hf"


def load_hf_model(
    model: str,
    dtype: torch.dtype,
    device: torch.device,
    hf_config: Any | None = None,
) -> Any:
    """An HF causal LM for the checkpoint `model` (.gguf file, HF dir, or `dummy:` preset).

    For `dummy:` the weights are random: with ignore_eos the speed does not depend on them, so an
    HF model of the same config (`hf_config`, taken from the engine) is a fair baseline.
    """
    from transformers import AutoModelForCausalLM

    if model.startswith(DUMMY_PREFIX):
        if hf_config is None:
            raise ValueError(f"the HF baseline for {model!r} needs the HF config of that preset")
        torch.manual_seed(0)
        with torch.device(
            device
        ):  # built in place: an 8B model initialised on the host takes minutes
            m = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    else:
        path = Path(model).expanduser()
        if path.suffix == ".gguf":
            # GGUF weights are dequantized to `dtype` by transformers: same values, full precision
            m = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=dtype, local_files_only=True
            )
        else:
            m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    return m.to(device).eval()


_ARCH_TO_MODEL_TYPE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def hf_config_from_model_config(mc: Any) -> Any:
    """An HF config equal in shape to the engine's ModelConfig (for `dummy:` presets, which have
    no config.json on disk). Only shape-relevant fields matter: weights are random anyway."""
    from transformers import AutoConfig

    fields = dict(
        vocab_size=mc.vocab_size,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_hidden_layers,
        num_attention_heads=mc.num_attention_heads,
        num_key_value_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim,
        rms_norm_eps=mc.rms_norm_eps,
        rope_theta=mc.rope_theta,
        max_position_embeddings=mc.max_position_embeddings,
        tie_word_embeddings=mc.tie_word_embeddings,
        bos_token_id=mc.bos_token_id,
        eos_token_id=list(mc.eos_token_ids) or None,
    )
    model_type = _ARCH_TO_MODEL_TYPE.get(mc.architecture, "llama")
    if model_type == "llama":
        fields["attention_bias"] = mc.attention_bias
    if mc.rope_scaling:
        fields["rope_scaling"] = dict(mc.rope_scaling)
    return AutoConfig.for_model(model_type, **fields)


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def _pad_id(tokenizer: Any, eos: set[int]) -> int:
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if pad is not None:
        return int(pad)
    return min(eos) if eos else 0


def _gen_kwargs(max_new: int, ignore_eos: bool, pad_id: int) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        do_sample=False,
        max_new_tokens=max_new,
        pad_token_id=pad_id,
        # neutralise sampling knobs a checkpoint's generation_config may carry
        temperature=None,
        top_p=None,
        top_k=None,
    )
    if ignore_eos:
        kw["min_new_tokens"] = max_new  # forbids EOS until max: HF's ignore_eos
    return kw


def _count_output(gen: Sequence[int], limit: int, eos: set[int], ignore_eos: bool) -> int:
    """Tokens a request really produced: up to and including its first EOS (as the engine counts)."""
    gen = list(gen)[:limit]
    if not ignore_eos:
        for i, t in enumerate(gen):
            if t in eos:
                return i + 1
    return len(gen)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_hf_batched(
    model: Any,
    requests: Sequence[BenchRequest],
    ignore_eos: bool,
    batch_size: int,
    tokenizer: Any = None,
    warmup: bool = True,
) -> RunResult:
    """Left-padded batches of `batch_size` in request order, greedy, timed end to end."""
    device = next(model.parameters()).device
    eos = _eos_ids(model, tokenizer)
    pad = _pad_id(tokenizer, eos)
    if warmup and requests:
        _generate_batch(model, requests[:1], 2, ignore_eos, pad, device)
    _sync(device)
    out_tokens = 0
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        max_new = max(r.output_len for r in batch)
        gens = _generate_batch(model, batch, max_new, ignore_eos, pad, device)
        out_tokens += sum(
            _count_output(g, r.output_len, eos, ignore_eos) for g, r in zip(gens, batch)
        )
    _sync(device)
    seconds = time.perf_counter() - t0
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    return RunResult(
        name=NAME,
        mode="batched",
        num_requests=len(requests),
        prompt_tokens=prompt_tokens,
        output_tokens=out_tokens,
        seconds=seconds,
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        device=str(device),
        batch_size=batch_size,
    )


def _generate_batch(
    model: Any,
    batch: Sequence[BenchRequest],
    max_new: int,
    ignore_eos: bool,
    pad: int,
    device: torch.device,
) -> list[list[int]]:
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):  # left padding: every row's last prompt token is aligned
        n = len(r.prompt_token_ids)
        ids[i, width - n :] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
        mask[i, width - n :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            **_gen_kwargs(max_new, ignore_eos, pad),
        )
    return out[:, width:].tolist()


class _TimingStreamer:
    """Records when generate hands over each new token (the first call carries the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        if value.device.type == "cuda":
            torch.cuda.synchronize(value.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_hf_batch1(
    model: Any,
    requests: Sequence[BenchRequest],
    ignore_eos: bool,
    tokenizer: Any = None,
    warmup: bool = True,
) -> RunResult:
    """One request at a time; per-request decode rate excludes the prefill and first token."""
    device = next(model.parameters()).device
    eos = _eos_ids(model, tokenizer)
    pad = _pad_id(tokenizer, eos)
    if warmup and requests:
        _generate_batch(model, requests[:1], 2, ignore_eos, pad, device)
    rates: list[float] = []
    out_tokens = 0
    total_s = 0.0
    for r in requests:
        ids = torch.tensor([r.prompt_token_ids], dtype=torch.long, device=device)
        streamer = _TimingStreamer()
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                streamer=streamer,
                **_gen_kwargs(r.output_len, ignore_eos, pad),
            )
        _sync(device)
        total_s += time.perf_counter() - t0
        n = _count_output(out[0, ids.shape[1] :].tolist(), r.output_len, eos, ignore_eos)
        out_tokens += n
        # times[0] = prompt handed over, times[1] = first token, times[n] = n-th token
        if n >= 2 and len(streamer.times) > n:
            rates.append((n - 1) / (streamer.times[n] - streamer.times[1]))
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    return RunResult(
        name=NAME,
        mode="batch1",
        num_requests=len(requests),
        prompt_tokens=prompt_tokens,
        output_tokens=out_tokens,
        seconds=total_s,
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        device=str(device),
        batch_size=1,
        per_request_decode_tok_s=rates,
    )


def run_hf_baseline(
    model: str,
    requests: Sequence[BenchRequest],
    *,
    ignore_eos: bool,
    batch_1: bool,
    batch_size: int,
    dtype: str = "auto",
    device: str = "auto",
    tokenizer: Any = None,
    hf_config: Any | None = None,
    eos_token_ids: Sequence[int] | None = None,
    continuous: bool = False,
) -> RunResult:
    """Load the HF model for `model` and run the matching mode (batch-1, batched, or with
    `continuous` HF's continuous batching, `generate_batch`; see hf_continuous).

    `eos_token_ids`: the engine's stop ids; without ignore_eos both sides must stop on the same
    tokens, and a checkpoint's generation_config may list fewer than the engine uses.
    """
    from specserve.engine.device import resolve_device, resolve_dtype

    dev = resolve_device(device)
    hf = load_hf_model(model, resolve_dtype(dtype, dev), dev, hf_config)
    if eos_token_ids:
        hf.generation_config.eos_token_id = sorted(int(t) for t in eos_token_ids)
    try:
        if continuous:
            # imported here: hf_continuous builds on this module's helpers
            from specserve.bench.hf_continuous import run_hf_continuous

            res = run_hf_continuous(hf, requests, ignore_eos, tokenizer)
        elif batch_1:
            res = run_hf_batch1(hf, requests, ignore_eos, tokenizer)
        else:
            res = run_hf_batched(hf, requests, ignore_eos, batch_size, tokenizer)
    finally:
        del hf
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return res
