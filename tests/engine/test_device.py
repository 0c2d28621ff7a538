"""The collector and engines: a CUDA engine freezes what start-up built, so an engine dropped
afterwards must be released before the next one sizes its KV cache (else it stays for good)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from specserve.engine.device import freeze_startup_objects, release_dropped_engines


class _Engine:  # stands for an engine: its parts point back at it, as LLMEngine's do
    def __init__(self) -> None:
        self.weights = torch.zeros(1024)
        self.part = {"engine": self}


@pytest.fixture(autouse=True)
def _unfrozen():
    yield
    gc.unfreeze()


def test_a_dropped_engine_frozen_at_start_up_is_released():
    engine = _Engine()
    ref = weakref.ref(engine)
    freeze_startup_objects()
    del engine
    gc.collect()
    assert ref() is not None  # the negative control: frozen cycles survive a collection
    release_dropped_engines(torch.device("cpu"))
    assert ref() is None
    assert gc.get_freeze_count() == 0


def test_an_engine_still_held_survives_the_release():
    engine = _Engine()
    freeze_startup_objects()
    release_dropped_engines(torch.device("cpu"))
    assert engine.part["engine"] is engine and engine.weights.numel() == 1024


def test_nothing_frozen_is_a_no_op():
    gc.unfreeze()
    release_dropped_engines(torch.device("cpu"))
    assert gc.get_freeze_count() == 0


def test_a_real_engine_dropped_after_the_freeze_is_collected_by_the_next():
    """The CPU engine does not freeze; freezing by hand after building one stands for CUDA."""
    from specserve import LLM

    first = LLM("dummy:tiny", max_num_seqs=2, max_model_len=64, progress=False)
    ref = weakref.ref(first.engine)
    freeze_startup_objects()
    del first
    gc.collect()
    assert ref() is not None  # negative control: the engine's cycles were frozen
    second = LLM("dummy:tiny", max_num_seqs=2, max_model_len=64, progress=False)
    assert ref() is None
    assert second.engine is not None
