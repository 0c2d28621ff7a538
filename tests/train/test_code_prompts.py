"""Code-task prompts from the standard library: real functions (they parse, within the line
bounds, ASCII), distinct, seeded; tests and demos left out; a job's answer cache names them;
train-head answers them beside its other prompts."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from specserve.train import code_prompts as cp
from specserve.train.errors import TrainHeadError
from specserve.train.pipeline import HeadTrainingJob, build_data, check_job


def _code(prompt: str) -> str:
    return prompt.split("```python\n", 1)[1].rsplit("```", 1)[0]


def test_prompts_are_real_distinct_seeded_functions() -> None:
    a = cp.code_task_prompts(60, seed=1)
    assert len(a) == 60 and a == cp.code_task_prompts(60, seed=1)
    assert a != cp.code_task_prompts(60, seed=2)
    codes = [_code(p) for p in a]
    assert len(set(codes)) == 60
    for p, code in zip(a, codes):
        assert any(p == t.format(code=code) for t in cp.TASKS)
        tree = ast.parse(code)  # dedented: a method parses on its own
        assert isinstance(tree.body[0], ast.FunctionDef | ast.AsyncFunctionDef)
        assert cp.MIN_LINES <= len(code.splitlines()) <= cp.MAX_LINES and code.isascii()
    assert len({p.split("\n", 1)[0] for p in a}) > 1  # several instructions drawn


def test_tests_and_demos_left_out_and_few_per_module(tmp_path: Path) -> None:
    body = "    x = {i}\n    y = x + 1\n    z = y * 2\n    return z\n"
    big = "".join(f"def f{i}():\n" + body.format(i=i) for i in range(cp.PER_FILE + 10))
    (tmp_path / "mod.py").write_text(big)
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "test_mod.py").write_text("def test_a():\n" + body.format(i=0))
    (tmp_path / "short.py").write_text("def tiny():\n    return 1\n")
    (tmp_path / "broken.py").write_text("def (:\n")
    got = cp.stdlib_functions(1000, seed=0, root=tmp_path)
    assert len(got) == cp.PER_FILE and all(g.startswith("def f") for g in got)


def test_too_many_asked_gives_what_there_is(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "class A:\n    @staticmethod\n    def g(a):\n        b = a\n        c = b\n        return c\n"
    )
    assert cp.stdlib_functions(5, seed=0, root=tmp_path) == [
        "@staticmethod\ndef g(a):\n    b = a\n    c = b\n    return c\n"
    ]


class _FakeLLM:
    """What build_data needs of an LLM: a name, a tokenizer, and answers (three fixed ids)."""

    model_name = "fake"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def generate(self, prompts: list, params: list, use_tqdm: bool = False) -> list:
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5, 6, 7])]) for _ in prompts]


def test_train_head_answers_code_prompts_beside_its_others(
    tmp_path: Path, default_tokenizer: Any
) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("What is 2+2?\nName a colour.\nWhy is the sky blue?\n")
    job = HeadTrainingJob(out=tmp_path / "run", prompts_file=prompts, num_prompts=3, code_prompts=4)
    check_job(job)
    samples = build_data(job, _FakeLLM(default_tokenizer), None)
    assert samples is not None and len(samples) == 7
    texts = [default_tokenizer.decode(s.prompt_ids) for s in samples]
    assert sum("```python" in t for t in texts) == 4
    meta = json.loads((job.out / "data" / "meta.json").read_text())
    assert meta["source"] == f"{prompts}+code4-{cp.source_tag()}"
    with pytest.raises(TrainHeadError, match="--code-prompts"):
        check_job(HeadTrainingJob(out=tmp_path / "x", code_prompts=-1))
