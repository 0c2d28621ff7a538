"""`specserve train-head` end to end on a tiny target (a few seconds on a CPU): the target's own
answers cached, the loss going down, a head folder vLLM / SGLang / specserve load, calibration
and tokens per step in the report; a resumed run equal to an uninterrupted one; user errors
as one line before any model loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specserve.cli.main import main
from specserve.model.loader import load_model
from specserve.model.loader.eagle3 import CONFIDENCE_FILE, load_eagle3_head
from specserve.train.data import AnswerCache, DataSpec, Sample, split_samples
from specserve.train.evaluate import draft_chains, walk
from specserve.train.pipeline import HeadTrainingJob, engine_eval, train_head
from specserve.train.trainer import Trainer, TrainOptions, build_head, run_batches
from specserve.train.vocab import build_draft_vocab

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _job(out: Path, target: Path, prompts: Path, **train: object) -> HeadTrainingJob:
    opts = dict(ttt_steps=2, epochs=4, batch_size=4, lr=3e-3, save_every=1000)
    opts.update(train)
    return HeadTrainingJob(
        out=out,
        model=str(target),
        prompts_file=prompts,
        num_prompts=12,
        max_answer_tokens=16,
        draft_vocab_size=512,
        heldout_fraction=0.34,
        device="cpu",
        engine_eval_k=2,
        progress=False,
        train=TrainOptions(**opts),
    )


def test_train_head_end_to_end(tmp_path: Path, train_target_dir: Path, prompts_file: Path) -> None:
    out = tmp_path / "run"
    report = train_head(_job(out, train_target_dir, prompts_file))
    # data: the target's own greedy answers, cached
    cached = [json.loads(line) for line in (out / "data" / "samples.jsonl").open()]
    assert len(cached) == 12 and all(len(s["answer_ids"]) == 16 for s in cached)
    assert report["data"]["train"] + report["data"]["calibration"] + report["data"]["eval"] == 12
    # the loss goes down
    log = [json.loads(line) for line in (out / "train_log.jsonl").open()]
    assert len(log) == report["train"]["total_steps"] == 8
    assert sum(r["loss"] for r in log[-2:]) < 0.9 * sum(r["loss"] for r in log[:2])
    # each step says where its time went, and how many tokens it trained on
    assert all(set(r["seconds"]) == {"capture", "head", "update"} for r in log)
    assert all(min(r["seconds"].values()) >= 0 and r["tokens"] > 0 for r in log)
    # the report: tokens per step for k = 1..7, the acceptance curve, calibration
    ev = report["eval"]
    assert sorted(ev["tokens_per_step"], key=int) == [str(k) for k in range(1, 8)]
    assert all(v >= 1.0 for v in ev["tokens_per_step"].values())
    assert len(ev["acceptance_per_position"]) == 7
    cal = report["calibration"]
    assert len(cal["temperatures"]) == 7 and cal["ece_before_all"] >= 0
    assert json.loads((out / "report.json").read_text())["eval"] == ev
    # served through the engine (method eagle3): greedy answers are the target's own
    eng = report["engine_eval"]
    assert "error" not in eng, eng
    assert eng["k"] == 2 and eng["tokens_per_step"] >= 1.0
    assert eng["identical_to_target_greedy"] == report["data"]["eval"]
    # the head folder is vLLM / SGLang's format and loads back into specserve
    head_dir = out / "head"
    cfg = json.loads((head_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 512
    assert cfg["confidence_temperatures"] == cal["temperatures"]
    from safetensors import safe_open

    with safe_open(str(head_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    assert {
        "fc.weight",
        "midlayer.self_attn.q_proj.weight",
        "norm.weight",
        "lm_head.weight",
    } <= names
    assert "d2t" in names and "t2d" in names and not any("confidence" in n for n in names)
    assert (head_dir / CONFIDENCE_FILE).is_file()
    target = load_model(str(train_target_dir), torch.float32, torch.device("cpu"), progress=False)
    head = load_eagle3_head(
        head_dir, target.config, "cpu", torch.float32, target.model.embed_tokens
    )
    assert head.confidence_head is not None
    ids = head.draft_to_target()
    assert torch.equal(head.t2d.nonzero().flatten(), ids)
    # the evaluation's chains are the engine's: on the training prompts (where the head does
    # draft right) the simulated walk accepts what the engine's eagle3 drafter accepts
    job = _job(out, train_target_dir, prompts_file)
    split = split_samples(AnswerCache(out / "data", None).load(), 0.34, 0)
    rows = run_batches(
        lambda b: draft_chains(head, b, 2), target.model, head, split.train, 4, 8192, "", False
    )
    simulated = sum(t - s for t, s in (walk(a, 2) for r in rows for a in r.accepted))
    eng = engine_eval(job, head_dir, split.train)
    assert simulated > 0 and eng["identical_to_target_greedy"] == len(split.train)
    assert abs(eng["accepted_tokens"] - simulated) <= max(2, 0.05 * simulated)


def _samples(n: int, seed: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [
        Sample(
            i,
            [1] + torch.randint(3, 800, (5,), generator=g).tolist(),
            torch.randint(3, 800, (10,), generator=g).tolist(),
        )
        for i in range(n)
    ]


def test_a_complete_answer_cache_is_read_back_as_is(
    tmp_path: Path, train_target_dir: Path, prompts_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once every prompt is answered the cache says so: a later run reads the answers back
    without tokenizing a prompt, on an engine without CUDA graphs or a real KV cache (it only
    lends its model to training); a cache marked complete that lost answers is refused."""
    import specserve
    import specserve.train.pipeline as pl

    out = tmp_path / "run"
    first = train_head(_job(out, train_target_dir, prompts_file, epochs=1))
    assert json.loads((out / "data" / "complete.json").read_text()) == {"prompts": 12}
    shutil.rmtree(out / "checkpoint")
    built: list[dict] = []
    real_llm = specserve.LLM

    def llm(*args, **kwargs):
        built.append(kwargs)
        return real_llm(*args, **kwargs)

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("a complete cache tokenized its prompts again")

    monkeypatch.setattr(specserve, "LLM", llm)
    monkeypatch.setattr(pl, "tokenize_prompts", no_tokenizing)
    again = train_head(_job(out, train_target_dir, prompts_file, epochs=1))
    assert again["data"] == first["data"] | {"seconds": again["data"]["seconds"]}
    assert built[0]["enforce_eager"] and built[0]["kv_cache_memory_gb"] < 0.1
    lines = (out / "data" / "samples.jsonl").read_text().splitlines()
    (out / "data" / "samples.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    shutil.rmtree(out / "checkpoint")
    with pytest.raises(ValueError, match="marked complete for 12 prompts but holds 11"):
        train_head(_job(out, train_target_dir, prompts_file, epochs=1))


def test_resumed_training_equals_an_uninterrupted_run(
    tmp_path: Path, train_target_dir: Path
) -> None:
    target = load_model(str(train_target_dir), torch.float32, torch.device("cpu"), progress=False)
    samples = _samples(12, 0)
    vocab = build_draft_vocab([s.answer_ids for s in samples], 128, 49152)
    opts = TrainOptions(ttt_steps=2, max_steps=6, batch_size=4, lr=3e-3, save_every=100)

    def trainer(out: Path) -> Trainer:
        return Trainer(target.model, build_head(target.model, vocab, 0), samples, opts, out, False)

    whole = trainer(tmp_path / "a")
    whole.run()
    first = trainer(tmp_path / "b")
    first.run(stop_after=4)  # an interrupted run: 4 of 6 steps, checkpointed
    assert first.state.step == 4 and not first.finished
    again = trainer(tmp_path / "b")
    again.load_checkpoint()
    assert again.state.step == 4 and again.scheduler.last_epoch == 4
    again.run()
    assert again.finished and again.state.step == 6
    for (name, a), (_, b) in zip(whole.head.state_dict().items(), again.head.state_dict().items()):
        assert torch.equal(a, b), name
    # a checkpoint refuses other settings
    other = Trainer(
        target.model,
        build_head(target.model, vocab, 0),
        samples,
        TrainOptions(ttt_steps=3, max_steps=6, batch_size=4, lr=3e-3),
        tmp_path / "b",
        False,
    )
    with pytest.raises(ValueError, match="ttt_steps: checkpoint 2, now 3"):
        other.load_checkpoint()


def test_train_seconds_sizes_the_schedule_from_measured_speed(
    tmp_path: Path, train_target_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--train-seconds: after the probe steps the run is sized to the budget at the measured
    speed (a fake clock: 2 s a step), the schedule decays to zero at that step, the size
    survives a resume, and a call cut short before its probe leaves the sizing to the next."""
    import specserve.train.trainer as tr

    target = load_model(str(train_target_dir), torch.float32, torch.device("cpu"), progress=False)
    samples = _samples(16, 3)
    vocab = build_draft_vocab([s.answer_ids for s in samples], 128, 49152)
    clock = [0.0]

    def step_then_tick(self: Trainer, batch: list[Sample]) -> dict[str, object]:
        clock[0] += 2.0
        return {"loss": 0.0, "acc": [0.0]}

    monkeypatch.setattr(tr.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(Trainer, "train_step", step_then_tick)
    opts = TrainOptions(ttt_steps=1, epochs=50, batch_size=1, train_seconds=31.0, save_every=100)
    t = Trainer(target.model, build_head(target.model, vocab, 0), samples, opts, tmp_path, False)
    assert t.total_steps == 50 * 16  # not sized yet: the most the options allow
    t.run()
    assert t.finished and t.state.total_steps == 15  # 31 s / 2 s a step
    assert t.scheduler.lr_lambdas[0](15) == pytest.approx(0.0)
    assert t.scheduler.lr_lambdas[0](8) > 0.1
    again = Trainer(
        target.model, build_head(target.model, vocab, 0), samples, opts, tmp_path, False
    )
    again.load_checkpoint()
    assert again.finished and again.total_steps == 15
    # a call that ends before its probe is done (answering prompts ate its time limit): the
    # resumed call probes and sizes the run itself
    longer = TrainOptions(ttt_steps=1, epochs=50, batch_size=1, train_seconds=61.0, save_every=100)
    cut = Trainer(
        target.model, build_head(target.model, vocab, 0), samples, longer, tmp_path / "d", False
    )
    cut.run(stop_after=4)
    assert cut.state.total_steps is None and cut.state.step == 4
    resumed = Trainer(
        target.model, build_head(target.model, vocab, 0), samples, longer, tmp_path / "d", False
    )
    resumed.load_checkpoint()
    resumed.run()
    assert resumed.finished and resumed.state.total_steps == 30  # 61 s / 2 s a step
    tiny = TrainOptions(ttt_steps=1, epochs=1, batch_size=4, train_seconds=1e6, save_every=100)
    capped = Trainer(
        target.model, build_head(target.model, vocab, 0), samples, tiny, tmp_path / "c", False
    )
    capped.run()
    assert capped.finished and capped.total_steps == 4  # never past --epochs


def test_heldout_prompts_are_never_training_prompts() -> None:
    from specserve.bench.datasets import is_heldout, load_sharegpt_corpus
    from specserve.bench.datasets import sharegpt_prompts as split_prompts
    from specserve.train.data import sharegpt_prompts

    train = sharegpt_prompts(400, seed=0)
    held = split_prompts(100, seed=0, heldout=True)
    assert len(held) == 100 and not set(train) & set(held)
    assert all(is_heldout(p) for p in held) and not any(is_heldout(p) for p in train)
    prompts = {p.strip() for p, _ in load_sharegpt_corpus().pairs if p.strip()}
    assert 0.04 < sum(map(is_heldout, prompts)) / len(prompts) < 0.06  # one in 20


def test_data_cache_and_split(tmp_path: Path) -> None:
    spec = DataSpec("m", "sharegpt", 10, 512, 16, 0.0, 0)
    cache = AnswerCache(tmp_path, spec)
    cache.append(_samples(3, 1))
    with open(cache.samples_path, "a") as f:
        f.write('{"index": 3, "prompt_ids": [1')  # an interrupted write
    assert [s.index for s in cache.load()] == [0, 1, 2]
    other = AnswerCache(tmp_path, DataSpec("m", "sharegpt", 10, 512, 32, 0.0, 0))
    with pytest.raises(ValueError, match="max_answer_tokens: cached 16, now 32"):
        other.check_spec()
    sp = split_samples(_samples(20, 2), 0.2, seed=0)
    parts = [{s.index for s in p} for p in (sp.train, sp.calib, sp.eval)]
    assert [len(p) for p in parts] == [16, 2, 2]
    assert not (parts[0] & parts[1]) and not (parts[0] & parts[2]) and not (parts[1] & parts[2])
    assert split_samples(_samples(20, 2), 0.2, seed=0).eval == sp.eval


def test_user_errors_are_one_line_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "state.pt").write_bytes(b"")
    rc = main(["train-head", "--model", "dummy:nonexistent", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "already holds a training checkpoint" in err and "--resume" in err
    rc = main(["train-head", "--out", str(tmp_path / "p"), "--ttt-steps", "0"])
    assert rc == 2 and "--ttt-steps 0" in capsys.readouterr().err
    rc = main(["train-head", "--out", str(tmp_path / "q"), "--num-prompts", "1"])
    assert rc == 2 and "--num-prompts 1" in capsys.readouterr().err
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a\nb\n")
    rc = main(
        ["train-head", "--out", str(tmp_path / "r"), "--turns", "all", "--prompts", str(prompts)]
    )
    assert rc == 2 and "--turns all" in capsys.readouterr().err
    rc = main(["train-head", "--out", str(tmp_path / "s"), "--code-prompts", "-1"])
    assert rc == 2 and "--code-prompts -1" in capsys.readouterr().err
    shutil.rmtree(out)
