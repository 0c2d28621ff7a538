"""Helpers shared by the verify-budget tests."""

from specserve.speculative.step_cost import MIN_REAL, StepCostCurve


def observe(curve: StepCostCurve, rows: int, seconds: float, **fixed: int) -> None:
    """Enough real steps of one bucket for them to replace its start-up samples."""
    for _ in range(MIN_REAL):
        curve.record(rows, seconds, **fixed)
