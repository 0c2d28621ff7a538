"""No Triton kernel compiles while serving: a variant first met inside a step stalls it for
hundreds of milliseconds to a second (Triton specialises on ints equal to 1 or divisible by 16,
on pointer alignment, and on constexpr tile choices). Every drafter on the device, the auto
budget's plain and drafting steps, prompt chunks of every length class and the sampling modes
users send, on the default model's shape in bf16 (the GEMV and the rows kernel run there).

    pytest -m gpu tests/gpu/test_compiles.py
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu

HEAD = Path(__file__).resolve().parents[2] / "specserve" / "heads" / "smollm2-135m-instruct"
GOLD = [random.Random(1).randrange(3, 49152) for _ in range(300)]
SPECS = {
    "off": None,
    "golden": {"method": "golden", "num_speculative_tokens": 4, "acceptance_rate": 0.7},
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    "eagle3": {"method": "eagle3", "model": str(HEAD), "num_speculative_tokens": 5},
    "eagle3-fixed": {
        "method": "eagle3",
        "model": str(HEAD),
        "num_speculative_tokens": 5,
        "verify_budget": "off",
    },
}


def triton_variants() -> dict[str, int]:
    """Compiled variants of every Triton kernel of the specserve modules imported so far."""
    from triton.runtime.jit import JITFunction

    from tests.gpu.test_triton_attention import compiled_variants

    out: dict[str, int] = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("specserve.") or mod is None:
            continue
        for attr, obj in list(vars(mod).items()):
            fn = obj
            for _ in range(3):  # an autotuner or heuristics wraps the JITFunction
                if isinstance(fn, JITFunction):
                    break
                fn = getattr(fn, "fn", None)
            if isinstance(fn, JITFunction):
                out[f"{name}.{attr}"] = compiled_variants(fn)
    return out


def _workload(seed: int, golden: bool) -> tuple[list[list[int]], list[SamplingParams]]:
    """Request counts 1..8, prompts of 2 to 700 tokens (chunked at 256 rows), outputs of 3 to
    60 tokens, greedy and sampled (temperature, top-p, top-k, min-p, a seed, penalties)."""
    rng = random.Random(seed)
    prompts, params = [], []
    gold = {"golden_token_ids": GOLD} if golden else {}
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_p=0.9),
        dict(temperature=1.0, top_k=20),
        dict(temperature=0.7, min_p=0.05, seed=7),
        dict(temperature=0.0, repetition_penalty=1.1),
    ]
    for n in (1, 3, 8, 2, 5):
        for _ in range(n):
            length = rng.choice([2, 7, 16, 33, 130, 256, 700])
            prompts.append([rng.randrange(3, 49152) for _ in range(length)])
            kind = rng.choice(kinds)
            params.append(
                SamplingParams(max_tokens=rng.randrange(3, 60), ignore_eos=True, **gold, **kind)
            )
    return prompts, params


@pytest.mark.parametrize("spec", list(SPECS))
def test_no_triton_kernel_compiles_after_a_warm_round(spec: str) -> None:
    """One round of the workload warms what start-up leaves; a second round of other request
    counts, lengths and sampling modes compiles nothing (the names of any kernel that did
    are in the failure, with the variants start-up left)."""
    if not torch.cuda.is_available():
        pytest.skip("Triton compiles only for a CUDA device")
    llm = LLM(
        "dummy:smollm2-135m",
        dtype="bfloat16",
        max_num_seqs=8,
        max_model_len=1024,
        max_num_batched_tokens=256,
        kv_cache_memory_gb=1.0,
        speculative_config=SPECS[spec],
        progress=False,
    )
    start = triton_variants()
    prompts, params = _workload(0, spec == "golden")
    for p, sp in zip(prompts, params):  # one at a time, then all at once
        llm.generate([p], sp, use_tqdm=False)
    llm.generate(prompts, params, use_tqdm=False)
    warm = triton_variants()
    prompts, params = _workload(1, spec == "golden")
    llm.generate(prompts, params, use_tqdm=False)
    llm.generate(prompts[::2], params[::2], use_tqdm=False)
    after = triton_variants()
    grown = {k: (start.get(k, 0), warm[k], v) for k, v in after.items() if v != warm.get(k, 0)}
    first = {k: (start.get(k, 0), v) for k, v in warm.items() if v != start.get(k, 0)}
    print(f"{spec}: compiled after start-up, in the warm round: {first}")
    assert not grown, f"{spec}: compiled while serving (start-up, warm round, after): {grown}"
