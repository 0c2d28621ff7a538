"""Prometheus text exposition for /metrics, written by hand (no prometheus_client dependency).

Request-level series (latencies, finished requests) are observed by the engine thread as outputs
land; engine-level series (queue sizes, KV usage, speculation counters) come from the snapshot
the engine thread publishes after each step, so a scrape never touches engine state that another
thread is mutating.
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass, field

PREFIX = "specserve:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


def _labels(pairs: dict[str, str]) -> str:
    if not pairs:
        return ""
    esc = (
        f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
        for k, v in pairs.items()
    )
    return "{" + ",".join(esc) + "}"


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)  # last one: +Inf

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.total += v
        self.n += 1

    def render(self, labels: dict[str, str]) -> list[str]:
        out = [f"# HELP {PREFIX}{self.name} {self.help}", f"# TYPE {PREFIX}{self.name} histogram"]
        cum = 0
        for le, c in zip((*self.buckets, math.inf), self.counts):
            cum += c
            out.append(f"{PREFIX}{self.name}_bucket{_labels({**labels, 'le': _fmt(le)})} {cum}")
        out.append(f"{PREFIX}{self.name}_sum{_labels(labels)} {_fmt(self.total)}")
        out.append(f"{PREFIX}{self.name}_count{_labels(labels)} {self.n}")
        return out


@dataclass
class EngineSnapshot:
    """Engine-level numbers, copied by the engine thread after each step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_steps: int = 0
    generation_tokens: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verified_per_position: list[int] = field(default_factory=list)
    spec_accepted_per_position: list[int] = field(default_factory=list)
    # the verify budget's choices (zeros without one): draft rows offered and kept, the
    # survivals of those kept (expected accepted tokens), requests per chosen query length
    budget_offered_draft_tokens: int = 0
    budget_chosen_draft_tokens: int = 0
    budget_expected_accepted_tokens: float = 0.0
    budget_seqlens_q: dict[int, int] = field(default_factory=dict)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.labels = {"model_name": model_name}
        self._lock = threading.Lock()
        self.ttft = Histogram(
            "time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS
        )
        self.itl = Histogram(
            "inter_token_latency_seconds",
            "Time between two engine steps that emitted tokens for the same request.",
            ITL_BUCKETS,
        )
        self.e2e = Histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last token.", E2E_BUCKETS
        )
        self.tpot = Histogram(
            "request_time_per_output_token_seconds",
            "Per request: (last token time - first token time) / (output tokens - 1).",
            ITL_BUCKETS,
        )
        self.finished: dict[str, int] = {}  # finish_reason -> count
        self.errors = 0
        self.prompt_tokens = 0
        self.snapshot = EngineSnapshot()

    # -- called from the engine thread ------------------------------------------------------
    def on_first_token(self, ttft: float) -> None:
        with self._lock:
            self.ttft.observe(ttft)

    def on_step_tokens(self, gap: float) -> None:
        with self._lock:
            self.itl.observe(gap)

    def on_added(self, num_prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += num_prompt_tokens

    def on_finished(
        self, reason: str, e2e: float, first_to_last: float | None, num_output_tokens: int
    ) -> None:
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.e2e.observe(e2e)
            if first_to_last is not None and num_output_tokens > 1:
                self.tpot.observe(first_to_last / (num_output_tokens - 1))

    def on_aborted(self) -> None:
        with self._lock:
            self.finished["abort"] = self.finished.get("abort", 0) + 1

    def on_error(self) -> None:
        with self._lock:
            self.errors += 1

    def publish(self, snap: EngineSnapshot) -> None:
        self.snapshot = snap  # one reference assignment: readers see the old or the new one

    # -- called from the HTTP thread --------------------------------------------------------
    def render(self) -> str:
        lab = self.labels
        s = self.snapshot
        lines: list[str] = []

        def scalar(
            name: str, kind: str, help: str, value: float, extra: dict | None = None
        ) -> None:
            lines.append(f"# HELP {PREFIX}{name} {help}")
            lines.append(f"# TYPE {PREFIX}{name} {kind}")
            lines.append(f"{PREFIX}{name}{_labels({**lab, **(extra or {})})} {_fmt(value)}")

        def per_key(name: str, kind: str, help: str, key: str, values: dict[str, float]) -> None:
            lines.append(f"# HELP {PREFIX}{name} {help}")
            lines.append(f"# TYPE {PREFIX}{name} {kind}")
            for k, v in values.items():
                lines.append(f"{PREFIX}{name}{_labels({**lab, key: k})} {_fmt(v)}")

        with self._lock:
            scalar("num_requests_running", "gauge", "Requests in the running batch.", s.num_running)
            scalar(
                "num_requests_waiting", "gauge", "Requests waiting to be scheduled.", s.num_waiting
            )
            scalar("kv_cache_usage_perc", "gauge", "Share of KV blocks in use (0-1).", s.kv_usage)
            scalar("num_kv_blocks_free", "gauge", "Free KV cache blocks.", s.num_free_blocks)
            scalar("num_kv_blocks", "gauge", "Usable KV cache blocks.", s.num_blocks)
            scalar("engine_steps_total", "counter", "Engine steps that ran a forward.", s.num_steps)
            scalar("prompt_tokens_total", "counter", "Prompt tokens admitted.", self.prompt_tokens)
            scalar(
                "generation_tokens_total",
                "counter",
                "Tokens emitted by the engine.",
                s.generation_tokens,
            )
            finished = {"stop": 0, "length": 0, "abort": 0, **self.finished}
            per_key(
                "request_success_total",
                "counter",
                "Finished requests by finish reason.",
                "finished_reason",
                finished,
            )
            scalar(
                "request_errors_total",
                "counter",
                "Requests failed by an internal error.",
                self.errors,
            )
            for h in (self.ttft, self.itl, self.tpot, self.e2e):
                lines.extend(h.render(lab))
            scalar(
                "spec_decode_num_drafts_total",
                "counter",
                "Verify steps with drafts.",
                s.spec_drafts,
            )
            scalar(
                "spec_decode_num_draft_tokens_total",
                "counter",
                "Draft tokens verified.",
                s.spec_draft_tokens,
            )
            scalar(
                "spec_decode_num_accepted_tokens_total",
                "counter",
                "Draft tokens accepted and emitted.",
                s.spec_accepted_tokens,
            )
            per_key(
                "spec_decode_num_verified_tokens_per_pos_total",
                "counter",
                "Drafts verified at each draft position.",
                "position",
                {str(i): v for i, v in enumerate(s.spec_verified_per_position)},
            )
            per_key(
                "spec_decode_num_accepted_tokens_per_pos_total",
                "counter",
                "Drafts accepted at each draft position.",
                "position",
                {str(i): v for i, v in enumerate(s.spec_accepted_per_position)},
            )
            scalar(
                "spec_decode_verify_budget_offered_draft_tokens_total",
                "counter",
                "Drafts the drafter proposed to the verify budget.",
                s.budget_offered_draft_tokens,
            )
            scalar(
                "spec_decode_verify_budget_chosen_draft_tokens_total",
                "counter",
                "Drafts the verify budget kept for verification.",
                s.budget_chosen_draft_tokens,
            )
            scalar(
                "spec_decode_verify_budget_expected_accepted_tokens_total",
                "counter",
                "Sum of the survival probabilities of the drafts kept.",
                s.budget_expected_accepted_tokens,
            )
            per_key(
                "spec_decode_verify_budget_seqlen_q_total",
                "counter",
                "Requests per query length the verify budget chose (1 + drafts kept).",
                "seqlen_q",
                {str(n): v for n, v in s.budget_seqlens_q.items()},
            )
        return "\n".join(lines) + "\n"


def parse_prometheus(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample line (the bench and tests read /metrics back)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def sample(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of every sample of `name` (prefix added) whose labels include `labels`."""
    total = 0.0
    for key, v in metrics.items():
        base, _, rest = key.partition("{")
        if base != PREFIX + name:
            continue
        if all(f'{k}="{val}"' in rest for k, val in labels.items()):
            total += v
    return total
