"""Code-task prompts built from the Python standard library's own functions.

Why: ShareGPT's first turns hold little code, and almost no answers that copy code from their
prompt, so a head trained on them alone drafts code answers poorly (the HumanEval-rewrite
benchmark's tokens per step against chat's, README). The standard library is on every machine
that runs specserve, needs no download and is real, varied Python. Each prompt pairs one of its
functions (a method or a nested function too; 4 to 40 lines, ASCII) with one of a few everyday
coding instructions (TASKS); the target answers them like any other training prompt. The
benchmark's HumanEval functions are not standard-library code, so no evaluation prompt is
trained on.

The functions differ between Python versions, so `source_tag` names the version: an answer
cache made under another one is refused instead of being read as this one's.
"""

from __future__ import annotations

import ast
import random
import sys
import sysconfig
import textwrap
from pathlib import Path

TASKS = (
    "Add type hints to every parameter and the return value of this Python function, and a "
    "docstring. Reply with the complete function.\n\n```python\n{code}```",
    "Explain what this Python function does, step by step.\n\n```python\n{code}```",
    "Rewrite this function with a comment on each step. Return the whole function."
    "\n\n```python\n{code}```",
    "Write pytest unit tests for this function.\n\n```python\n{code}```",
    "Refactor this function to make it easier to read without changing its behaviour. Show the "
    "new code.\n\n```python\n{code}```",
    "Are there bugs or unhandled edge cases in this function? Show a corrected version."
    "\n\n```python\n{code}```",
)
MIN_LINES, MAX_LINES = 4, 40
PER_FILE = 24  # functions taken from one module at most: many modules, not a few big ones
# folders of the standard library that are tests, demos or vendored tools, not library code
SKIP_DIRS = frozenset(
    {"test", "tests", "idlelib", "turtledemo", "lib2to3", "site-packages", "ensurepip"}
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_tag() -> str:
    """What the prompts depend on besides the seed: the Python version's standard library."""
    return f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}"


def _functions(path: Path) -> list[str]:
    """Each function of one module as source text, dedented, that passes the filters."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        body = lines[first - 1 : node.end_lineno]
        if not MIN_LINES <= len(body) <= MAX_LINES:
            continue
        code = textwrap.dedent("\n".join(body)) + "\n"
        if code.isascii() and _parses(code):  # a method whose strings reach column 0 does not
            out.append(code)
    return out


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except SyntaxError:
        return False
    return True


def stdlib_functions(num: int, seed: int, root: Path | None = None) -> list[str]:
    """`num` distinct functions (fewer if the library holds fewer), from modules taken in a
    seed-shuffled order, at most PER_FILE from each: only as many modules are parsed as needed."""
    root = root or stdlib_root()
    files = sorted(
        p for p in root.rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(root).parts)
    )
    rng = random.Random(seed)
    rng.shuffle(files)
    seen: set[str] = set()
    out: list[str] = []
    for path in files:
        funcs = [f for f in _functions(path) if f not in seen]
        rng.shuffle(funcs)
        for code in funcs[:PER_FILE]:
            seen.add(code)
            out.append(code)
            if len(out) == num:
                return out
    return out


def code_task_prompts(num: int, seed: int, root: Path | None = None) -> list[str]:
    """`num` user prompts (fewer if the library runs out): a function and an instruction each,
    the instruction drawn with the seed."""
    rng = random.Random(seed + 7)
    return [rng.choice(TASKS).format(code=code) for code in stdlib_functions(num, seed, root)]
