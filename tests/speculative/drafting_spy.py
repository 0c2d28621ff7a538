"""Helpers for the model drafters' drafting choice (VerifyBudget.plan): replace the budget's
choice by a seeded coin, and log the drafts each drafting step wrote."""

from __future__ import annotations

import random

from specserve.speculative.verify_budget import StepPlan


def coin_drafting(llm, seed: int, p: float = 0.5, verify: bool = True) -> list[bool]:
    """The budget drafts where it may with probability p and keeps every draft a request has
    (verify=False: none, so a run drafts at every length); returns the choices made (where
    it might have drafted)."""
    budget, k = llm.engine.budget, llm.engine.slot_pool.k
    assert budget is not None and budget.drafting
    rng, choices = random.Random(seed), []

    def plan(conf, base_rows, room, has_drafts, may_draft) -> StepPlan:
        draft = may_draft and rng.random() < p
        if may_draft:
            choices.append(draft)
        keep = [min(int(r), k) if h and verify else 0 for r, h in zip(room, has_drafts)]
        return StepPlan(keep, draft)

    budget.plan = plan
    return choices


def log_drafts(llm) -> dict[tuple[str, int], list[int]]:
    """(request id, its length after the step) -> the drafts the step wrote for the next."""
    dd = llm.engine.device_drafting
    orig, log = dd.step_hook, {}

    def step_hook(seqs, *args):
        hook = orig(seqs, *args)
        if hook is None:
            return None
        rids = [s.request_id for s in seqs]

        def logged(plan, result, seq_len) -> None:
            hook(plan, result, seq_len)
            for rid, slot, n in zip(rids, plan.slots.tolist(), seq_len.tolist()):
                log[(rid, n)] = dd.pool.draft_ids[slot].tolist()

        return logged

    dd.step_hook = step_hook
    return log
