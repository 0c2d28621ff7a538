"""`specserve bench cpu-profile` on a tiny random model: every part timed, timers removed after."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.bench.cpu_profile import PARTS, PROJECTIONS, profile_workload
from specserve.bench.datasets import random_requests
from specserve.cli.bench import main


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_cpu_profile_reports_every_part_of_a_decode_step(tmp_path: Path, quantization) -> None:
    out = tmp_path / "profile.json"
    argv = ["cpu-profile", "--model", "dummy:tiny", "--device", "cpu", "--batch-sizes", "1,3"]
    argv += ["--input-len", "8", "--max-tokens", "6", "--json", str(out)]
    if quantization:
        argv += ["--quantization", quantization]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["quantization"] == quantization
    assert set(report["workloads"]) == {"batch1", "batch3"}
    for name, w in report["workloads"].items():
        assert set(w["parts_ms"]) == set(PARTS)
        # prefill steps are left out: the remaining steps are decode steps of <= b rows
        assert w["decode_steps"] >= 4
        assert 1 <= w["rows_per_decode_step"] <= int(name.removeprefix("batch"))
        for p in PROJECTIONS:
            assert w["parts_ms"][f"gemm.{p}"] > 0
        assert w["parts_ms"]["gemm.lm_head"] > 0 and w["parts_ms"]["attention"] > 0
        assert w["decode_step_ms"] > 0 and w["plain_output_tok_s"] > 0
        assert sum(w["parts_share"].values()) == pytest.approx(1.0)


def test_instrumentation_is_removed_after_the_run() -> None:
    from tests.engine.conftest import make_llm

    llm = make_llm(max_num_seqs=2)
    eng = llm.engine
    model = eng.runner.model
    reqs = random_requests(2, (5, 5), 4, 1000, seed=0)
    profile_workload(llm, reqs)
    for obj, attr in [
        (eng, "step"),
        (eng, "add_request"),
        (eng.scheduler, "schedule"),
        (eng.runner, "forward"),
        (eng.runner, "prepare"),
        (eng.sampler, "plan"),
        (eng.ledger, "process_outputs"),
        (model, "compute_logits"),
    ]:
        assert attr not in vars(obj), attr  # the class's method again
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
