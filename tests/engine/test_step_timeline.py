"""The device timeline's step kinds (runner/timeline.py, step_launch.LaunchedStep.kind), on the
CPU with CUDA events stood in by host clocks: every launched step is recorded once, prompt
steps apart from decode ones, a decode step verifying drafts apart from a plain one."""

from __future__ import annotations

import time

import pytest
import torch

from specserve import LLM, SamplingParams


class _Event:
    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _Event) -> float:
        return (end.t - self.t) * 1e3


@pytest.mark.parametrize("spec", [None, {"method": "golden", "num_speculative_tokens": 3}])
def test_every_step_is_timed_once_by_its_kind(monkeypatch, spec) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    llm = LLM("dummy:tiny", device="cpu", dtype="float32", max_num_seqs=4, max_model_len=128,
              kv_cache_memory_gb=0.02, speculative_config=spec, progress=False)  # fmt: skip
    eng = llm.engine
    eng.timeline._cuda = True  # the stand-in events
    eng.timeline.start()
    steps = eng.num_steps
    gold = list(range(300, 340))
    params = SamplingParams(max_tokens=12, ignore_eos=True, golden_token_ids=gold)
    llm.generate([[5, 6, 7], [8, 9, 10, 11]], params, use_tqdm=False)
    kinds = eng.timeline.by_kind()
    decode = eng.timeline.summary("decode")  # by the tag each step began with
    eng.timeline.stop()
    assert decode.num_steps == sum(n for k, (n, _, _) in kinds.items() if k != "prompt")
    assert sum(n for n, _, _ in kinds.values()) == eng.num_steps - steps
    assert kinds["prompt"][0] >= 1 and all(ms >= 0 for _, ms, _ in kinds.values())
    assert all(wall > 0 for _, _, wall in kinds.values())  # launch to launch, host clock
    assert set(kinds) <= {"prompt", "plain", "verify", "drafting"}
    assert ("verify" in kinds) == (spec is not None) and "drafting" not in kinds
