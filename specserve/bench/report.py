"""Benchmark results: the per-side record, environment facts, the printed table, JSON and PNG."""

from __future__ import annotations

import json
import os
import platform
import statistics
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


@dataclass
class RunResult:
    """One side's numbers (specserve or a baseline) over the same request list."""

    name: str
    mode: str  # "batched" | "batch1"
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    dtype: str = ""
    device: str = ""
    batch_size: int | None = None
    # batch-1 only: each request's decode rate, (output tokens - 1) / (last - first token time)
    per_request_decode_tok_s: list[float] = field(default_factory=list)
    # prompt tokens served from the prefix cache (specserve only; HF recomputes every prompt)
    cached_prompt_tokens: int | None = None

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def total_tok_s(self) -> float:
        tokens = self.prompt_tokens + self.output_tokens
        return tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def median_decode_tok_s(self) -> float | None:
        rates = self.per_request_decode_tok_s
        return statistics.median(rates) if rates else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        # derived rates go into the JSON too, so a reader needs no arithmetic
        d["output_tok_s"] = self.output_tok_s
        d["total_tok_s"] = self.total_tok_s
        d["median_decode_tok_s"] = self.median_decode_tok_s
        return d


def ratios(ours: RunResult, base: RunResult) -> dict[str, float | None]:
    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    return {
        "output_tok_s": div(ours.output_tok_s, base.output_tok_s),
        "total_tok_s": div(ours.total_tok_s, base.total_tok_s),
        "median_decode_tok_s": div(ours.median_decode_tok_s, base.median_decode_tok_s),
    }


def median_interval(
    xs: list[float], level: float = 0.9, draws: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """(median, low, high): the median of paired per-repeat ratios and its bootstrap interval
    (the medians of `draws` resamples with replacement, their central `level` share)."""
    import random

    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(draws))
    cut = int((1.0 - level) / 2 * draws)
    return statistics.median(xs), meds[cut], meds[draws - 1 - cut]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def software_info() -> dict[str, str]:
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": str(torch.version.cuda),
    }


def timestamp() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_json(report: dict[str, Any], path: str | os.PathLike[str]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(sides: list[RunResult], baseline: RunResult | None = None) -> str:
    """Fixed-width table; with a baseline, a last row gives specserve/baseline ratios."""
    batch1 = any(s.mode == "batch1" for s in sides)
    head = ["", "requests", "prompt tok", "output tok", "seconds", "output tok/s", "total tok/s"]
    if batch1:
        head.append("median decode tok/s")
    rows = [head]
    for s in sides:
        row = [s.name, str(s.num_requests), str(s.prompt_tokens), str(s.output_tokens)]
        row += [f"{s.seconds:.2f}", f"{s.output_tok_s:.1f}", f"{s.total_tok_s:.1f}"]
        if batch1:
            row.append(_fmt(s.median_decode_tok_s, ".1f"))
        rows.append(row)
    if baseline is not None and sides and sides[0] is not baseline:
        r = ratios(sides[0], baseline)
        row = [f"{sides[0].name} / {baseline.name}", "", "", "", ""]
        row += [_fmt(r["output_tok_s"], ".2f") + "x", _fmt(r["total_tok_s"], ".2f") + "x"]
        if batch1:
            row.append(_fmt(r["median_decode_tok_s"], ".2f") + "x")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def format_speculation(spec: dict[str, Any]) -> str:
    lines = ["speculation:"]
    for key, val in spec.items():
        if isinstance(val, float):
            val = f"{val:.3f}"
        elif isinstance(val, list):
            val = "[" + ", ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in val) + "]"
        lines.append(f"  {key}: {val}")
    return "\n".join(lines)


def plot_report(sides: list[RunResult], path: str | os.PathLike[str], title: str = "") -> None:
    """Bars of output tok/s per side; in batch-1 mode also each request's decode tok/s."""
    import matplotlib

    matplotlib.use("Agg")  # headless: benchmarks run on servers without a display
    import matplotlib.pyplot as plt

    batch1 = any(s.per_request_decode_tok_s for s in sides)
    fig, axes = plt.subplots(1, 2 if batch1 else 1, figsize=(11 if batch1 else 6, 4), squeeze=False)
    ax = axes[0][0]
    names = [s.name for s in sides]
    vals = [s.output_tok_s for s in sides]
    bars = ax.bar(names, vals, color=["tab:blue", "tab:gray", "tab:orange"][: len(sides)])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("output tokens / s")
    ax.set_title("throughput" if not batch1 else "output tok/s (one request at a time)")
    if batch1:
        ax2 = axes[0][1]
        for s in sides:
            if s.per_request_decode_tok_s:
                xs = range(len(s.per_request_decode_tok_s))
                ax2.plot(xs, s.per_request_decode_tok_s, "o-", ms=3, label=s.name)
        ax2.set_xlabel("request")
        ax2.set_ylabel("decode tokens / s")
        ax2.set_title("batch-1 decode rate per request")
        ax2.legend()
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
