"""Engine configuration (what a user sets on LLM(...) or the CLI)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from specserve.sampling_params import InvalidRequestError


@dataclass
class SpeculativeConfig:
    method: (
        str  # "ngram" | "draft_model" | "eagle3" | "golden" (benchmarks: golden_token_ids + rate)
    )
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # draft model ("draft_model") or EAGLE-3 head folder ("eagle3")
    verify_budget: str = "auto"  # "auto" | "off"
    acceptance_rate: float = 1.0  # method "golden": chance each draft matches the golden token
    # CPU: the drafter's own weights (EAGLE-3 head, draft model) int8 / w8a8; None: as the
    # target's (quantized with it, else packed fp)
    quantization: str | None = None
    draft_tensor_parallel_size: int | None = None  # vLLM's field: 1 (drafters run on one rank)

    @staticmethod
    def parse(spec: dict | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"speculative config is not valid JSON: {e}") from None
        spec = dict(spec)
        method = spec.pop("method", None)
        if method not in ("ngram", "draft_model", "eagle3", "golden"):
            raise InvalidRequestError(
                "speculative_config.method must be 'ngram', 'draft_model', 'eagle3' or 'golden', "
                f"got {method!r}",
                "speculative_config",
            )
        k = spec.pop("num_speculative_tokens", None)
        if not isinstance(k, int) or not 1 <= k <= 16:
            raise InvalidRequestError(
                f"speculative_config.num_speculative_tokens must be an integer in [1, 16], got {k!r}",
                "speculative_config",
            )
        known = {f.name for f in fields(SpeculativeConfig)} - {"method", "num_speculative_tokens"}
        unknown = sorted(key for key in spec if key not in known)
        if unknown:  # vLLM fields specserve does not honour are refused, never ignored
            raise InvalidRequestError(
                f"speculative_config.{unknown[0]} is not supported by specserve; supported: "
                f"method, num_speculative_tokens, {', '.join(sorted(known))}",
                f"speculative_config.{unknown[0]}",
            )
        cfg = SpeculativeConfig(method, k, **spec)
        if method == "draft_model" and not cfg.model:
            raise InvalidRequestError(
                "speculative_config.model is required for method 'draft_model' (a draft model)",
                "speculative_config.model",
            )
        if not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
            raise InvalidRequestError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max", "speculative_config"
            )
        if not 0.0 <= cfg.acceptance_rate <= 1.0:
            raise InvalidRequestError("acceptance_rate must be in [0, 1]", "speculative_config")
        if cfg.verify_budget not in ("auto", "off"):
            raise InvalidRequestError("verify_budget must be 'auto' or 'off'", "speculative_config")
        if cfg.draft_tensor_parallel_size not in (None, 1):
            raise InvalidRequestError(
                "speculative_config.draft_tensor_parallel_size must be 1: specserve's drafters "
                f"run on one device, got {cfg.draft_tensor_parallel_size!r}",
                "speculative_config.draft_tensor_parallel_size",
            )
        if cfg.quantization is not None:
            if cfg.quantization not in DRAFT_QUANTIZATION:
                raise InvalidRequestError(
                    f"speculative_config.quantization={cfg.quantization!r} is not supported; "
                    f"use one of {', '.join(DRAFT_QUANTIZATION)} (CPU only) or leave it unset",
                    "speculative_config.quantization",
                )
            if method not in ("eagle3", "draft_model"):
                raise InvalidRequestError(
                    f"speculative_config.quantization applies to a drafter's weights; method "
                    f"{method!r} has none",
                    "speculative_config.quantization",
                )
        return cfg


# a drafter's weights: int4 keeps GGUF blocks only a target has
DRAFT_QUANTIZATION = ("int8", "w8a8")
KV_CACHE_DTYPES = ("auto", "bfloat16")  # vLLM's fp8 variants are refused by name


# dtype names an engine takes; vLLM's "half" and "float" are aliases of float16 / float32
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
# int8: weight-only int8 (bf16 activations into the GEMM); w8a8: int8 weights and activations
QUANTIZATION_METHODS = ("int8", "w8a8", "int4")


@dataclass
class EngineConfig:
    model: str | None = None  # HF folder, hub id in the local HF cache, .gguf, dummy:<preset>
    tokenizer: str | None = None  # tokenizer folder or hub id; None: the model's own
    revision: str | None = None  # hub ids: the branch, tag or commit in the HF cache (main)
    trust_remote_code: bool = False  # accepted for vLLM scripts; no remote code ever runs
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    device: str = "auto"
    tensor_parallel_size: int = 1  # ranks (processes, devices) one model is split over
    # None: weights run in `dtype`; "int8" / "w8a8" / "int4": quantized linears on the CPU
    # (model/quant.py)
    quantization: str | None = None
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's max_position_embeddings (capped)
    max_num_batched_tokens: int | None = None  # token budget of one step; None: picked by device
    # False: every prompt fits one step (the step budget is raised to max_model_len, as vLLM)
    enable_chunked_prefill: bool | None = None
    block_size: int = 16
    # CUDA: the share of the device's total memory that may be in use once the KV cache is
    # allocated (model, KV cache and whatever else holds memory on the device)
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    kv_cache_memory_gb: float | None = None  # set: the KV cache size, overriding the share
    # vLLM's: "auto" keeps K/V in the model's dtype; "bfloat16" halves an fp32 model's KV
    # cache (twice the tokens in the same memory; attention math stays fp32)
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    speculative_config: SpeculativeConfig | None = None
    seed: int = 0
    output_pool_capacity: int | None = None
    debug_invariants: bool = False
    cache_step_cost: bool = True  # keep the measured step-cost curve under $SPECSERVE_CACHE
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode/verify steps (same numbers)
    # Overlap scheduling (ZOS): build step N+1 while the device runs step N, the ledger one
    # step late. None = on for CUDA without a host-side drafter; True forces it (CPU tests).
    overlap: bool | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.dtype = _normalize_dtype(self.dtype)
        self.device = str(self.device)
        self.validate()

    def validate(self) -> None:
        """User errors in engine arguments, raised before anything is loaded."""

        def bad(msg: str, param: str) -> None:
            raise InvalidRequestError(msg, param)

        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            bad(f"tensor_parallel_size must be an integer >= 1, got {tp!r}", "tensor_parallel_size")
        spec = self.speculative_config
        if tp > 1 and spec is not None:
            # drafters run on rank 0 alone: not with the target's own (sharded) model
            if spec.method == "draft_model" and spec.model in ("self", "target", self.model):
                bad(
                    "a draft_model that is the target itself is not supported with "
                    "tensor_parallel_size > 1; use a separate draft model or 'ngram'",
                    "speculative_config",
                )
        if self.dtype not in DTYPES:
            bad(
                f"unknown dtype {self.dtype!r}; use one of {', '.join(DTYPES)}, half or float",
                "dtype",
            )
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            bad(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
                "gpu_memory_utilization",
            )
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            bad(
                f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}",
                "kv_cache_memory_gb",
            )
        for name in ("max_num_seqs", "block_size"):
            if getattr(self, name) < 1:
                bad(f"{name} must be at least 1, got {getattr(self, name)}", name)
        for name in ("max_model_len", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                bad(f"{name} must be at least 1, got {value}", name)
        if (
            self.enable_chunked_prefill is False
            and self.max_num_batched_tokens is not None
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            bad(
                _unchunked_msg(self.max_num_batched_tokens, self.max_model_len),
                "max_num_batched_tokens",
            )
        spec = self.speculative_config
        if spec is not None and spec.method == "eagle3" and not spec.model and self.model:
            bad(
                "speculative_config.model is required for method 'eagle3' (an EAGLE-3 head "
                "folder or hub id); only the default model has a head shipped with specserve",
                "speculative_config.model",
            )
        _check_device(self.device, self.tensor_parallel_size)
        check_quantization(self.quantization, self.device, tp)
        self._check_kv_cache_dtype(tp)
        if spec is not None and spec.quantization is not None:
            check_quantization(
                spec.quantization, self.device, tp, "speculative_config.quantization"
            )
            if spec.method == "draft_model" and spec.model in ("self", "target", self.model):
                bad(
                    "speculative_config.quantization: the target drafts for itself here, with "
                    "the target's weights (set quantization instead)",
                    "speculative_config.quantization",
                )

    def _check_kv_cache_dtype(self, tp: int) -> None:
        kv = self.kv_cache_dtype
        if kv == "auto":
            return
        if kv not in KV_CACHE_DTYPES:
            raise InvalidRequestError(
                f"kv_cache_dtype={kv!r} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}",
                "kv_cache_dtype",
            )
        if tp > 1:
            raise InvalidRequestError(
                f"kv_cache_dtype={kv!r} is not supported with tensor_parallel_size > 1",
                "kv_cache_dtype",
            )
        import torch

        kind = self.device.partition(":")[0]
        if kind == "auto":
            kind = "cuda" if torch.cuda.is_available() else "cpu"
        if kind == "cuda" and self.dtype not in ("auto", "bfloat16"):
            raise InvalidRequestError(
                f"kv_cache_dtype={kv!r} with dtype={self.dtype!r} runs on the CPU only (the CUDA "
                "kernels read K/V in the model's dtype); leave kv_cache_dtype='auto'",
                "kv_cache_dtype",
            )

    def step_token_budget(self, device_type: str, max_model_len: int) -> int:
        """Rows one step may hold (before the engine's floor of one decode row per request).
        Without chunked prefill a whole prompt must fit one step, so the budget is at least
        max_model_len (vLLM's rule; an explicit smaller budget is an error)."""
        default = 8192 if device_type == "cuda" else 2048
        if self.enable_chunked_prefill is False:
            if self.max_num_batched_tokens is None:
                return max(default, max_model_len)
            if self.max_num_batched_tokens < max_model_len:
                raise InvalidRequestError(
                    _unchunked_msg(self.max_num_batched_tokens, max_model_len),
                    "max_num_batched_tokens",
                )
        return self.max_num_batched_tokens or default

    def cuda_kv_budget(self, free: int, total: int) -> int:
        """Bytes the KV cache may take on a CUDA device with `free` of `total` bytes free now
        (the model already loaded): after it, gpu_memory_utilization * total is in use, the rest
        stays free for activations, CUDA graphs and other processes."""
        in_use = total - free
        budget = int(self.gpu_memory_utilization * total) - in_use
        if budget <= 0:
            raise InvalidRequestError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} leaves no memory for the "
                f"KV cache: {in_use / 2**30:.1f} GiB of the device's {total / 2**30:.1f} GiB are "
                "in use already (the model and other processes); raise it, or set "
                "kv_cache_memory_gb",
                "gpu_memory_utilization",
            )
        return budget


def _unchunked_msg(budget: int, max_model_len: int) -> str:
    return (
        f"max_num_batched_tokens ({budget}) is smaller than max_model_len ({max_model_len}): "
        "without chunked prefill a whole prompt must fit one step; raise max_num_batched_tokens, "
        "lower max_model_len or enable chunked prefill"
    )


def _normalize_dtype(dtype: Any) -> str:
    # a torch.dtype prints as "torch.float16"; str() keeps torch out of this module
    name = str(dtype).removeprefix("torch.")
    return DTYPE_ALIASES.get(name, name)


def check_quantization(
    method: object, device: str, tensor_parallel_size: int, param: str = "quantization"
) -> None:
    """User errors in `quantization` (or a drafter's, `param`), before anything loads
    (EngineConfig.validate)."""
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise InvalidRequestError(
            f"{param}={method!r} is not supported; use one of "
            f"{', '.join(QUANTIZATION_METHODS)} (CPU only) or leave it unset",
            param,
        )
    if tensor_parallel_size > 1:
        raise InvalidRequestError(
            f"{param}={method!r} is not supported with tensor_parallel_size > 1 "
            "(the shards are cut from full-precision weights)",
            param,
        )
    kind = device.partition(":")[0]
    if kind == "auto":
        import torch

        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind != "cpu":
        raise InvalidRequestError(
            f"{param}={method!r} runs on the CPU only (its kernels are torch's CPU int8 "
            f"and int4 kernels); use device='cpu', or leave {param} unset on CUDA",
            param,
        )
    if method == "int4":
        from specserve.ops.int4 import int4_kernels_available

        if not int4_kernels_available():
            import torch

            raise InvalidRequestError(
                f"quantization='int4' needs torch's CPU int4 kernels "
                f"(aten._weight_int4pack_mm_for_cpu, torch >= 2.6) with the layout specserve "
                f"checks; torch {torch.__version__} lacks them; use quantization='int8' or upgrade torch",
                "quantization",
            )


def _check_device(device: str, tp: int = 1) -> None:
    kind, _, index = device.partition(":")
    if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise InvalidRequestError(
            f"unknown device {device!r}; use auto, cpu, cuda or cuda:N", "device"
        )
    if kind != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise InvalidRequestError(
            f"device {device!r} asked for, but CUDA is not available here "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}); "
            "use --device cpu or auto",
            "device",
        )
    if index and int(index) >= torch.cuda.device_count():
        raise InvalidRequestError(
            f"device {device!r} asked for, but only {torch.cuda.device_count()} CUDA "
            "device(s) are visible",
            "device",
        )
    if int(index or 0) + tp > torch.cuda.device_count():
        raise InvalidRequestError(
            f"tensor_parallel_size={tp} on {device} needs {tp} GPUs from cuda:{index or 0} on, "
            f"but only {torch.cuda.device_count()} CUDA device(s) are visible",
            "tensor_parallel_size",
        )
