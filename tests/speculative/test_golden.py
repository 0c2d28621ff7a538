"""Golden tokens (teacher forcing): emitted tokens are forced, drafts accepted iff they match, so
a benchmark can dial in the acceptance rate with random weights."""

import random

import pytest

from specserve import InvalidRequestError, SamplingParams
from tests.engine.conftest import make_llm, prompts_of

GOLD = [random.Random(0).randrange(3, 49000) for _ in range(40)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_golden_tokens_are_emitted_with_and_without_speculation(temperature):
    prompts = prompts_of([7, 20], seed=12)
    sp = SamplingParams(
        temperature=temperature, max_tokens=30, ignore_eos=True, golden_token_ids=GOLD
    )
    for cfg in [None, {"method": "draft_model", "num_speculative_tokens": 3, "model": "self"}]:
        outs = make_llm(speculative_config=cfg).generate(prompts, sp, use_tqdm=False)
        assert all(o.outputs[0].token_ids == GOLD[:30] for o in outs)
    # past the golden ids the model decides again
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, golden_token_ids=GOLD[:3])
    out = make_llm().generate(prompts[:1], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert out[:3] == GOLD[:3] and len(out) == 8


@pytest.mark.parametrize("rate", [0.0, 0.5, 1.0])
def test_acceptance_follows_the_dialled_rate(rate):
    cfg = {"method": "golden", "num_speculative_tokens": 4, "acceptance_rate": rate}
    llm = make_llm(speculative_config=cfg | {"verify_budget": "off"})
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, golden_token_ids=GOLD)
    outs = llm.generate(prompts_of([5] * 6, seed=13), sp, use_tqdm=False)
    assert all(o.outputs[0].token_ids == GOLD for o in outs)
    first = llm.get_metrics()["spec_acceptance_per_position"][0]
    assert first == pytest.approx(rate, abs=0.12)


def test_golden_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(InvalidRequestError):
        SamplingParams(golden_token_ids=[-1])
    llm = make_llm()
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6]], SamplingParams(golden_token_ids=[10**7]), use_tqdm=False)


def test_bench_acceptance_rate_dials_in_acceptance():
    from specserve.bench.throughput import ThroughputSettings, run_throughput

    s = ThroughputSettings(
        model="dummy:tiny",
        dataset="random",
        num_prompts=3,
        max_tokens=21,
        ignore_eos=True,
        input_len=8,
        device="cpu",
        dtype="float32",
        acceptance_rate=1.0,
        speculative_config={"num_speculative_tokens": 4},
    )
    report = run_throughput(s, verbose=False)
    m = report["engine_metrics"]
    assert m["spec_acceptance_per_position"] == [1.0, 1.0, 1.0, 1.0]
    assert m["spec_mean_acceptance_length"] == pytest.approx(5.0)


def test_right_and_wrong_drafts_depend_on_the_request_not_on_the_draw_order():
    """Each position's draft is right or wrong by the request alone: two drafters asked in
    different patterns (k = 1 each step vs k = 4, other requests in between) agree on every
    position, and over many requests the share of right drafts is the dialled rate."""
    from specserve.engine.sequence import Sequence
    from specserve.speculative.golden import GoldenDrafter

    def seq(i: int, gold: list[int]) -> Sequence:
        sp = SamplingParams(max_tokens=len(gold), golden_token_ids=gold)
        return Sequence(f"r{i}", None, [3 + i, 9, 27], sp, seed=i)

    rng = random.Random(1)
    golds = [[rng.randrange(3, 400) for _ in range(24)] for _ in range(50)]
    verdicts = []
    for k, order in ((1, range(50)), (4, reversed(range(50)))):
        d = GoldenDrafter(0.7, 49152, seed=5)
        got = {}
        for i in order:
            s = seq(i, golds[i])
            right = []
            while s.num_output_tokens < len(golds[i]):
                ((drafts, _),) = d.propose([s], [k])
                for p, t in enumerate(drafts, start=s.num_output_tokens):
                    right.append((p, t == golds[i][p]))
                s.token_ids.append(golds[i][s.num_output_tokens])  # the verifier forces it
            got[i] = sorted(set(right))
            d.release(s)
        verdicts.append(got)
    assert verdicts[0] == verdicts[1]
    flags = [r for rows in verdicts[0].values() for _, r in rows]
    assert sum(flags) / len(flags) == pytest.approx(0.7, abs=0.05)
