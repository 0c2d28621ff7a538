"""Engine configuration: the speculative config honours or refuses, by name, every field a vLLM
user may pass (never a silent ignore), before anything loads."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specserve.config import EngineConfig, SpeculativeConfig
from specserve.sampling_params import InvalidRequestError

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
EAGLE = {"method": "eagle3", "num_speculative_tokens": 3}
FIELDS = {f.name for f in dataclasses.fields(SpeculativeConfig)}  # every one honoured


def _refused(spec: dict, param: str, **engine: object) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(speculative_config=spec, device="cpu", **engine)
    assert e.value.param == param, e.value
    return e.value


@pytest.mark.parametrize(
    "key",
    ["max_model_len", "revision", "disable_by_batch_size", "speculative_token_tree", "draft_model"],
)
def test_vllm_fields_specserve_does_not_honour_are_refused_by_name(key: str) -> None:
    err = _refused(NGRAM | {key: 1}, f"speculative_config.{key}")
    assert key in str(err) and "num_speculative_tokens" in str(err)  # and what is supported


@given(st.text(min_size=1, max_size=20).filter(lambda k: k not in FIELDS))
def test_any_unknown_field_is_refused(key: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SpeculativeConfig.parse(NGRAM | {key: 0})
    assert e.value.param == f"speculative_config.{key}"


def test_honoured_fields_parse() -> None:
    cfg = SpeculativeConfig.parse(
        EAGLE | {"model": "/h", "quantization": "w8a8", "draft_tensor_parallel_size": 1}
    )
    assert (cfg.quantization, cfg.draft_tensor_parallel_size, cfg.model) == ("w8a8", 1, "/h")


def test_drafters_run_on_one_device() -> None:
    assert SpeculativeConfig.parse(NGRAM | {"draft_tensor_parallel_size": 1}) is not None
    err = _refused(
        NGRAM | {"draft_tensor_parallel_size": 2}, "speculative_config.draft_tensor_parallel_size"
    )
    assert "2" in str(err)


@pytest.mark.parametrize(
    ("spec", "engine", "words"),
    [
        (EAGLE | {"quantization": "int4"}, {}, ["'int4'", "int8", "w8a8"]),
        (EAGLE | {"quantization": "fp8"}, {}, ["'fp8'"]),
        (NGRAM | {"quantization": "int8"}, {}, ["'ngram'", "has none"]),
        (EAGLE | {"quantization": "int8"}, {"tensor_parallel_size": 2}, ["tensor_parallel_size"]),
        (
            {
                "method": "draft_model",
                "num_speculative_tokens": 2,
                "model": "self",
                "quantization": "int8",
            },
            {},
            ["drafts for itself"],
        ),  # fmt: skip
    ],
)
def test_a_drafters_quantization_is_checked_before_loading(
    spec: dict, engine: dict, words: list[str]
) -> None:
    err = _refused(spec, "speculative_config.quantization", **engine)
    for w in words:
        assert w in str(err)


@pytest.mark.parametrize(
    ("engine", "words"),
    [
        ({"kv_cache_dtype": "fp8"}, ["'fp8'", "bfloat16"]),
        ({"kv_cache_dtype": "bfloat16", "tensor_parallel_size": 2}, ["tensor_parallel_size"]),
    ],
)
def test_unsupported_kv_cache_dtypes_are_refused_by_name(engine: dict, words: list[str]) -> None:
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(device="cpu", **engine)
    assert e.value.param == "kv_cache_dtype"
    for w in words:
        assert w in str(e.value)


def test_a_bf16_kv_cache_under_a_wider_model_is_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # "auto" is CUDA here
    with pytest.raises(InvalidRequestError, match="CPU only") as e:
        EngineConfig(kv_cache_dtype="bfloat16", dtype="float32")
    assert e.value.param == "kv_cache_dtype"
    EngineConfig(kv_cache_dtype="bfloat16")  # auto dtype on CUDA is bfloat16: the same
    EngineConfig(kv_cache_dtype="bfloat16", dtype="float32", device="cpu")
