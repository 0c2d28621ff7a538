"""Each step's draft rows with drafters on the device: the verify budget's choice per request
from the confidences read back one step old, or, where the device splits the step
(runner/device_split.py), only its total, each request offered its room.

Called by the engine before it schedules a step (LLMEngine._step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specserve import env
from specserve.engine.draft_rows import draft_rows
from specserve.engine.sequence import Sequence
from specserve.runner.sampler_inputs import tail_compatible

if TYPE_CHECKING:
    from specserve.llm_engine import LLMEngine


def plan_rows(engine: LLMEngine) -> tuple[dict[int, int] | None, int | None]:
    """Each decode-ready request's draft rows in the next step, by slot (None: k each, no
    budget), and for a device split the step's total rows (each request's are then its most)."""
    dd, sched = engine.device_drafting, engine.scheduler
    if dd is None or engine.budget is None:
        return None, None
    ready = sched.decode_ready()
    k, limit, max_len = engine.slot_pool.k, engine.max_num_batched_tokens, engine.max_model_len
    room = [draft_rows(s, k, limit, max_len) for s in ready]
    keep = dd.allot(ready, engine.budget, room)
    total = None
    if any(keep) and _splits(engine, ready):
        # the budget fixes the total from confidences one step old; the device shares it among
        # the requests by the newest, each offered its room (all counted as in flight)
        total = len(ready) + sum(keep)
        keep = [m if dd.drafted[s.slot] else 0 for s, m in zip(ready, room)]
    return {s.slot: m for s, m in zip(ready, keep)}, total


def _splits(engine: LLMEngine, ready: list[Sequence]) -> bool:
    """May the next step, of these decode-ready requests, be a device-split one: all of the
    running requests, none waiting to be admitted beside them, each sampling in the graph tail
    with drafts on the device (step_launch.py checks again at launch)."""
    graphs, sched = engine.runner.graphs, engine.scheduler
    return (
        env.settings.device_split
        and graphs is not None
        and graphs.tail is not None
        and graphs.tail.drafting is not None
        and engine._worker is None
        and len(ready) == len(sched.running)
        and (not sched.waiting or len(sched.running) >= engine.config.max_num_seqs)
        and engine.device_drafting.tail_ready(ready)
        and tail_compatible(ready)
    )
