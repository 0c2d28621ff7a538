"""The host overhead of synchronous steps, kept by load."""

import statistics

import pytest

from specserve.speculative.host_overhead import MIN_SAMPLES, WINDOW, HostOverhead, load_range


def test_load_ranges_are_powers_of_two():
    assert [load_range(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 65, 256)] == [
        0, 1, 2, 2, 3, 3, 4, 6, 7, 8,
    ]  # fmt: skip


def test_each_load_is_priced_by_its_own_samples_not_the_newest_ones():
    """An interleaved sweep: steps of 16 requests (0.6 ms of host work), then 64 (1.5 ms). The
    price at 16 requests stays 16's, and 64's is its own from its third sample on; before that
    the nearest load range with enough samples stands in."""
    h = HostOverhead()
    assert h.at(16) == 0.0  # nothing measured
    for _ in range(10):
        h.record(0.6e-3, 16)
    h.record(1.5e-3, 64)
    assert h.at(64) == pytest.approx(0.6e-3)  # one sample at 64: 16's range stands in
    h.record(1.4e-3, 64)
    h.record(1.6e-3, 64)
    assert h.at(64) == pytest.approx(1.5e-3)
    assert h.at(33) == pytest.approx(1.5e-3)  # the same range
    assert h.at(16) == pytest.approx(0.6e-3)
    assert h.at(256) == pytest.approx(1.5e-3)  # nearest range with samples
    assert h.latest == pytest.approx(1.5e-3)
    h.record(-1.0, 64)  # a negative gap (clock quirk) is no sample
    assert h.at(64) == pytest.approx(1.5e-3)


def test_a_window_keeps_the_newest_samples_and_negative_ones_are_dropped():
    h = HostOverhead()
    samples = [i * 1e-4 for i in range(40)]
    for s in samples:
        h.record(s, 8)
    assert h.at(8) == pytest.approx(statistics.median(samples[-WINDOW:]))


def test_few_samples_count_before_any_range_has_enough():
    h = HostOverhead()
    h.record(2e-3, 4)
    assert h.at(4) == h.at(128) == pytest.approx(2e-3)


def test_renewal_keeps_the_old_median_until_enough_new_samples_replace_it():
    h = HostOverhead()
    for _ in range(WINDOW):
        h.record(1e-3, 32)
    h.renew()
    for _ in range(MIN_SAMPLES - 1):
        h.record(4e-3, 32)
        assert h.at(32) == pytest.approx(1e-3)
    h.record(4e-3, 32)
    assert h.at(32) == pytest.approx(4e-3)  # the old window is gone, not outvoted
