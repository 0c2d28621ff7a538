"""Two code versions of specserve timed against each other, in alternating processes.

    git archive BASE specserve | tar -x -C /tmp/base       # the old code, outside the worktree
    python tools/code_ab.py --base /tmp/base --repeats 5 --json ab.json -- \\
        bench host-profile --consumer stream --batch-sizes 1,256

Code versions cannot share a process, so each repeat runs the `specserve` command once per
version (PYTHONPATH = that version's tree), in alternating order (base first on even repeats),
each writing its JSON report. A metric is read from both reports by --metric paths; the
result per metric is the median of the per-repeat new/base ratios with its bootstrap interval
(bench/report.py median_interval). Built-in metrics: host-profile's host_cpu_us mean per batch
size, throughput's and spec-sweep's tokens/s figures, structured's step times (the JSON step's extra time over
a plain step, paired within each report).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

NEW = str(Path(__file__).resolve().parents[1])


def metrics(report: dict[str, Any]) -> dict[str, float]:
    """The numbers compared, by name, from one report."""
    out: dict[str, float] = {}
    if report.get("benchmark") == "host-profile":
        for r in report["results"]:
            out[f"host_cpu_us_mean@{r['batch']}"] = r["host_cpu_us"]["mean"]
            out[f"host_us_mean@{r['batch']}"] = r["host_us"]["mean"]
            for k, v in r["phases_mean_us"].items():
                out[f"phase_{k}@{r['batch']}"] = v
        return out

    if report.get("benchmark") == "structured":
        runs = report["runs"]
        pairs = list(zip(runs["json"], runs["plain"]))
        out["json_extra_step_ms"] = statistics.median(j["step_ms"] - p["step_ms"] for j, p in pairs)
        out["json_step_ms"] = statistics.median(j["step_ms"] for j, _ in pairs)
        out["plain_step_ms"] = statistics.median(p["step_ms"] for _, p in pairs)
        out["mask_ms_per_step"] = report["median_mask_ms_per_step"]
        return out

    def walk(x: Any, path: str) -> None:  # throughput, spec-sweep: every tokens/s figure
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}.{k}" if path else k)
        elif isinstance(x, list):  # spec-sweep's points: named by mode and concurrency
            for i, v in enumerate(x):
                name = f"{v['mode']}@{v.get('concurrency')}" if isinstance(v, dict) else i
                walk(v, f"{path}.{name}" if path else str(name))
        elif isinstance(x, (int, float)) and path.endswith("tok_s"):
            out[path] = float(x)

    walk(report.get("specserve", report), "")
    return out


def run_once(tree: str, cmd: list[str], json_path: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=tree)
    code = "import sys; from specserve.cli.main import main; sys.exit(main())"
    done = subprocess.run(
        [sys.executable, "-c", code, *cmd, "--json", json_path],
        env=env,
        stdout=subprocess.DEVNULL,
    )
    # spec-sweep exits 1 on a missed check, its report written: still a measurement
    if done.returncode not in (0, 1) or not os.path.exists(json_path):
        raise subprocess.CalledProcessError(done.returncode, cmd)
    with open(json_path, encoding="utf-8") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="tree holding the old specserve package")
    p.add_argument("--new", default=NEW, help="tree holding the new one (default: this one)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- specserve arguments")
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    sys.path.insert(0, args.new)
    from specserve.bench.report import median_interval

    runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            order = ["base", "new"] if rep % 2 == 0 else ["new", "base"]
            for which in order:
                tree = args.base if which == "base" else args.new
                report = run_once(tree, cmd, f"{tmp}/{which}{rep}.json")
                runs[which].append(metrics(report))
            print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
    result: dict[str, Any] = {}
    for name in runs["new"][0]:
        base = [r[name] for r in runs["base"]]
        new = [r[name] for r in runs["new"]]
        ratios = [n / b for n, b in zip(new, base) if b]
        entry: dict[str, Any] = {"base": base, "new": new}
        if ratios:
            med, lo, hi = median_interval(ratios)
            entry["new_over_base"] = {"median": med, "interval_90": [lo, hi]}
            print(f"{name}: new/base {med:.3f} [{lo:.3f}, {hi:.3f}]")
        result[name] = entry
    report = {"command": " ".join(cmd), "repeats": args.repeats, "metrics": result}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
