"""Golden tokens (teacher forcing): emitted tokens are forced, drafts accepted iff they match, so
a benchmark can dial in the acceptance rate with random weights."""

import random

import pytest

from specserve import InvalidRequestError, SamplingParams
from tests.engine.conftest import make_llm, prompts_of

GOLD = [random.Random(0).randrange(3, 49000) for _ in range(40)]


class GoldenDrafter:
    """Proposes the golden continuation, each draft right with probability `rate`."""

    has_q = False

    def __init__(self, rate: float) -> None:
        self.rate, self.rng = rate, random.Random(1)

    def propose(self, seqs, limits):
        out = []
        for s, k in zip(seqs, limits):
            gold = s.params.golden_token_ids
            n = s.num_output_tokens
            d = [
                gold[n + j] if self.rng.random() < self.rate else (gold[n + j] + 1) % 49152
                for j in range(min(k, len(gold) - n))
            ]
            out.append((d, [self.rate] * len(d)))
        return out

    def observe(self, seq, nd, na):
        pass

    def release(self, seq):
        pass


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
    llm = make_llm(
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "verify_budget": "off"}
    )
    llm.engine.drafter = GoldenDrafter(rate)
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
