"""Engine configuration (what a user sets on LLM(...) or the CLI)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from specserve.sampling_params import InvalidRequestError


@dataclass
class SpeculativeConfig:
    method: (
        str  # "ngram" | "draft_model" | "golden" (benchmarks: golden_token_ids + acceptance_rate)
    )
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # draft model for method="draft_model"
    verify_budget: str = "auto"  # "auto" | "off"
    acceptance_rate: float = 1.0  # method "golden": chance each draft matches the golden token
    extra: dict[str, Any] = field(default_factory=dict)

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
        if method not in ("ngram", "draft_model", "golden"):
            raise InvalidRequestError(
                f"speculative_config.method must be 'ngram', 'draft_model' or 'golden', got {method!r}",
                "speculative_config",
            )
        k = spec.pop("num_speculative_tokens", None)
        if not isinstance(k, int) or not 1 <= k <= 16:
            raise InvalidRequestError(
                f"speculative_config.num_speculative_tokens must be an integer in [1, 16], got {k!r}",
                "speculative_config",
            )
        known = {
            "prompt_lookup_min",
            "prompt_lookup_max",
            "model",
            "verify_budget",
            "acceptance_rate",
        }
        cfg = SpeculativeConfig(
            method, k, **{key: spec.pop(key) for key in list(spec) if key in known}
        )
        cfg.extra = spec
        if method == "draft_model" and not cfg.model:
            raise InvalidRequestError(
                "speculative_config.model is required for method 'draft_model'",
                "speculative_config",
            )
        if not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
            raise InvalidRequestError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max", "speculative_config"
            )
        if not 0.0 <= cfg.acceptance_rate <= 1.0:
            raise InvalidRequestError("acceptance_rate must be in [0, 1]", "speculative_config")
        if cfg.verify_budget not in ("auto", "off"):
            raise InvalidRequestError("verify_budget must be 'auto' or 'off'", "speculative_config")
        return cfg


@dataclass
class EngineConfig:
    model: str | None = None
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    device: str = "auto"
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's max_position_embeddings (capped)
    max_num_batched_tokens: int | None = None  # token budget of one step; None: picked by device
    block_size: int = 16
    kv_cache_memory_gb: float | None = None  # None: a share of free device memory / 2 GiB on CPU
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
