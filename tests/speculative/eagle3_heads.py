"""What the EAGLE-3 tests share: a head that drafts well on a random target (_copy_head, written
in the vLLM/SGLang format), the target layers it reads, a spy on the host drafter's proposals.
tests/gpu/test_eagle3.py, tests/distributed/test_tp_drafters.py and
tests/structured/test_eagle3_schemas.py import them too."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from specserve import SamplingParams
from specserve.model.config import ModelConfig
from specserve.model.loader import load_model
from specserve.model.loader.dummy import PRESETS
from tests.model.test_eagle3_format import head_config, write_head

LAYERS = [0, 2, 3]  # explicit: a 4-layer target's default ids (2, 2, 1) repeat a layer
SP = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def tiny_target(root: Path) -> tuple[str, ModelConfig]:
    """A random 4-layer tiny Llama written under root (EAGLE-3 reads 3 distinct layers)."""
    cfg = dict(PRESETS["tiny"], num_hidden_layers=4)
    (root / "config.json").write_text(json.dumps(cfg))
    return f"dummy:{root}", ModelConfig.from_hf(cfg)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _copy_head(path: Path, target: tuple[str, ModelConfig], ref, device: str = "cpu") -> Path:
    """A head that drafts the context's majority token (fc = 0, uniform attention over the
    normed embeddings, lm_head rows = normed target embeddings): it is often right on the
    repetitive outputs of a random target, so accepts of every length happen."""
    tc = target[1]
    h = tc.hidden_size
    counts = Counter(t for r in ref for t in r)
    ids = sorted({t for t, _ in counts.most_common(12)} | set(range(200, 212)))
    # the embedding the target has on `device` (a dummy model's weights depend on the device)
    emb = load_model(target[0], torch.float32, torch.device(device), progress=False)
    e = emb.model.embed_tokens.weight.detach().cpu()
    e = e / e.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
    z = torch.zeros
    g = torch.Generator().manual_seed(3)
    qk = torch.randn(h, 2 * h, generator=g) * 0.02  # near-uniform attention, rope still matters
    t = {
        "fc.weight": z(h, 3 * h),
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.self_attn.q_proj.weight": qk,
        "midlayer.self_attn.k_proj.weight": qk.clone(),
        "midlayer.self_attn.v_proj.weight": torch.cat([torch.eye(h), z(h, h)], 1),
        "midlayer.self_attn.o_proj.weight": torch.eye(h),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "midlayer.mlp.gate_proj.weight": z(2 * h, h),
        "midlayer.mlp.up_proj.weight": z(2 * h, h),
        "midlayer.mlp.down_proj.weight": z(h, 2 * h),
        "norm.weight": torch.ones(h),
        "lm_head.weight": e[ids] * 4,
        "d2t": torch.tensor(ids) - torch.arange(len(ids)),
        "t2d": torch.zeros(tc.vocab_size, dtype=torch.bool).index_fill_(0, torch.tensor(ids), 1),
    }
    cfg = head_config(h, 2 * h, h // 16, h // 16, 16, tc.vocab_size, len(ids))
    cfg["eagle_aux_hidden_state_layer_ids"] = LAYERS
    return write_head(path, cfg, t)


TEMPS = [0.5, 2.0]  # per draft position; the last one for the positions after


def _with_temperatures(path: Path) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    cfg["confidence_temperatures"] = TEMPS
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _spec(path: Path, k: int = 3, **kw) -> dict:
    return {"method": "eagle3", "model": str(path), "num_speculative_tokens": k, **kw}


def _spy(llm) -> list[tuple[list[int], list[int], list[float], int]]:
    """Record (tokens at drafting time, drafts, confidences, positions caught up after the
    first output token, else 0) of every proposal."""
    drafter = llm.engine.drafter
    orig, records = drafter.propose, []

    def spy(seqs, limits):
        snap = [list(s.token_ids) for s in seqs]
        late = [
            s.num_tokens - 1 - drafter._marks.valid(s) if s.num_output_tokens > 1 else 0
            for s in seqs
        ]
        out = orig(seqs, limits)
        records.extend((t, d, c, n) for t, (d, c), n in zip(snap, out, late) if d)
        return out

    drafter.propose = spy
    return records
