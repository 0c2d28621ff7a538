"""Batch-1 decode against gpt-fast's compiled decoder, paired in one process (CUDA).

gpt-fast (pytorch-labs/gpt-fast) is the anchor for batch-1 decode on one GPU: its `model.py`
compiled with `torch.compile(mode="reduce-overhead", fullgraph=True)`, a static KV cache sized
to the run, greedy. It is not a dependency of specserve: `--gpt-fast` names a folder holding
a copy of its `model.py` (`python tools/devcarry.py --gpt-fast CLONE` puts one in
.devcarry/gpt-fast for the device machine).

    python tools/gpt_fast_ab.py --gpt-fast .devcarry/gpt-fast --json out.json

For each model shape every side gets random bf16 weights of that shape and the same prompt ids;
each repeat runs one request on each side, in alternating order, and times its decode (the
tokens after the first over the time they took: prefill left out on both sides). The ratio
specserve / gpt-fast is paired within each repeat (median and 90 % bootstrap interval), and
specserve's decode is also set against the copy-bandwidth roofline measured in the same run.
--off SWITCH adds specserve with that `env.settings` switch off as a further side, paired with
specserve as it ships (what one optimization is worth, in the same run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _load_gpt_fast(folder: Path) -> ModuleType:
    path = folder / "model.py"
    if not path.is_file():
        sys.exit(f"no gpt-fast model.py in {folder} (see --gpt-fast)")
    spec = importlib.util.spec_from_file_location("gpt_fast_model", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dynamo resolves the module's globals by its name
    spec.loader.exec_module(mod)
    return mod


def gpt_fast_args(gf: ModuleType, preset: str, max_seq: int) -> Any:
    """gpt-fast's ModelArgs for one of specserve's dummy presets (the same shape)."""
    from specserve.model.config import ModelConfig
    from specserve.model.loader.dummy import PRESETS

    c = ModelConfig.from_hf(PRESETS[preset])
    assert c.head_dim * c.num_attention_heads == c.hidden_size, "gpt-fast derives head_dim"
    scaling = None
    if c.rope_scaling and c.rope_scaling.get("rope_type") == "llama3":
        scaling = {k: v for k, v in c.rope_scaling.items() if k != "rope_type"}
    return gf.ModelArgs(
        block_size=max_seq,
        vocab_size=c.vocab_size,
        n_layer=c.num_hidden_layers,
        n_head=c.num_attention_heads,
        n_local_heads=c.num_key_value_heads,
        dim=c.hidden_size,
        intermediate_size=c.intermediate_size,
        rope_base=c.rope_theta,
        norm_eps=c.rms_norm_eps,
        rope_scaling=scaling,
    )


class GptFast:
    """gpt-fast's decode as its generate.py runs it: prefill eager, each next token from the
    compiled one-token forward (CUDA graphs through reduce-overhead), greedy."""

    def __init__(self, gf: ModuleType, args: Any, device: torch.device) -> None:
        import torch._inductor.config as inductor

        # generate.py's settings
        inductor.coordinate_descent_tuning = True
        inductor.triton.unique_kernel_names = True
        inductor.fx_graph_cache = True
        torch.set_default_dtype(torch.bfloat16)
        try:
            with device:
                self.model = gf.Transformer(args).eval()
                self.model.setup_caches(max_batch_size=1, max_seq_length=args.block_size)
        finally:
            torch.set_default_dtype(torch.float32)
        self.device = device
        self.step = torch.compile(self._one, mode="reduce-overhead", fullgraph=True)

    def _one(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        logits = self.model(x, pos)  # [1, 1, V]
        return torch.argmax(logits[:, -1], dim=-1, keepdim=True).to(torch.int)

    @torch.no_grad()
    def decode_rate(self, prompt: list[int], max_tokens: int) -> float:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        x = torch.tensor([prompt], dtype=torch.int, device=self.device)
        pos = torch.arange(len(prompt), device=self.device)
        tok = torch.argmax(self.model(x, pos)[:, -1], dim=-1, keepdim=True).to(torch.int)
        pos = torch.tensor([len(prompt)], device=self.device)
        out = [tok]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        # generate.py: math attention (Inductor codegens it), clones of each token
        with sdpa_kernel(SDPBackend.MATH):
            for _ in range(max_tokens - 1):
                nxt = self.step(tok, pos)
                pos += 1
                out.append(nxt.clone())
                tok = nxt.clone()
        torch.cuda.synchronize()
        return (max_tokens - 1) / (time.perf_counter() - t0)


def _specserve_rate(llm: Any, prompt: list[int], max_tokens: int) -> float:
    from specserve import SamplingParams
    from specserve.bench.throughput import _decode_rate

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    (out,) = llm.generate([prompt], sp, use_tqdm=False)
    rate = _decode_rate(out, time.perf_counter() - t0)
    assert rate is not None and len(out.outputs[0].token_ids) == max_tokens
    return rate


def run_shape(gf: ModuleType, preset: str, args: argparse.Namespace) -> dict[str, Any]:
    from specserve import LLM, env
    from specserve.bench.common import free_memory, memory_roofline
    from specserve.bench.report import median_interval

    device = torch.device("cuda")
    max_seq = args.input_len + args.max_tokens
    prompt = [1 + (7919 * j) % 40000 for j in range(args.input_len)]
    t0 = time.perf_counter()
    anchor = GptFast(gf, gpt_fast_args(gf, preset, max_seq), device)
    anchor.decode_rate(prompt, args.max_tokens)  # compile, record the graphs
    anchor.decode_rate(prompt, args.max_tokens)
    compile_s = time.perf_counter() - t0
    engines: dict[str, tuple[Any, dict[str, bool]]] = {}
    for name, off in [("specserve", {}), *((f"specserve {f}=0", {f: False}) for f in args.off)]:
        with env.override(**off):
            llm = LLM(
                model=f"dummy:{preset}",
                dtype="bfloat16",
                max_model_len=4096,
                max_num_seqs=8,
                seed=0,
                progress=False,
            )  # fmt: skip  (h200.sh decode's)
            _specserve_rate(llm, prompt, args.max_tokens)
        engines[name] = (llm, off)
    runs: dict[str, list[float]] = {name: [] for name in [*engines, "gpt-fast"]}
    for r in range(args.repeats):
        for side in list(runs)[:: 1 if r % 2 == 0 else -1]:  # alternating order
            if side == "gpt-fast":
                runs[side].append(anchor.decode_rate(prompt, args.max_tokens))
                continue
            llm, off = engines[side]
            with env.override(**off):
                runs[side].append(_specserve_rate(llm, prompt, args.max_tokens))
    ratios = {
        f"{side} / gpt-fast": median_interval([a / b for a, b in zip(v, runs["gpt-fast"])])
        for side, v in runs.items()
        if side != "gpt-fast"
    }
    for side in engines:
        if side != "specserve":
            pairs = zip(runs["specserve"], runs[side])
            ratios[f"specserve / {side}"] = median_interval([a / b for a, b in pairs])
    ratio = ratios["specserve / gpt-fast"]
    med = {side: statistics.median(v) for side, v in runs.items()}
    roofline = memory_roofline(engines["specserve"][0], med["specserve"])
    del llm, engines, anchor
    torch._dynamo.reset()
    free_memory()
    line = (
        f"{preset}: specserve {med['specserve']:.1f} tok/s, gpt-fast {med['gpt-fast']:.1f} "
        f"tok/s, paired ratio {ratio[0]:.3f} [{ratio[1]:.3f}, {ratio[2]:.3f}]"
    )
    if roofline:
        gf_share = med["gpt-fast"] / roofline["roofline_tok_s"]
        line += (
            f"; roofline {roofline['roofline_tok_s']:.1f} tok/s: specserve "
            f"{100 * roofline['fraction_of_roofline']:.1f} %, gpt-fast {100 * gf_share:.1f} %"
        )
    print(line, flush=True)
    for name, (m, lo, hi) in ratios.items():
        print(f"  {name}: {m:.3f} [{lo:.3f}, {hi:.3f}]", flush=True)
    return {
        "runs_tok_s": runs,
        "median_tok_s": med,
        "ratio_specserve_over_gpt_fast": ratio,
        "ratios": ratios,
        "memory_roofline": roofline,
        "gpt_fast_compile_s": compile_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpt-fast", type=Path, required=True, help="folder with gpt-fast's model.py")
    p.add_argument("--shapes", default="smollm2-135m,llama-3.1-8b", help="dummy presets")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--off",
        action="append",
        default=[],
        help="also run specserve with this env.settings switch off (e.g. gemv_epilogues), paired",
    )
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpt_fast_ab.py needs CUDA (gpt-fast's decoder is compiled for it)")
    from specserve.bench.common import command_line
    from specserve.bench.report import hardware_info, software_info, timestamp, write_json

    gf = _load_gpt_fast(args.gpt_fast)
    report: dict[str, Any] = {
        "benchmark": "gpt-fast-ab",
        "timestamp": timestamp(),
        "command": command_line(),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "hardware": hardware_info(),
        "software": software_info(),
        "shapes": {s: run_shape(gf, s, args) for s in args.shapes.split(",")},
    }
    if args.json_path:
        write_json(report, args.json_path)
        print(
            json.dumps({s: r["ratio_specserve_over_gpt_fast"] for s, r in report["shapes"].items()})
        )


if __name__ == "__main__":
    main()
