"""Tiny random sliding-window checkpoints (Mistral / Qwen2 / Qwen3, windows 4-16) and the checks
against transformers shared by tests/model/test_sliding_window.py (CPU) and
tests/gpu/test_sliding_window.py (Triton kernels, CUDA graphs).

Each family configures the window a different HF way: Mistral slides every layer, Qwen2 derives
the sliding layers from max_window_layers (layers >= it slide), Qwen3 reads layer_types.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specserve import LLM, SamplingParams
from tests.conftest import _TINY
from tests.model.harness import PagedRunner, assert_logits_close

# name: (transformers config class, overrides)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral_w4": ("MistralConfig", {"sliding_window": 4, "head_dim": 16}),
    "qwen2_w16_mixed": (
        "Qwen2Config",
        {
            "use_sliding_window": True,
            "sliding_window": 16,
            "max_window_layers": 1,
            "num_hidden_layers": 3,
        },
    ),
    "qwen3_w7_layer_types": (
        "Qwen3Config",
        {
            "head_dim": 16,
            "use_sliding_window": True,
            "sliding_window": 7,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
    ),
}
PROMPT_LENS = (40, 9, 23)  # 9: shorter than the 16-key window, the rest longer than every one
# verify_budget off: every step verifies what the drafter proposes (no step-cost choice)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
SELF_DRAFT = {"method": "draft_model", "num_speculative_tokens": 3, "model": "self"}
NGRAM["verify_budget"] = SELF_DRAFT["verify_budget"] = "off"


def make_hf(family: str) -> torch.nn.Module:
    import transformers

    cls_name, overrides = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**_TINY, **overrides})
    arch = cls_name.replace("Config", "ForCausalLM")
    config.architectures = [arch]
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if attn.q_proj.bias is not None:  # Qwen2: HF zero-inits the biases
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model


def save_dirs(root: Path, tokenizer: Any) -> dict[str, Path]:
    out = {}
    for family in FAMILIES:
        d = root / family
        make_hf(family).save_pretrained(str(d))
        tokenizer.save_pretrained(str(d))
        out[family] = d
    return out


def load_hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_windows(hf: torch.nn.Module) -> list[int]:
    """The window each HF layer applies (0 = full), read off HF's config as its modeling does."""
    c = hf.config
    if c.sliding_window is None:
        return [0] * c.num_hidden_layers
    if c.model_type == "mistral":  # MistralAttention: config.sliding_window on every layer
        return [c.sliding_window] * c.num_hidden_layers
    return [c.sliding_window if t == "sliding_attention" else 0 for t in c.layer_types]


def hf_reference(hf: torch.nn.Module, vocab: int):
    """Prompts, a 12-token continuation and HF's logits over each prompt + continuation."""
    ps = prompts(vocab)
    continuation = prompts(vocab, seed=1)[0][:12]
    with torch.no_grad():
        ref = [hf(torch.tensor([p + continuation])).logits[0] for p in ps]  # [L, V] each
    return ps, continuation, ref


def check_logits(
    model: torch.nn.Module,
    config: Any,
    reference,
    chunk: int | None,
    device: torch.device | str = "cpu",
    atol: float = 2e-5,
    rtol: float = 1e-4,
) -> None:
    """Prefill (whole or in chunks), then steps of several rows per request (verify-shaped:
    1 + drafts) and of one row, all requests in each forward: every row's logits vs HF's."""
    ps, continuation, ref = reference
    runner = PagedRunner(model, config, block_size=4, device=device)
    done = [0] * len(ps)
    while any(d < len(p) for d, p in zip(done, ps)):
        batch = []
        for i, p in enumerate(ps):
            if done[i] < len(p):
                n = len(p) - done[i] if chunk is None else min(chunk, len(p) - done[i])
                batch.append((i, p[done[i] : done[i] + n], done[i]))
                done[i] += n
        logits = runner.logits([(i, toks) for i, toks, _ in batch]).cpu()
        row = 0
        for i, toks, start in batch:
            want = ref[i][start : start + len(toks)]
            got = logits[row : row + len(toks)]
            assert_logits_close(got, want, f"prompt {i} rows {start}+", atol, rtol)
            row += len(toks)
    fed = [0] * len(ps)
    for step, sizes in enumerate([(4, 1, 3), (1, 5, 1), (3, 2, 4), (1, 1, 1), (3, 3, 3)]):
        batch = [(i, continuation[fed[i] : fed[i] + n]) for i, n in enumerate(sizes)]
        logits = runner.logits(batch, pad_rows=step % 2).cpu()
        row = 0
        for i, toks in batch:
            start = len(ps[i]) + fed[i]
            want = ref[i][start : start + len(toks)]
            got = logits[row : row + len(toks)]
            assert_logits_close(got, want, f"prompt {i} step {step}", atol, rtol)
            row += len(toks)
            fed[i] += len(toks)


def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """HF's greedy tokens, every step a full forward (HF's own mask over the whole sequence)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def engine_prompts(hf: torch.nn.Module, vocab: int) -> list[list[int]]:
    """Random prompts, one of them p + HF's continuation of p + p: the n-gram drafter proposes
    that continuation again. Mistral (every layer windowed, 2 x 3 + 1 positions seen) continues
    the second p as the first, so its drafts exist and are accepted."""
    ps = prompts(vocab, seed=2)
    ps[2] = ps[2] + hf_greedy(hf, ps[2], 10) + ps[2]
    return ps


def check_engine_greedy(
    family: str, path: Path, hf: torch.nn.Module, vocab: int, n: int = 20, **engine_kw: Any
) -> list[Any]:
    """The engine (16-token step budget: prompts prefill in chunks) emits HF's greedy tokens,
    without speculation and with n-gram / draft-model speculation (verify rows across the
    window). Returns each engine's CUDA-graph runner (None off CUDA), for the caller's checks."""
    ps = engine_prompts(hf, vocab)
    want = [hf_greedy(hf, p, n) for p in ps]
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    graphs = []
    for spec in (None, NGRAM, SELF_DRAFT):
        llm = LLM(
            model=str(path),
            dtype="float32",
            progress=False,
            max_num_batched_tokens=16,
            enable_chunked_prefill=True,
            speculative_config=spec,
            debug_invariants=True,
            **engine_kw,
        )
        outs = llm.generate(ps, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, spec
        m = llm.get_metrics()
        if spec is SELF_DRAFT or (spec is NGRAM and family.startswith("mistral")):
            assert m["spec_draft_tokens"] > 0 and m["spec_accepted_tokens"] > 0, spec
        assert llm.engine.block_manager.num_used_blocks == 0
        graphs.append(llm.engine.runner.graphs)
    return graphs
