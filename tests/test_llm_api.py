"""The offline API's vLLM surface: n samples, prompt dicts, get_tokenizer, top-level exports and
the engine arguments LLM(...) takes or refuses by name."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from specserve import LLM, SamplingParams, TextPrompt, TokensPrompt
from specserve.config import EngineConfig
from specserve.fanout import derive_seed
from specserve.sampling_params import InvalidRequestError

TINY = "dummy:tiny"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(TINY, dtype="float32", device="cpu", progress=False, debug_invariants=True)


def _idle(llm: LLM) -> bool:
    st = llm.engine.stats()
    return st.num_running == 0 and st.num_waiting == 0 and st.num_free_blocks == st.num_blocks


def _ids(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


# -- n ----------------------------------------------------------------------------------------
def test_n_returns_n_completions_seeded_like_the_server(llm: LLM) -> None:
    prompt = [11, 12, 13, 14]
    sp = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=6, ignore_eos=True)
    [out] = llm.generate(prompt, sp, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
    assert out.finished and out.prompt_token_ids == prompt
    assert out.metrics.num_output_tokens == 18  # summed over the samples
    # sample i is the plain request the server runs for it: seed derive_seed(seed, i)
    for i, comp in enumerate(out.outputs):
        one = SamplingParams(temperature=1.0, seed=derive_seed(1234, i), max_tokens=6)
        one.ignore_eos = True
        [plain] = llm.generate(prompt, one, use_tqdm=False)
        assert plain.outputs[0].token_ids == comp.token_ids
        assert plain.outputs[0].text == comp.text
    assert len({tuple(t) for t in _ids(out)}) > 1  # distinct seeds, distinct samples
    assert _idle(llm)


def test_n_per_prompt_keeps_order_and_greedy_samples_agree(llm: LLM) -> None:
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [
        SamplingParams(n=2, temperature=0.0, max_tokens=4),
        SamplingParams(n=1, temperature=0.0, max_tokens=3),
        SamplingParams(n=4, temperature=0.0, max_tokens=2),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.outputs) for o in outs] == [2, 1, 4]
    singles = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=4)] * 3, False)
    for o, s, sp in zip(outs, singles, params):
        assert all(ids == s.outputs[0].token_ids[: sp.max_tokens] for ids in _ids(o))


def test_stream_refuses_n_by_name(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError) as e:
        next(iter(llm.stream([1, 2, 3], SamplingParams(n=2))))
    assert e.value.param == "n"
    assert _idle(llm)


# -- prompts ------------------------------------------------------------------------------------
def test_prompt_dicts_generate_like_their_contents(llm: LLM) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    ids = [21, 22, 23, 24, 25]
    tok = TokensPrompt(prompt_token_ids=ids)
    txt = TextPrompt(prompt="Hello there")
    by_dict = llm.generate([tok, txt], sp, use_tqdm=False)
    by_plain = llm.generate([ids, "Hello there"], sp, use_tqdm=False)
    assert [_ids(o) for o in by_dict] == [_ids(o) for o in by_plain]
    assert by_dict[0].prompt_token_ids == ids
    assert by_dict[1].prompt == "Hello there"
    [single] = llm.generate(tok, sp, use_tqdm=False)  # one dict, not in a list
    assert _ids(single) == _ids(by_plain[0])


@pytest.mark.parametrize(
    ("prompt", "param"),
    [
        ({"prompt": "x", "multi_modal_data": {"image": None}}, "multi_modal_data"),
        ({"prompt_embeds": [[0.0]]}, "prompt_embeds"),
        ({"prompt": "x", "colour": "red"}, "colour"),
        ({}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt_token_ids": [1, 2.5]}, "prompt_token_ids"),
        ({"prompt_token_ids": "1 2"}, "prompt_token_ids"),
        (3.5, "prompt"),
        (None, "prompt"),
        ([[1, 2], {"prompt": "ok"}, {1, 2}], "prompt"),
        ([[]], "prompt"),
    ],
)
def test_other_prompts_are_refused_by_name(llm: LLM, prompt: object, param: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)  # type: ignore[arg-type]
    assert e.value.param == param
    assert _idle(llm)


def test_a_refused_prompt_leaves_nothing_queued(llm: LLM) -> None:
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError):
        llm.generate([[1, 2, 3], [4, 5], [vocab + 7]], SamplingParams(n=2), use_tqdm=False)
    assert not llm.engine._terminal and _idle(llm)
    [out] = llm.generate([1, 2, 3], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


# -- tokenizer, exports -----------------------------------------------------------------------------
def test_get_tokenizer(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    assert tok is llm.engine.tokenizer
    assert tok.decode(tok.encode("hello world")).strip() == "hello world"


def test_top_level_exports_import_no_torch() -> None:
    code = (
        "import sys\n"
        "from specserve import CompletionOutput, RequestOutput, SamplingParams, TextPrompt, "
        "TokensPrompt\n"
        "from specserve.engine.outputs import RequestOutput as R\n"
        "assert RequestOutput is R and CompletionOutput.__name__ == 'CompletionOutput'\n"
        "assert TokensPrompt(prompt_token_ids=[1]) == {'prompt_token_ids': [1]}\n"
        "assert 'torch' not in sys.modules, 'import specserve pulled in torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- engine arguments -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"quantization": "awq"}, "quantization"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization"),
        ({"dtype": "float8"}, "dtype"),
        ({"device": "mps"}, "device"),
        ({"device": "cuda:x"}, "device"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"kv_cache_memory_gb": -1.0}, "kv_cache_memory_gb"),
        (
            {"enable_chunked_prefill": False, "max_model_len": 256, "max_num_batched_tokens": 64},
            "max_num_batched_tokens",
        ),
    ],
)
def test_bad_engine_arguments_are_refused_by_name(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        LLM(TINY, progress=False, **kwargs)
    assert e.value.param == param
    if param == "tensor_parallel_size":
        assert "tensor_parallel_size must be an integer >= 1" in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_one_clear_error() -> None:
    with pytest.raises(InvalidRequestError, match="CUDA is not available") as e:
        LLM(TINY, device="cuda", progress=False)
    assert e.value.param == "device"


def test_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="swap_space"):
        LLM(TINY, progress=False, swap_space=4)


@pytest.mark.parametrize(
    ("given", "name"), [("half", "float16"), ("float", "float32"), ("bf16", "bf16")]
)
def test_dtype_aliases(given: str, name: str) -> None:
    from specserve.engine.device import resolve_dtype

    cfg = EngineConfig(dtype=given)
    assert cfg.dtype == name
    assert EngineConfig(dtype=getattr(torch, name) if hasattr(torch, name) else name).dtype == name
    resolve_dtype(cfg.dtype, torch.device("cpu"))  # every name the config takes resolves


def test_unchunked_prefill_budget_covers_a_whole_prompt() -> None:
    assert EngineConfig().step_token_budget("cpu", 4096) == 2048
    off = EngineConfig(enable_chunked_prefill=False)
    assert off.step_token_budget("cpu", 4096) == 4096
    assert off.step_token_budget("cuda", 4096) == 8192
    assert EngineConfig(max_num_batched_tokens=512).step_token_budget("cpu", 4096) == 512
    small = EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=512)
    with pytest.raises(InvalidRequestError) as e:
        small.step_token_budget("cpu", 4096)  # max_model_len known only once the model is
    assert e.value.param == "max_num_batched_tokens"


def test_gpu_memory_utilization_is_a_share_of_total_memory() -> None:
    gib = 2**30
    cfg = EngineConfig(gpu_memory_utilization=0.5)
    # 100 GiB device, 10 GiB in use (model, others): 50 - 10 = 40 GiB for the KV cache
    assert cfg.cuda_kv_budget(90 * gib, 100 * gib) == 40 * gib
    assert EngineConfig().cuda_kv_budget(90 * gib, 100 * gib) == 80 * gib  # default 0.9
    with pytest.raises(InvalidRequestError) as e:
        cfg.cuda_kv_budget(40 * gib, 100 * gib)  # 60 GiB in use already
    assert e.value.param == "gpu_memory_utilization" and "60.0 GiB" in str(e.value)


def test_accepted_vllm_arguments_reach_the_engine() -> None:
    llm = LLM(
        TINY,
        dtype="float32",
        device="cpu",
        progress=False,
        trust_remote_code=True,
        tensor_parallel_size=1,
        quantization=None,
        gpu_memory_utilization=0.5,
        enable_chunked_prefill=False,
        max_model_len=300,
        max_num_seqs=4,
    )
    cfg = llm.engine.config
    assert cfg.trust_remote_code and cfg.gpu_memory_utilization == 0.5
    assert llm.engine.max_num_batched_tokens >= llm.engine.max_model_len == 300
    [out] = llm.generate([[7] * 280], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    # the model's context length (2048) is known only to the engine: it applies the rule too
    with pytest.raises(InvalidRequestError) as e:
        LLM(
            TINY,
            device="cpu",
            progress=False,
            enable_chunked_prefill=False,
            max_num_batched_tokens=100,
        )
    assert e.value.param == "max_num_batched_tokens" and "2048" in str(e.value)


def test_server_seeds_samples_the_same_way() -> None:
    pytest.importorskip("fastapi")
    from specserve.server.prepare import _with_seed

    for seed, i in [(0, 1), (1234, 2), (2**62, 7)]:  # the server's i-th sample (i >= 1)
        base = SamplingParams(seed=seed)
        assert _with_seed(base, seed, i).seed == derive_seed(seed, i) and base.seed == seed
