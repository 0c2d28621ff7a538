"""Fault isolation: which requests' inputs made a step fail.

A step runs many requests at once, so an exception while building or running it (a sampler
table that overflows, an index out of range) names none of them. The engine rolls the failed
step back (Scheduler.roll_back: the KV ledger returns to where the step began, nothing was
emitted) and bisects: it re-runs the step's requests in groups, halving each group that fails,
until the requests that fail alone are known. A group that passes has simply run its step (its
outputs are the ones it would have had in the full batch: same KV, same RNG counters), so the
search costs no work, only a few smaller steps. The requests outside the search wait meanwhile.

Culprits are ended with finish_reason "error" once the search is over. When at least two
requests fail and none passes, the inputs do not explain the failure (the engine itself is
broken, or the failure depends on no single request): EngineStepError, so the caller recovers
as from any engine failure instead of failing requests one by one forever.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.engine.sequence import Sequence


class EngineStepError(RuntimeError):
    """A step failed and no request's inputs explain it (each of its requests fails alone)."""


@dataclass
class FaultIsolation:
    groups: list[list[Sequence]]  # still to test, the next one first
    culprits: list[tuple[Sequence, BaseException]] = field(default_factory=list)
    num_cleared: int = 0  # requests that ran their step in a group that passed

    @classmethod
    def start(cls, seqs: list[Sequence]) -> FaultIsolation:
        """A search over a failed step's requests: its halves are the first groups (re-running
        the whole step first would only fail again when a request is to blame)."""
        return cls(_halves(seqs))

    def add(self, seqs: list[Sequence]) -> None:
        """Another failed step's requests join the search (those not suspected already)."""
        known = {id(s) for g in self.groups for s in g} | {id(s) for s, _ in self.culprits}
        self.groups += _halves([s for s in seqs if id(s) not in known])

    def next_group(self) -> list[Sequence] | None:
        """The group the next step runs alone; requests that ended meanwhile (aborted) drop
        out. None: the search is over."""
        while self.groups:
            group = [s for s in self.groups[0] if not s.is_finished]
            if group:
                self.groups[0] = group
                return group
            self.groups.pop(0)
        return None

    def step_failed(self, group: list[Sequence], ran: list[Sequence], exc: BaseException) -> None:
        """The step of `group` failed; `ran` are the members it held (the others did not fit,
        they stay suspects). One request failing alone is a culprit; more are halved."""
        ids = {id(s) for s in ran}
        self.groups.pop(0)
        rest = [s for s in group if id(s) not in ids]
        if rest:
            self.groups.insert(0, rest)
        if len(ran) == 1:
            self.culprits.append((ran[0], exc))
        else:
            self.groups[0:0] = _halves(ran)

    def step_passed(self, group: list[Sequence], sampled: list[Sequence]) -> None:
        """The step of `group` went through the ledger. Members that sampled in it are cleared;
        a member that only ran a prompt chunk has not reached the sampler yet and stays."""
        ids = {id(s) for s in sampled}
        self.num_cleared += sum(id(s) in ids for s in group)
        rest = [s for s in group if id(s) not in ids and not s.is_finished]
        if rest:
            self.groups[0] = rest
        else:
            self.groups.pop(0)

    def verdict(self) -> list[tuple[Sequence, BaseException]]:
        """At the end of the search: the culprits still unfinished, or EngineStepError when
        several requests failed and none passed."""
        culprits = [(s, e) for s, e in self.culprits if not s.is_finished]
        if len(culprits) >= 2 and self.num_cleared == 0:
            first = culprits[0][1]
            raise EngineStepError(
                f"a step failed and each of its {len(culprits)} requests fails alone too: an "
                f"engine fault, not a request's ({type(first).__name__}: {first})"
            ) from first
        return culprits


def _halves(seqs: list[Sequence]) -> list[list[Sequence]]:
    if len(seqs) <= 1:
        return [seqs] if seqs else []
    half = len(seqs) // 2
    return [seqs[:half], seqs[half:]]
