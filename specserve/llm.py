"""The offline API, vLLM-shaped: LLM(...).generate / .chat / .stream / .abort."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from specserve.chat import (
    chat_template_tools,
    check_template_kwargs,
    render_chat,
    template_messages,
)
from specserve.config import DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig
from specserve.engine.outputs import OutputAccumulator, RequestMetrics, RequestOutput, TokenOutput
from specserve.fanout import sample_params
from specserve.inputs import EnginePrompt, PromptType, parse_prompts
from specserve.llm_engine import build_engine
from specserve.sampling_params import InvalidRequestError, SamplingParams
from specserve.structured.tool_parser import parse_tool_calls
from specserve.structured.tools import (
    ToolFunction,
    parse_tool_choice,
    parse_tools,
    tool_call_constraint,
)

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


class LLM:
    def __init__(
        self,
        model: str | None = None,
        speculative_config: dict | str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        seed: int = 0,
        progress: bool = True,
        *,
        tokenizer: str | None = None,
        revision: str | None = None,
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        quantization: str | None = None,
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        enable_chunked_prefill: bool | None = None,
        **kwargs: Any,
    ) -> None:
        for key in kwargs:
            if key not in _CONFIG_FIELDS:
                raise TypeError(f"LLM() got an unexpected keyword argument {key!r}")
        cfg = EngineConfig(  # validates every argument before anything is loaded
            model=model,
            tokenizer=tokenizer,
            revision=revision,
            trust_remote_code=trust_remote_code,
            dtype=dtype,
            device=device,
            tensor_parallel_size=tensor_parallel_size,
            quantization=quantization,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            gpu_memory_utilization=gpu_memory_utilization,
            speculative_config=speculative_config,
            seed=seed,
            **kwargs,
        )
        self.engine = build_engine(cfg, progress=progress)
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name

    def get_tokenizer(self) -> Any:
        """The transformers tokenizer the engine encodes and decodes with (vLLM's API)."""
        return self.tokenizer

    # -- helpers ----------------------------------------------------------------------------
    @staticmethod
    def _params_list(
        params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise InvalidRequestError(
                f"got {len(params)} sampling params for {n} prompts", "sampling_params"
            )
        return params

    def _add_all(
        self, prompts: list[EnginePrompt], params: list[SamplingParams], defer_text: bool = False
    ) -> list[list[str]]:
        """Queue every prompt's n samples; the engine request ids, grouped per prompt. Nothing
        stays queued when any prompt is refused. defer_text: see LLMEngine.add_request."""
        for p, sp in zip(prompts, params):
            sp.validate()
            if len(p) == 0:
                raise InvalidRequestError("prompt must not be empty", "prompt")
        groups: list[list[str]] = []
        try:
            for p, sp in zip(prompts, params):
                groups.append([])
                for sample in sample_params(sp):
                    seq = self.engine.add_request(p, sample, defer_text=defer_text)
                    groups[-1].append(seq.request_id)
        except BaseException:
            for rid in (rid for g in groups for rid in g):
                self.engine.abort(rid)
            self._drain_terminal()
            raise
        return groups

    # -- API --------------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order, holding its params' n CompletionOutputs."""
        plist = parse_prompts(prompts)
        params = self._params_list(sampling_params, len(plist))
        # the accumulators join the text only at the end: decoded once per request
        groups = self._add_all(plist, params, defer_text=True)
        ids = [rid for g in groups for rid in g]
        seqs = {rid: self.engine.requests[rid] for rid in ids}
        accs = {
            rid: OutputAccumulator(
                rid,
                seq.prompt,
                seq.prompt_token_ids,
                seq.params.logprobs is not None,
                RequestMetrics(seq.arrival_time, num_prompt_tokens=seq.num_prompt_tokens),
            )
            for rid, seq in seqs.items()
        }
        bar = tqdm(total=len(groups), desc="Generating", disable=not use_tqdm, unit="req")
        left = {rid: len(g) for g in groups for rid in g[:1]}  # unfinished samples per prompt
        group_of = {rid: g[0] for g in groups for rid in g}
        pending = set(ids)
        try:
            while pending:
                for out in self.engine.step():
                    acc = accs.get(out.request_id)
                    if acc is None:
                        continue
                    acc.add(out)
                    if out.finished:
                        pending.discard(out.request_id)
                        head = group_of[out.request_id]
                        left[head] -= 1
                        bar.update(left[head] == 0)
        except BaseException:
            for rid in pending:
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
            self.engine.release_outputs()  # everything was copied into the accumulators
        return [self._group_result(g, seqs, accs) for g in groups]

    @staticmethod
    def _group_result(
        group: list[str], seqs: dict[str, Any], accs: dict[str, OutputAccumulator]
    ) -> RequestOutput:
        """A prompt's samples as one RequestOutput (vLLM's shape): its first sample's request
        id, prompt fields and metrics, with the token and draft counts summed over samples."""
        results = []
        for rid in group:
            seq = seqs[rid]
            m = accs[rid].metrics
            m.first_token_time, m.finished_time = seq.first_token_time, seq.finished_time
            m.num_output_tokens = seq.num_output_tokens
            m.num_cached_tokens = seq.num_cached_tokens
            m.num_preemptions = seq.num_preemptions
            m.num_drafts = seq.spec.num_drafts
            m.num_draft_tokens = seq.spec.num_draft_tokens
            m.num_accepted_tokens = seq.spec.num_accepted_tokens
            results.append(accs[rid].result())
        head = results[0]
        if len(results) == 1:
            return head
        metrics = dataclasses.replace(head.metrics)
        ms = [r.metrics for r in results]
        firsts = [m.first_token_time for m in ms if m.first_token_time is not None]
        lasts = [m.finished_time for m in ms if m.finished_time is not None]
        metrics.first_token_time = min(firsts) if firsts else None
        metrics.finished_time = max(lasts) if lasts else None
        for name in (
            "num_output_tokens",
            "num_preemptions",
            "num_drafts",
            "num_draft_tokens",
            "num_accepted_tokens",
        ):
            setattr(metrics, name, sum(getattr(m, name) for m in ms))
        outputs = [dataclasses.replace(r.outputs[0], index=i) for i, r in enumerate(results)]
        return dataclasses.replace(
            head, outputs=outputs, finished=all(r.finished for r in results), metrics=metrics
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | list[ToolFunction] | None = None,
    ) -> list[int]:
        """A conversation's prompt token ids under the model's chat template (vLLM's rules);
        tools and tool history in the template's tool format."""
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        kwargs = check_template_kwargs(chat_template_kwargs)
        kwargs["add_generation_prompt"] = add_generation_prompt
        kwargs["continue_final_message"] = continue_final_message
        fns = tools if tools and isinstance(tools[0], ToolFunction) else parse_tools(tools)
        _, ids = render_chat(
            self.tokenizer,
            template_messages(messages),
            kwargs,
            add_special_tokens,
            chat_template,
            fns,  # type: ignore[arg-type]
        )
        return ids

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
        lora_request: Any = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        chat_template_content_format: str = "auto",
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool = True,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation or a list of them. Text content (a string or text
        parts) only; LoRA and multimodal arguments are refused by name. tools (OpenAI's
        definitions) are rendered in the template's tool format; tool_choice 'required' or a
        named function ({"type": "function", "function": {"name": ...}}) constrains the output
        to calls whose arguments follow the functions' schemas ('auto', the default with tools,
        leaves it free). parse_tool_calls() reads the calls out of an output's text."""
        fns = parse_tools(tools)
        choice = parse_tool_choice(tool_choice, fns)
        if not isinstance(parallel_tool_calls, bool):
            raise InvalidRequestError(
                "parallel_tool_calls must be a boolean", "parallel_tool_calls"
            )
        constraint = tool_call_constraint(
            fns,
            choice,
            parallel_tool_calls,
            chat_template_tools(self.tokenizer, chat_template).format,
        )
        if lora_request is not None:
            raise InvalidRequestError(
                "lora_request: LoRA adapters are not supported", "lora_request"
            )
        if mm_processor_kwargs:
            raise InvalidRequestError(
                "mm_processor_kwargs: multimodal input is not supported", "mm_processor_kwargs"
            )
        if chat_template_content_format not in ("auto", "string"):  # text parts are joined
            raise InvalidRequestError(
                "chat_template_content_format must be 'auto' or 'string', got "
                f"{chat_template_content_format!r}",
                "chat_template_content_format",
            )
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.apply_chat_template(
                c,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
                add_special_tokens=add_special_tokens,
                tools=fns,
            )
            for c in convs
        ]
        if constraint is not None:
            plist = self._params_list(sampling_params, len(prompts))
            if any(sp.structured_outputs is not None for sp in plist):
                raise InvalidRequestError(
                    f"tool_choice {choice!r} cannot be combined with structured_outputs",
                    "tool_choice",
                )
            sampling_params = [
                dataclasses.replace(sp, structured_outputs=constraint) for sp in plist
            ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def parse_tool_calls(
        self, text: str, chat_template: str | None = None
    ) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls in OpenAI's shape) of a chat output's text, read in the chat
        template's tool format; content None when the output holds only calls."""
        fmt = chat_template_tools(self.tokenizer, chat_template).format
        content, calls = parse_tool_calls(text, fmt)
        return content, [c.openai() for c in calls]

    def stream(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[TokenOutput]:
        """Yield the per-token outputs of all these requests as they land. Keep them as long as
        you like: the engine's output pool reuses only the ones nobody references any more
        (OutputPool.release_through), so none is copied. Closing the iterator aborts what is
        unfinished. A TokenOutput names its request only, so n > 1 is refused here: use
        generate() for n samples."""
        plist = parse_prompts(prompts)
        params = self._params_list(sampling_params, len(plist))
        if any(sp.n > 1 for sp in params):
            raise InvalidRequestError(
                "LLM.stream yields one sequence per prompt: n > 1 needs LLM.generate", "n"
            )
        ids = [rid for g in self._add_all(plist, params) for rid in g]
        pending = set(ids)
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            for rid in pending:
                self.engine.abort(rid)
            self._drain_terminal()

    def _drain_terminal(self) -> None:
        # report aborted requests now so the engine is idle (blocks free, pool full) afterwards
        while self.engine._terminal:
            self.engine.step()
        self.engine.release_outputs()  # the pool keeps its hands off the ones still referenced

    def abort(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self.engine.abort(rid)

    def _budget_metrics(self) -> dict[str, Any]:
        b = self.engine.budget
        if b is None:
            return {}
        return {
            "verify_budget_offered_draft_rows": b.offered_rows,
            "verify_budget_chosen_draft_rows": b.chosen_rows,
            "verify_budget_seqlens_q": b.seqlens_q(),  # query length -> requests given it
            "verify_budget_expected_accepted_tokens": b.expected_accepted,
            "step_cost_curve": b.curve.points(),  # (bucket rows, seconds) as priced now
            # a model drafter's: plans that drafted / did not, and what drafting adds to a step
            "verify_budget_drafting_steps": b.num_drafting_steps,
            "verify_budget_plain_steps": b.num_plain_steps,
            "verify_budget_drafting_seconds": b.chain_seconds() if b.drafting else None,
        }

    def get_metrics(self) -> dict[str, Any]:
        led = self.engine.ledger
        spec = led.spec
        st = self.engine.stats()
        return {
            "num_steps": self.engine.num_steps,
            "num_sync_steps": self.engine.num_sync_steps,
            "num_deferred_steps": self.engine.num_deferred_steps,
            "num_prompt_steps": self.engine.num_prompt_steps,
            "generated_tokens": led.num_generated_tokens,
            "num_running": st.num_running,
            "num_waiting": st.num_waiting,
            "kv_usage": st.kv_usage,
            "spec_drafts": spec.num_drafts,
            "spec_draft_tokens": spec.num_draft_tokens,
            "spec_accepted_tokens": spec.num_accepted_tokens,
            "spec_acceptance_per_position": [
                a / v if v else 0.0
                for a, v in zip(spec.accepted_per_position, spec.verified_per_position)
            ],
            "spec_mean_acceptance_length": (
                1.0 + spec.num_accepted_tokens / spec.num_drafts if spec.num_drafts else 1.0
            ),
            **self._budget_metrics(),
            # structured outputs: host time filling grammar bitmasks (steps with a grammar row)
            "structured_mask_steps": self.engine.grammars.stats.steps,
            "structured_mask_rows": self.engine.grammars.stats.rows,
            "structured_mask_seconds": self.engine.grammars.stats.seconds,
            "structured_grammars_compiled": self.engine.grammars.num_compiled,
        }
