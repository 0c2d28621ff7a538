"""Training data: chat prompts, answered by the target itself through specserve.

A head is only as good as its match to the target's own outputs, so the ShareGPT replies are
thrown away and each prompt is answered again by the target (greedy by default, the way the head
is used): first turns, and with `--turns all` also later turns, whose history keeps the original
replies. The answers are cached under `<out>/data/` as they are generated, chunk
by chunk, so an interrupted run (or a resumed training) never regenerates what it already has.

The split is by prompt: a fixed share of the prompts, chosen with the seed, is held out. Half of
the held-out prompts fit the confidence temperatures, the other half is the evaluation set;
neither half is ever trained on.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specserve.chat import conversation_prompt_ids
from specserve.chat import user_prompt_ids as chat_prompt_ids
from specserve.sampling_params import InvalidRequestError
from specserve.train.errors import TrainHeadError

DATA_FORMAT = 1
GEN_CHUNK = 64  # prompts answered (and appended to the cache) per generate() call


@dataclass
class Sample:
    index: int  # position in the prompt list: the split and the cache key
    prompt_ids: list[int]
    answer_ids: list[int]

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.answer_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.answer_ids)


@dataclass
class DataSpec:
    """What the cached answers depend on; a cache made under another spec is refused."""

    model: str
    source: str  # "sharegpt" or the prompts file's path
    num_prompts: int
    max_prompt_tokens: int
    max_answer_tokens: int
    temperature: float
    seed: int
    format: int = DATA_FORMAT


@dataclass
class Split:
    train: list[Sample] = field(default_factory=list)
    calib: list[Sample] = field(default_factory=list)  # fits the confidence temperatures
    eval: list[Sample] = field(default_factory=list)  # held-out evaluation


def sharegpt_prompts(num: int, seed: int) -> list[str]:
    """`num` distinct non-empty first human turns of ShareGPT's training share (the held-out
    share, bench.datasets.is_heldout, is never trained on), in a seed-shuffled order."""
    from specserve.bench.datasets import sharegpt_prompts as split_prompts

    return split_prompts(num, seed, heldout=False)


def sharegpt_turn_prompts(num: int, seed: int) -> list[list[dict[str, str]]]:
    """`num` later user turns of ShareGPT conversations in the training share, each with the
    conversation before it (the original replies: only the answer to the last turn is
    regenerated), seed-shuffled."""
    from specserve.bench.datasets import sharegpt_turn_contexts

    return sharegpt_turn_contexts(num, seed, heldout=False)


def file_prompts(path: Path) -> list[str]:
    """One prompt per line (a .jsonl file: one JSON string, or an object with "prompt")."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            if path.suffix == ".jsonl":
                obj = json.loads(line)
                line = obj if isinstance(obj, str) else str(obj["prompt"])
            prompts.append(line)
    return prompts


Prompt = str | list[dict[str, str]]  # one user turn, or a conversation ending in one


def tokenize_prompts(
    tokenizer: Any, prompts: Sequence[Prompt], num: int, max_prompt_tokens: int
) -> list[list[int]]:
    """The first `num` prompts whose templated form has 4..max_prompt_tokens tokens (a
    conversation the chat template refuses is skipped)."""
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids = chat_prompt_ids(tokenizer, prompt)
        else:
            try:
                ids = conversation_prompt_ids(tokenizer, prompt)
            except InvalidRequestError:
                continue
        if 4 <= len(ids) <= max_prompt_tokens:
            out.append(ids)
        if len(out) == num:
            break
    return out


class AnswerCache:
    """`<dir>/meta.json` (the DataSpec), `<dir>/samples.jsonl` (one Sample a line) and, once
    every prompt is answered, `<dir>/complete.json` (how many prompts passed the length filter):
    a resumed run then reads the answers back without tokenizing the prompts again."""

    def __init__(self, root: Path, spec: DataSpec | None) -> None:
        self.root = root
        self.spec = spec
        self.meta_path = root / "meta.json"
        self.samples_path = root / "samples.jsonl"
        self.complete_path = root / "complete.json"

    def num_complete(self) -> int | None:
        """The number of prompts when every one is answered, else None."""
        if not (self.complete_path.is_file() and self.meta_path.is_file()):
            return None
        return int(json.loads(self.complete_path.read_text())["prompts"])

    def mark_complete(self, num_prompts: int) -> None:
        self.complete_path.write_text(json.dumps({"prompts": num_prompts}) + "\n")

    def load_complete(self, num_prompts: int) -> list[Sample]:
        """Every prompt's answer, in prompt order (a cache marked complete)."""
        got = {s.index: s for s in self.load() if s.index < num_prompts}
        if len(got) != num_prompts:
            raise TrainHeadError(
                f"{self.root} is marked complete for {num_prompts} prompts but holds "
                f"{len(got)} of their answers; remove {self.complete_path.name} to answer the rest"
            )
        return [got[i] for i in range(num_prompts)]

    def check_spec(self) -> None:
        if not self.meta_path.is_file():
            return
        old = json.loads(self.meta_path.read_text())
        diff = [k for k, v in asdict(self.spec).items() if old.get(k) != v]
        if diff:
            shown = ", ".join(
                f"{k}: cached {old.get(k)!r}, now {getattr(self.spec, k)!r}" for k in diff
            )
            raise TrainHeadError(
                f"{self.root} holds answers made under other settings ({shown}); "
                "use another --out, or the same settings to resume"
            )

    def load(self) -> list[Sample]:
        if not self.samples_path.is_file():
            return []
        out = []
        with open(self.samples_path, encoding="utf-8") as f:
            for line in f:
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:
                    break  # a torn last line from an interrupted write: regenerate from there
                out.append(Sample(d["index"], d["prompt_ids"], d["answer_ids"]))
        return out

    def append(self, samples: Sequence[Sample]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.meta_path.is_file():
            tmp = self.meta_path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(asdict(self.spec), indent=1))
            os.replace(tmp, self.meta_path)
        with open(self.samples_path, "a", encoding="utf-8") as f:
            for s in samples:
                f.write(json.dumps(asdict(s)) + "\n")
            f.flush()
            os.fsync(f.fileno())


def regenerate(
    llm: Any,
    prompts: Sequence[list[int]],
    cache: AnswerCache,
    max_answer_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = True,
    deadline: float | None = None,
) -> list[Sample] | None:
    """Answer every prompt with the target (through `llm`, a specserve LLM); the cached ones
    are read back, the rest generated in chunks and appended to the cache as they finish.
    None when `deadline` (a time.monotonic() value) passed first: the chunks done are cached."""
    from specserve import SamplingParams

    cache.check_spec()
    done = {s.index: s for s in cache.load() if s.index < len(prompts)}
    stale = [i for i, s in done.items() if s.prompt_ids != list(prompts[i])]
    if stale:
        raise TrainHeadError(
            f"{cache.samples_path}: the cached answer {stale[0]} is to another prompt than "
            "this run's (the tokenizer or prompt source changed?); use another --out"
        )
    todo = [i for i in range(len(prompts)) if i not in done]
    bar = tqdm(
        total=len(prompts),
        initial=len(prompts) - len(todo),
        desc="answering prompts",
        unit="prompt",
        disable=not progress,
    )
    for start in range(0, len(todo), GEN_CHUNK):
        if deadline is not None and time.monotonic() >= deadline:
            bar.close()
            return None
        chunk = todo[start : start + GEN_CHUNK]
        params = [
            SamplingParams(temperature=temperature, max_tokens=max_answer_tokens, seed=seed + i)
            for i in chunk
        ]
        outs = llm.generate([prompts[i] for i in chunk], params, use_tqdm=False)
        new = [
            Sample(i, list(prompts[i]), list(o.outputs[0].token_ids)) for i, o in zip(chunk, outs)
        ]
        cache.append(new)
        done.update((s.index, s) for s in new)
        bar.update(len(chunk))
    bar.close()
    return [done[i] for i in range(len(prompts))]


def split_samples(samples: Sequence[Sample], heldout_fraction: float, seed: int) -> Split:
    """Held-out prompts chosen by the seed; answers too short to train on (< 2 tokens) dropped
    from every part."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise TrainHeadError(f"held-out fraction {heldout_fraction} must be in [0, 1)")
    order = sorted(samples, key=lambda s: s.index)
    random.Random(seed + 1).shuffle(order)
    n_held = round(len(order) * heldout_fraction)
    if heldout_fraction > 0 and len(order) >= 4:
        n_held = max(n_held, 2)  # one prompt each for calibration and evaluation
    held, train = order[:n_held], order[n_held:]
    usable = [s for s in train if len(s.answer_ids) >= 2]
    held = [s for s in held if len(s.answer_ids) >= 2]
    half = (len(held) + 1) // 2
    return Split(usable, held[:half], held[half:])
