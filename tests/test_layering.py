"""The folders are layers: no two subpackages of specserve import each other at module level
(imports under TYPE_CHECKING and inside functions aside). The engine's core (engine/) sits below
the runner and the drafters; what assembles them (llm_engine.py, engine_build.py,
step_launch.py) is a top-level module above them all."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "specserve"


def package_imports(root: Path) -> dict[str, set[str]]:
    """Subpackage -> the other subpackages its modules import at module level."""
    subpackages = {p.name for p in root.iterdir() if (p / "__init__.py").exists()}
    out: dict[str, set[str]] = defaultdict(set)
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        if len(parts) < 2:
            continue  # a top-level module: above (or beside) every subpackage
        src = parts[0]
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue  # `if TYPE_CHECKING:` blocks are ast.If: skipped with the rest
            mod = node.module.split(".")
            if mod[0] == "specserve" and len(mod) > 1 and mod[1] in subpackages and mod[1] != src:
                out[src].add(mod[1])
    return out


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Every pair or longer loop of packages that reach each other, as sorted tuples."""

    def reach(a: str) -> set[str]:
        seen, todo = set(), [a]
        while todo:
            for b in graph.get(todo.pop(), ()):
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen

    found = set()
    for a in graph:
        loop = {b for b in reach(a) if a in reach(b)}
        if loop:
            found.add(tuple(sorted(loop | {a})))
    return sorted(found)


def test_no_two_subpackages_import_each_other():
    graph = package_imports(ROOT)
    assert graph["runner"] and graph["speculative"]  # the scan sees imports at all
    assert cycles(graph) == [], {k: sorted(v) for k, v in graph.items()}


def test_a_loop_between_packages_is_found():
    """Negative control: a loop through three packages, and one through two."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]
    assert cycles({"engine": {"runner"}, "runner": {"engine"}}) == [("engine", "runner")]
