"""`specserve bench plot`: throughput reports (JSON from `bench throughput --baseline hf`) into
one PNG, one panel per report, specserve vs HF bars with the ratio written above them. Also the
golden-curve chart (`plot_golden_curve`, drawn from its JSON report), the speculation sweep's
tok/s-vs-concurrency lines (`plot_sweep`) and the serving benchmark's latency panels
(`plot_serve_report`).

    specserve bench plot b1_llama8b.json b1_smollm2.json throughput256_llama8b.json \
        --out specserve_vs_hf.png

Batch-1 reports compare the median per-request decode rate (what a user of one stream sees);
batched reports compare output tokens per second over the whole run. Each panel has its own
y-axis: a batch-1 rate and a 256-request throughput differ by ~50x.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Comparison:
    label: str  # panel title: model, workload
    metric: str  # y-axis label
    ours: float
    baseline: float | None
    baseline_name: str
    source: str  # the JSON file

    @property
    def ratio(self) -> float | None:
        return self.ours / self.baseline if self.baseline else None


def _label(report: dict[str, Any]) -> str:
    s = report.get("settings", {})
    side = report.get("specserve", {})
    model = str(report.get("model") or s.get("model") or "default model")
    model = model.removeprefix("dummy:") + (" (random weights)" if "dummy:" in model else "")
    n = side.get("num_requests", s.get("num_prompts", "?"))
    if s.get("input_len_min") and s.get("dataset") == "random":
        prompt = f"prompt {s['input_len_min']}-{s.get('input_len')}"
    elif s.get("dataset") == "random":
        prompt = f"prompt {s.get('input_len')}"
    else:
        prompt = str(s.get("dataset", ""))
    out = s.get("max_tokens", "?")
    if side.get("mode") == "batch1":
        return f"{model}\nbatch 1, {n} requests, {prompt} + {out} tokens"
    return f"{model}\n{n} requests (batch {side.get('batch_size', '?')}), {prompt} + {out} tokens"


def comparison_from_report(report: dict[str, Any], source: str = "") -> Comparison:
    """The numbers one panel shows. Raises ValueError for a report of another benchmark."""
    if report.get("benchmark") != "throughput" or "specserve" not in report:
        raise ValueError(f"{source or 'report'}: not a `bench throughput` report")
    ours, base = report["specserve"], report.get("baseline") or None
    batch1 = ours.get("mode") == "batch1"
    key = "median_decode_tok_s" if batch1 and ours.get("median_decode_tok_s") else "output_tok_s"
    if base is not None and base.get(key) is None:
        key = "output_tok_s"  # compare like with like
    return Comparison(
        label=_label(report),
        metric="median decode tok/s (batch 1)" if key == "median_decode_tok_s" else "output tok/s",
        ours=float(ours[key]),
        baseline=float(base[key]) if base and base.get(key) is not None else None,
        baseline_name=str(base.get("name", "baseline")) if base else "",
        source=source,
    )


def load_comparisons(paths: list[str]) -> tuple[list[Comparison], list[str]]:
    """Comparisons of the throughput reports among `paths`, and a note for each file skipped."""
    comps, skipped = [], []
    for path in paths:
        try:
            report = json.loads(Path(path).read_text(encoding="utf-8"))
            comps.append(comparison_from_report(report, path))
        except (OSError, ValueError, KeyError, TypeError) as e:
            skipped.append(f"{path}: {e}")
    return comps, skipped


def _where(paths: list[str]) -> str:
    """GPU (or CPU) named in the first report that says, for the figure title."""
    for path in paths:
        try:
            hw = json.loads(Path(path).read_text(encoding="utf-8")).get("hardware", {})
        except (OSError, ValueError):
            continue
        if hw.get("gpus") or hw.get("cpu"):
            return _where_from(hw)
    return ""


def plot_comparisons(comps: list[Comparison], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless: runs on servers without a display
    import matplotlib.pyplot as plt

    if not comps:
        raise ValueError("nothing to plot")
    fig, axes = plt.subplots(1, len(comps), figsize=(4.2 * len(comps), 4.4), squeeze=False)
    for ax, c in zip(axes[0], comps):
        names = ["specserve"] + ([c.baseline_name] if c.baseline is not None else [])
        vals = [c.ours] + ([c.baseline] if c.baseline is not None else [])
        bars = ax.bar(names, vals, color=["tab:blue", "tab:gray"][: len(vals)], width=0.6)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_ylabel(c.metric)
        ax.set_title(c.label, fontsize=8)
        ax.set_ylim(0, max(vals) * 1.25)  # room for the ratio above the bars
        if c.ratio is not None:
            ax.text(
                0.5,
                0.93,
                f"{c.ratio:.2f}x",
                transform=ax.transAxes,
                ha="center",
                va="top",
                fontsize=13,
                fontweight="bold",
            )
        ax.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _where_from(hw: dict[str, Any]) -> str:
    return ", ".join(hw.get("gpus", [])) or f"{hw.get('cpu', 'CPU')} x{hw.get('cpu_cores', '?')}"


def plot_golden_curve(report: dict[str, Any], path: str) -> None:
    """Speedup vs acceptance rate (one line per batch size; auto budget dashed) and measured vs
    expected acceptance length, from a `bench golden-curve` report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specserve.bench.golden_curve import expected_acceptance_length

    s, points = report["settings"], report["points"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, b in enumerate(s["batch_sizes"]):
        for mode, style in (("fixed", "o-"), ("auto", "^--")):
            pts = sorted(
                (p for p in points if p["mode"] == mode and p["batch_size"] == b),
                key=lambda p: p["acceptance_rate"],
            )
            if not pts:
                continue
            xs = [p["acceptance_rate"] for p in pts]
            label = f"B={b}" + (" auto budget" if mode == "auto" else "")
            c = colors[i % len(colors)]
            ax.plot(xs, [p["speedup"] for p in pts], style, color=c, label=label)
            if mode == "fixed":
                ys = [p["mean_acceptance_length"] for p in pts]
                ax2.plot(xs, ys, style, color=c, label=label)
    grid = [i / 50 for i in range(51)]
    ys = [expected_acceptance_length(r, s["k"]) for r in grid]
    ax2.plot(grid, ys, "k:", label="(1-R^(k+1))/(1-R)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("output tok/s over speculation off")
    ax.set_title(f"speedup, golden drafts, k={s['k']}")
    ax2.set_ylabel("tokens per verify step")
    ax2.set_title("mean acceptance length")
    for a in (ax, ax2):
        a.set_xlabel("acceptance rate R (per draft)")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(
        f"{s.get('model') or 'default model'} | prompt {s['input_len']} + {s['max_tokens']} "
        f"tokens | {_where_from(report.get('hardware', {}))}",
        fontsize=9,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(levels: list[int], series: dict[str, list[float]], title: str, path: str) -> None:
    """One line per mode (label -> output tok/s at each level) against concurrency, log2 axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (label, ys), style in zip(series.items(), ("o-", "s--", "^-", "d:")):
        ax.plot(levels, ys, style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_serve_report(r: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    ok = [x for x in r["per_request"] if x["ok"]]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    panels = (
        (axes[0][0], [x["ttft"] * 1000 for x in ok], "TTFT (ms)"),
        (axes[0][1], [x["tpot"] * 1000 for x in ok if x["tpot"] is not None], "TPOT (ms)"),
        (axes[1][0], [g * 1000 for x in ok for g in x["itl"]], "inter-token latency (ms)"),
    )
    for ax, xs, title in panels:
        if xs:
            ax.hist(xs, bins=40, color="tab:blue")
        ax.set_title(title)
        ax.set_ylabel("count")
    ax = axes[1][1]
    ax.scatter([x["start"] for x in ok], [x["e2e"] for x in ok], s=8, c="tab:orange")
    ax.set_xlabel("request sent (s since start)")
    ax.set_ylabel("end-to-end latency (s)")
    ax.set_title("latency over the run")
    rate = r["settings"]["request_rate"]
    fig.suptitle(
        f"{r['model']}: {r['completed']} requests, rate {rate}, "
        f"{r['output_throughput']:.1f} output tok/s",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_comparisons(comps: list[Comparison]) -> str:
    lines = []
    for c in comps:
        base = "-" if c.baseline is None else f"{c.baseline:.1f}"
        ratio = "-" if c.ratio is None else f"{c.ratio:.2f}x"
        what = c.label.replace("\n", ", ")
        lines.append(f"{what}: specserve {c.ours:.1f} vs {base} {c.metric} -> {ratio}")
    return "\n".join(lines)


def run_plot(paths: list[str], out: str, title: str | None = None) -> list[Comparison]:
    comps, skipped = load_comparisons(paths)
    for note in skipped:
        print(f"skipped {note}", file=sys.stderr)
    if not comps:
        print("error: no throughput report to plot", file=sys.stderr)
        return []
    if title is None:
        where = _where(paths)
        title = "specserve vs HF transformers" + (f", {where}" if where else "")
    plot_comparisons(comps, out, title)
    print(format_comparisons(comps))
    return comps


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("reports", nargs="+", help="throughput JSON files")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--title", default=None, help="default: names the hardware")


def add_plot_parser(sub: Any) -> None:
    _add_args(sub.add_parser("plot", help="plot `bench throughput` JSON reports: specserve vs HF"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.plot_results")
    _add_args(parser)
    args = parser.parse_args(argv)
    return 0 if run_plot(args.reports, args.out, args.title) else 1


if __name__ == "__main__":
    sys.exit(main())
