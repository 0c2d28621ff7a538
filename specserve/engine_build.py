"""Building an engine: the model, its KV cache and runner, speculation, the scheduler and ledger.

The parts are set on the engine one by one, in the order they need each other: the drafter,
device drafting, the verify budget (its start-up calibration runs steps through the runner) and
the speculator are handed the engine while it is being built and read the parts made before
them. The engine's own step state (requests, counters, the step in flight) is LLMEngine's.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from specserve import env
from specserve.config import EngineConfig
from specserve.distributed import start_tensor_parallel
from specserve.engine.block_manager import BlockManager
from specserve.engine.device import (
    freeze_startup_objects,
    release_dropped_engines,
    resolve_device,
    resolve_dtype,
)
from specserve.engine.ledger import Ledger
from specserve.engine.outputs import OutputPool
from specserve.engine.scheduler import Scheduler
from specserve.engine.slots import DraftSlotPool
from specserve.model.cpu_linear import pack_linears
from specserve.model.loader import cache_dir, load_model
from specserve.model.quant import gguf_source
from specserve.ops.triton_attention import use_triton
from specserve.runner.cuda_graph import CudaGraphBackend
from specserve.runner.model_runner import ModelRunner, kv_bytes_per_block
from specserve.runner.step_sampler import StepSampler
from specserve.runner.timeline import StepTimeline
from specserve.speculative.device_drafting import DEVICE_METHODS, DeviceDrafting
from specserve.speculative.drafter import build_drafter
from specserve.speculative.speculator import Speculator
from specserve.speculative.verify_budget import VerifyBudget
from specserve.step_launch import Launcher
from specserve.structured.backend import GrammarBackend

if TYPE_CHECKING:
    from specserve.llm_engine import LLMEngine


def build(eng: LLMEngine, config: EngineConfig, progress: bool) -> None:
    """Load the model and set up every part of `eng` that steps use (LLMEngine.__init__)."""
    eng.device = resolve_device(config.device)
    release_dropped_engines(eng.device)  # an engine built before, now dropped, goes first
    eng.dtype = resolve_dtype(config.dtype, eng.device)
    eng.kv_dtype = eng.dtype if config.kv_cache_dtype == "auto" else torch.bfloat16
    # tensor parallelism: workers start now; the model loads on the host, then is sharded
    eng.tp = start_tensor_parallel(config, eng.device)
    device = eng.tp.load_device if eng.tp else eng.device
    loaded = load_model(
        config.model, eng.dtype, device, progress, config.tokenizer, config.revision
    )
    if eng.tp:
        loaded.model = eng.tp.shard(loaded.model, loaded.config, eng.dtype)
    elif config.quantization is None:  # quantize_engine swaps the dense layers later
        # CPU: integer blocks / panels / oneDNN (model/cpu_linear.py); a no-op elsewhere
        gguf = gguf_source(config.model, config.revision) if eng.device.type == "cpu" else None
        pack_linears(loaded.model, gguf)
    eng.model_name = loaded.name
    eng.model_config = mc = loaded.config
    eng.tokenizer = loaded.tokenizer
    eng.max_model_len = min(
        config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
    )
    k = config.speculative_config.num_speculative_tokens if config.speculative_config else 0
    eng.max_num_batched_tokens = config.step_token_budget(eng.device.type, eng.max_model_len)
    if eng.max_num_batched_tokens < config.max_num_seqs * (1 + k):
        eng.max_num_batched_tokens = config.max_num_seqs * (1 + k)
    num_blocks = _num_kv_blocks(eng)
    eng.num_kv_blocks = num_blocks
    eng.target_model = loaded.model
    spec = config.speculative_config
    want = config.overlap if config.overlap is not None else eng.device.type == "cuda"
    # Device drafters (n-gram, golden) draft inside the step, so overlap holds with
    # speculation on; they run with overlap (on CPU too, with the forward in the worker).
    # Host drafters (draft model, EAGLE-3) need each step's tokens on the host before they
    # draft the next: with them only the steps that verify no drafts overlap (the verify
    # budget pausing speculation at high load, or nothing to draft: Speculator.may_overlap).
    # (not under tensor parallelism: workers rebuild each step's inputs from its rows and
    # have no slot pool to read drafts from; drafters there run on rank 0's host)
    on_device = (
        spec is not None
        and want
        and spec.method in DEVICE_METHODS
        and env.settings.device_drafts
        and eng.tp is None
    )
    eng.drafter = build_drafter(spec, eng) if spec and not on_device else None
    eng.overlap = want and eng.drafter is None
    eng.overlap_when_paused = want and eng.drafter is not None
    # one slot per running request: drafts live there, and so does the token each request
    # sampled last (runner.next_tokens), which overlap feeds to the next step on the device
    eng.slot_pool = (
        DraftSlotPool(
            config.max_num_seqs,
            k,
            mc.vocab_size,
            (eng.drafter is not None and eng.drafter.has_q)
            or (on_device and spec.method in ("eagle3", "draft_model")),
            eng.device,
        )
        if spec or want
        else None
    )
    eng.device_drafting = (
        DeviceDrafting(spec, eng.slot_pool, mc.vocab_size, config.seed, eng.max_model_len, eng)
        if on_device
        else None
    )
    runner_args = (
        loaded.model,
        mc.num_hidden_layers,
        mc.num_key_value_heads,
        mc.head_dim,
        num_blocks,
        config.block_size,
        eng.dtype,
        eng.device,
        config.max_num_seqs,
    )
    if eng.tp:
        eng.runner = eng.tp.runner(*runner_args)
    else:
        pool = eng.slot_pool
        eng.runner = ModelRunner(
            *runner_args,
            pool.draft_ids if pool is not None else None,
            pool.rejected if pool is not None else None,
            eng.kv_dtype,
        )
    # Before the verify budget's calibration below, so the step-cost curve times the graphs.
    eng.runner.init_cuda_graphs(
        config.max_num_seqs,
        1 + k,
        eng.max_model_len,
        capture=not config.enforce_eager,
        progress=progress,
        drafting=eng.device_drafting.tail_drafting() if eng.device_drafting else None,
        max_mixed_rows=eng.max_num_batched_tokens if env.settings.mixed_graphs else 0,
    )
    if eng.device_drafting and getattr(eng.runner, "graphs", None) and not config.enforce_eager:
        eng.device_drafting.capture(CudaGraphBackend(eng.device))
    if use_triton(eng.device):
        eng.runner.warm_up_eager(
            min(eng.max_num_batched_tokens, eng.max_model_len), eng.max_model_len
        )
    eos = frozenset(mc.eos_token_ids or ([eng.tokenizer.eos_token_id] if eng.tokenizer else []))
    eng.eos_ids = eos
    eng.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
    eng.scheduler = Scheduler(
        eng.block_manager,
        config.max_num_seqs,
        eng.max_num_batched_tokens,
        eng.max_model_len,
        eng.slot_pool,
        device_drafts=eng.device_drafting is not None,
        # a model drafter's chain writes its own KV k - 1 positions past the verified rows
        lookahead=k - 1 if eng.device_drafting and eng.device_drafting.model_drafter else 0,
    )
    # two steps of outputs live at once, each at most every row of a step plus the requests
    # that end without a token in it (aborts, prompt too long)
    cap = config.output_pool_capacity or 2 * (eng.max_num_batched_tokens + 4 * config.max_num_seqs)
    eng.pool = OutputPool(cap)
    eng.ledger = Ledger(eng.scheduler, eng.pool, eos, eng.tokenizer)
    eng.sampler = StepSampler(eng.device, eos, mc.vocab_size, eng.slot_pool)
    eng.launcher = Launcher(eng)  # queues each step's device work (step_launch.py)
    # structured outputs: xgrammar is set up at the first request that needs it
    eng.grammars = GrammarBackend(eng.tokenizer, eng.model_config.vocab_size, eos)
    # CPU ops are synchronous: overlap there needs the forward in a thread of its own (one,
    # so steps still run in order and each reads the next_tokens its predecessor wrote)
    eng._worker = (
        ThreadPoolExecutor(
            1,
            thread_name_prefix="specserve-step",
            # intra-op thread counts are per thread under OpenMP: match the caller's, or the
            # GEMMs block differently and greedy outputs drift from the synchronous path
            initializer=torch.set_num_threads,
            initargs=(torch.get_num_threads(),),
        )
        if want and eng.device.type != "cuda"
        else None
    )
    eng.timeline = StepTimeline(eng.device)  # device idle between steps (benchmarks)
    eng.budget = (
        VerifyBudget.for_engine(eng, cache_dir() if config.cache_step_cost else None)
        if (eng.drafter is not None or on_device) and spec.verify_budget == "auto"
        else None
    )
    eng.speculator = Speculator(eng) if eng.drafter is not None else None
    if eng.device.type == "cuda":
        freeze_startup_objects()


def _num_kv_blocks(eng: LLMEngine) -> int:
    """The KV cache's blocks: what its memory budget holds, capped at what max_num_seqs
    requests of max_model_len tokens can use (plus the padding block)."""
    mc, cfg = eng.model_config, eng.config
    kv_heads = eng.tp.plan.max_kv_heads if eng.tp else mc.num_key_value_heads  # per rank
    per_block = kv_bytes_per_block(
        mc.num_hidden_layers, kv_heads, mc.head_dim, cfg.block_size, eng.kv_dtype
    )
    if cfg.kv_cache_memory_gb is not None:
        budget = int(cfg.kv_cache_memory_gb * 2**30)
    elif eng.device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(eng.device)
        budget = cfg.cuda_kv_budget(free, _total)  # gpu_memory_utilization's share
    else:
        budget = 2 * 2**30
    useful = cfg.max_num_seqs * ((eng.max_model_len + cfg.block_size - 1) // cfg.block_size + 1) + 1
    return max(2, min(budget // per_block, useful))
