"""Intra-op thread sizing of CPU engines ($SPECSERVE_CPU_THREADS, engine/cpu_threads.py)."""

from __future__ import annotations

import pytest
import torch

from specserve import env
from specserve.engine.cpu_threads import apply_cpu_threads, available_cores, cpu_threads


@pytest.mark.parametrize(
    ("setting", "cores", "want"),
    [("auto", 1, 1), ("auto", 2, 1), ("auto", 16, 15), ("keep", 8, None), ("3", 2, 3)],
)
def test_thread_count_leaves_a_core_to_the_host_loop(setting, cores, want) -> None:
    assert cpu_threads(setting, cores) == want


@pytest.mark.parametrize("setting", ["0", "-2", "many"])
def test_bad_settings_name_the_variable(setting: str) -> None:
    with pytest.raises(ValueError, match="SPECSERVE_CPU_THREADS|invalid literal"):
        cpu_threads(setting, 4)


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_apply_sets_torch_threads_for_cpu_engines_only(restore_threads) -> None:
    with env.override(cpu_threads="auto"):
        apply_cpu_threads("cpu")
        assert torch.get_num_threads() == max(1, available_cores() - 1)
    torch.set_num_threads(1)
    with env.override(cpu_threads="keep"):
        apply_cpu_threads("cpu")
        assert torch.get_num_threads() == 1
    with env.override(cpu_threads="2"):
        apply_cpu_threads("cuda:0")  # a CUDA engine's host threads are left alone
        assert torch.get_num_threads() == 1
        apply_cpu_threads("cpu")
        assert torch.get_num_threads() == 2


def test_an_engine_built_on_the_cpu_gets_the_count(restore_threads) -> None:
    from tests.engine.conftest import make_llm

    torch.set_num_threads(1)
    with env.override(cpu_threads="2"):
        llm = make_llm(max_num_seqs=2)
    assert torch.get_num_threads() == 2
    out = llm.generate([[5, 6, 7]], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0
