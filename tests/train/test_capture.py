"""The target's side of training against transformers: the aux streams are HF's
output_hidden_states at the layer ids (the residual stream entering those layers), and the
compact logits (draft-vocabulary logits, log-normaliser, argmax) are HF's logits."""

from __future__ import annotations

from pathlib import Path

import torch

from specserve.model.loader import load_model
from specserve.train.capture import aux_layer_ids_for, capture_target


def test_capture_matches_hf_hidden_states_and_logits(train_target_dir: Path) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(train_target_dir)).eval()
    ours = load_model(str(train_target_dir), torch.float32, torch.device("cpu"), progress=False)
    seqs = [[1, 17, 300, 4000, 21, 9, 77], [1, 5, 6]]
    draft_ids = torch.tensor([0, 2, 9, 77, 300, 4000, 49151])
    layer_ids = (0, 1, 2)
    rows = capture_target(ours.model, seqs, layer_ids, draft_ids)
    assert rows.lens == [7, 3] and rows.aux_hidden.shape == (10, 3 * 64)
    for seq, part in zip(seqs, rows.split()):
        with torch.no_grad():
            out = hf(torch.tensor([seq]), output_hidden_states=True)
        want = torch.cat([out.hidden_states[i][0] for i in layer_ids], dim=-1)
        torch.testing.assert_close(part.aux_hidden, want, atol=1e-4, rtol=1e-4)
        logits = out.logits[0].float()
        torch.testing.assert_close(part.draft_logits, logits[:, draft_ids], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(part.logsumexp, logits.logsumexp(-1), atol=1e-4, rtol=1e-4)
        assert part.greedy.tolist() == logits.argmax(-1).tolist()
    assert ours.model.aux_capture is None  # the scratch capture is gone again


def test_repeated_layer_ids_repeat_the_block(train_target_dir: Path) -> None:
    ours = load_model(str(train_target_dir), torch.float32, torch.device("cpu"), progress=False)
    ids = torch.arange(8)
    rows = capture_target(ours.model, [[1, 2, 3, 4]], (0, 1, 1), ids)
    h = 64
    assert torch.equal(rows.aux_hidden[:, h : 2 * h], rows.aux_hidden[:, 2 * h :])
    # EAGLE-3's default ids where they are valid; clamped (and repeated) on shallower targets
    assert aux_layer_ids_for(32) is None and aux_layer_ids_for(3) is None
    assert aux_layer_ids_for(2) == (0, 1, 1)
