"""The output ledger: turns a verified step into appended tokens, stop decisions, a committed KV
ledger and per-token outputs (DESIGN.md, process_outputs + build_request_outputs)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import NamedTuple

from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.outputs import (
    LOGPROB_FLOOR,
    Logprob,
    OutputPool,
    OutputPoolExhausted,
    TokenOutput,
)
from specserve.engine.scheduler import Scheduler, StepBatch
from specserve.engine.sequence import FinishReason, Sequence

log = logging.getLogger("specserve.engine")


class HostStepResult(NamedTuple):
    """The verifier's output, on the host. Rows are the verify layout's (sampling requests only,
    in batch order); R = number of sampling requests."""

    verified_token_ids: list[int]  # [total_q], -1 sentinel
    sampled_token_ids: list[int]  # [R]
    num_accepted: list[int]  # [R]
    token_logprobs: list[float] | None  # [total_q] logprob of the token emitted at each row
    token_ranks: list[int] | None  # [total_q]
    top_ids: list[list[int]] | None  # [total_q][n]
    top_logprobs: list[list[float]] | None  # [total_q][n]
    draft_confidences: list[list[float]] | None = None  # [R][drafts]
    # device drafters: drafts each request really had (its verify rows past them checked -1);
    # None = every verify row checked a draft
    num_real_drafts: list[int] | None = None  # [R]
    # device drafters: the confidences of the drafts the step wrote for each request's next
    # step (the verify budget sizes the step after next by them)
    next_confidences: list[list[float]] | None = None  # [R][k]


@dataclass
class SpecCounters:
    """Engine-wide speculation counters; only tokens actually emitted count as accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    verified_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted_emitted: int) -> None:
        if num_drafts == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted_emitted
        grow = num_drafts - len(self.verified_per_position)
        if grow > 0:
            self.verified_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for j in range(num_drafts):
            self.verified_per_position[j] += 1
        for j in range(num_accepted_emitted):
            self.accepted_per_position[j] += 1


class StopRules(NamedTuple):
    """A request's stop rules and output needs, fixed at its first step (Ledger._rules)."""

    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids: both stop it
    eos: frozenset[int]  # the EOS ids among them (stop_reason None, not the id)
    min_tokens: int
    length_at: int  # LENGTH at this many output tokens (max_tokens or max_model_len)
    num_prompt: int
    # its text is made after its stop decisions (Ledger.fill_text): no stop strings read it
    text_later: bool
    per_token_text: bool  # text_later, streamed token by token (not decoded at its end only)


class _TextJob(NamedTuple):
    """Outputs of one request in one step still without their text (Ledger.fill_text)."""

    seq: Sequence
    outputs: Seq[TokenOutput]  # its outputs of the step, in order
    num_outputs: int  # the request's output tokens before the step


def _clamp(lp: float) -> float:
    return lp if lp > LOGPROB_FLOOR and not math.isnan(lp) else LOGPROB_FLOOR


class Ledger:
    def __init__(
        self,
        scheduler: Scheduler,
        pool: OutputPool,
        eos_ids: frozenset[int],
        tokenizer=None,
    ) -> None:
        self.sched = scheduler
        self.pool = pool
        self.eos_ids = eos_ids
        self.tokenizer = tokenizer
        self.spec = SpecCounters()
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self._text_jobs: list[_TextJob] = []  # filled by fill_text()

    def _rules(self, seq: Sequence) -> StopRules:
        p, detok = seq.params, seq.detokenizer
        eos = frozenset() if p.ignore_eos else self.eos_ids
        length_at = self.sched.max_model_len - seq.num_prompt_tokens
        if p.max_tokens is not None and p.max_tokens < length_at:
            length_at = p.max_tokens
        # a detokenizer without stop strings: no stop decision reads its text
        text_later = detok is not None and not detok.has_stops
        rules = StopRules(
            eos | frozenset(p.stop_token_ids or ()),
            eos,
            p.min_tokens,
            length_at,
            seq.num_prompt_tokens,
            text_later,
            text_later and not detok.deferred,
        )
        seq.stop_rules = rules
        return rules

    def process_outputs(
        self,
        batch: StepBatch,
        res: HostStepResult | None,
        out_step: int | None = None,
        defer_text: bool = False,
    ) -> list[TokenOutput]:
        """Append tokens one at a time with a stop check after each; commit the KV ledger; free
        finished requests; one pooled output per emitted token, finish_reason on the last.
        out_step: the step whose outputs these are for the pool (under overlap, the step being
        handed to the caller, one after the batch's own). defer_text: the outputs of requests
        whose stops read no text (no stop strings) get their text at fill_text(), which the
        caller runs before the next process_outputs (after queueing the next step's device work,
        so detokenization is off the path between a readback and the next launch)."""
        step = batch.step if out_step is None else out_step
        outputs: list[TokenOutput] = []
        now = time.perf_counter()
        r = 0  # index among sampling requests
        row = 0  # first row of request r in the verify layout
        for seq, qlen, nd, samples, epoch in zip(
            batch.seqs, batch.query_lens, batch.num_drafts, batch.samples, batch.epochs
        ):
            seqlen_q = nd + 1
            if seq.is_finished or seq.epoch != epoch:
                # Overlap: it stopped, aborted or was preempted after this step was scheduled.
                # pushed_tokens_before_finish = 0; its KV went with its blocks.
                if samples:
                    r += 1
                    row += seqlen_q
                continue
            if not samples:  # mid-prefill chunk: all rows kept, nothing emitted
                self._register_blocks(seq)
                continue
            assert res is not None
            rules = seq.stop_rules or self._rules(seq)
            num_tokens, num_outputs = len(seq.token_ids), len(outputs)
            try:
                self._push(outputs, seq, qlen, nd, r, row, res, step, now, rules)
            except OutputPoolExhausted:
                raise  # the engine's, not this request's
            except Exception as e:
                # this request's tokens broke something on the host (detokenizer, stop
                # check): end it alone; its outputs of this step are dropped (the pool
                # takes them back with the step), and so are the tokens it appended; the
                # others' are untouched
                del seq.token_ids[num_tokens:]
                del outputs[num_outputs:]
                outputs.append(self.fail_request(seq, e, step))
            r += 1
            row += seqlen_q
        if not defer_text:
            self.fill_text(outputs)
        return outputs

    def fill_text(self, outputs: list[TokenOutput]) -> None:
        """The text of the outputs process_outputs left without it: requests whose stops read no
        text, detokenized token by token (streaming) or at their end at once (deferred text).
        A request whose detokenization fails ends alone, as in the ledger: its outputs of the
        step and the tokens it appended in it are dropped, an error output takes their place."""
        jobs, self._text_jobs = self._text_jobs, []
        failed: list[tuple[_TextJob, Exception]] = []
        for job in jobs:
            seq, outs = job.seq, job.outputs
            detok = seq.detokenizer
            try:
                if not detok.deferred:
                    for out in outs:
                        out.text = detok.append_text(out.token_id)
                last = outs[-1]
                if last.finished and seq.finish_reason is not FinishReason.ERROR:
                    last.text += detok.flush(seq.output_token_ids if detok.deferred else None)
            except Exception as e:
                failed.append((job, e))
        for job, e in failed:
            seq = job.seq
            dropped = {id(o) for o in job.outputs}
            self.num_generated_tokens -= len(dropped)
            del seq.token_ids[seq.num_prompt_tokens + job.num_outputs :]
            outputs[:] = [o for o in outputs if id(o) not in dropped]
            outputs.append(self.fail_request(seq, e, job.outputs[0].step))

    def _push(
        self,
        outputs: list[TokenOutput],
        seq: Sequence,
        qlen: int,
        nd: int,
        r: int,
        row: int,
        res: HostStepResult,
        step: int,
        now: float,
        rules: StopRules,
    ) -> None:
        """Request r of the step: append its accepted prefix and sampled token with a stop check
        after each, commit its KV ledger, finish it on a stop; its outputs, in order, appended
        to `outputs` (their text now, or by fill_text when no stop string reads it)."""
        first = len(outputs)
        if seq.num_pending:
            seq.num_pending -= 1
        if seq.num_pending_drafts:
            seq.num_pending_drafts = max(0, seq.num_pending_drafts - nd)
        accepted = res.num_accepted[r]
        if accepted:
            tokens = res.verified_token_ids[row : row + accepted]
            tokens.append(res.sampled_token_ids[r])
        else:
            tokens = (res.sampled_token_ids[r],)
        token_ids, detok, grammar = seq.token_ids, seq.detokenizer, seq.grammar
        if rules.text_later:
            detok = None  # no stop string reads the text: fill_text makes it
        n_out = len(token_ids) - rules.num_prompt  # output tokens so far
        n_before = n_out
        eos, stop_ids, min_tokens = rules.eos, rules.stop_ids, rules.min_tokens
        length_at = rules.length_at
        stop = None
        for j, tok in enumerate(tokens):
            token_ids.append(tok)
            n_out += 1
            # the stop check feeds the detokenizer, so it runs before the output takes its text
            match = detok.append(tok) if detok is not None else None
            # the first min_tokens tokens never stop (the sampler also masks EOS/stop ids for them)
            if n_out > min_tokens:
                if tok in stop_ids:
                    stop = FinishReason.STOP, None if tok in eos else tok
                elif match is not None:
                    stop = FinishReason.STOP, match.stop_str
            if stop is None and n_out >= length_at:
                stop = FinishReason.LENGTH, None
            # structured outputs: the grammar advances by emitted tokens only; once it is
            # finished the request stops, also where max_tokens ends it at the same token
            if grammar is not None and grammar.advance(tok):
                if stop is None or stop[0] is FinishReason.LENGTH:
                    stop = FinishReason.STOP, None
            outputs.append(self._token_output(seq, tok, n_out, row + j, res, step, detok))
            if stop is not None:
                break
        pushed = len(outputs) - first
        # pushed_tokens_before_finish = pushed; KV keeps the anchor rows + accepted drafts
        anchor = outputs[-1]
        anchor.is_anchor = True
        if nd > accepted:
            seq.commit_processed_tokens(qlen, qlen - nd + accepted)
            self.sched.bm.truncate(seq.block_table, seq.num_computed_tokens)
        self.num_generated_tokens += pushed
        if nd or res.num_real_drafts is not None:
            emitted_drafts = min(accepted, pushed)
            drafted = nd if res.num_real_drafts is None else res.num_real_drafts[r]
            seq.spec.num_drafts += drafted > 0
            seq.spec.num_draft_tokens += drafted
            seq.spec.num_accepted_tokens += emitted_drafts
            self.spec.record(drafted, emitted_drafts)
            anchor.draft_tok, anchor.accept_tok = drafted, emitted_drafts
        # (no drafts: no speculation counter moves, and the anchor's stay 0)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if res.draft_confidences is not None:
            anchor.draft_confidences = res.draft_confidences[r]
        if rules.per_token_text or (stop is not None and rules.text_later):
            self._text_jobs.append(_TextJob(seq, outputs[first:], n_before))
        if stop is not None:
            self.sched.finish(seq, stop[0])
            seq.stop_reason = stop[1]
            self._finish_output(seq, anchor, text=not rules.text_later)
        else:
            self._register_blocks(seq)

    def _register_blocks(self, seq: Sequence) -> None:
        bm, table = self.sched.bm, seq.block_table
        # a block filled since the last call (once every block_size tokens) has work to do
        if len(table.hashes) < seq.num_computed_tokens // bm.block_size:
            bm.register_full_blocks(table, seq.token_ids, seq.num_computed_tokens)

    def _token_output(
        self,
        seq: Sequence,
        tok: int,
        n_out: int,
        row: int,
        res: HostStepResult,
        step: int,
        detok: IncrementalDetokenizer | None,
    ) -> TokenOutput:
        """The pooled output of seq's n_out-th output token, tok (verify-layout row `row`);
        its text from `detok` (None: no text per token)."""
        out = self.pool.acquire(step)
        out.request_id = seq.request_id
        out.token_id = tok
        out.index = n_out - 1
        out.num_output_tokens = n_out
        if res.token_logprobs is not None:
            out.logprob = _clamp(res.token_logprobs[row])
            if seq.params.logprobs is not None:
                top = {tok: Logprob(out.logprob, res.token_ranks[row], self._decode(tok))}
                n = seq.params.logprobs
                for rank, (tid, lp) in enumerate(
                    zip(res.top_ids[row][:n], res.top_logprobs[row][:n])
                ):
                    if tid not in top:
                        top[tid] = Logprob(_clamp(lp), rank + 1, self._decode(tid))
                out.top_logprobs = top
        if n_out == 1 and seq.params.prompt_logprobs is not None:
            # the prompt's scores ride on the first output (a one-token prompt has none to score)
            state = seq.prompt_logprobs_state
            out.prompt_logprobs = state.result(self._decode) if state is not None else [None]
        if detok is not None:
            out.text = detok.take_delta()
        return out

    def _decode(self, tok: int) -> str | None:
        return self.tokenizer.decode([tok]) if self.tokenizer is not None else None

    def _finish_output(self, seq: Sequence, out: TokenOutput, text: bool = True) -> None:
        """The request's last output: finished, its reasons, and (text) its remaining text;
        text=False: fill_text adds that."""
        # a failed request's held-back text is not released: its detokenizer may be what failed
        detok = seq.detokenizer if text else None
        if detok is not None and seq.finish_reason is not FinishReason.ERROR:
            out.text += detok.flush(seq.output_token_ids if detok.deferred else None)
        elif detok is not None and detok.deferred:
            # text decoded only at the end (no stop strings): the tokens emitted before the
            # failure still get theirs, as they would have streamed it, unless decoding fails
            try:
                out.text += detok.flush(seq.output_token_ids)
            except Exception:
                pass
        out.finished = True
        out.finish_reason = seq.finish_reason.value
        out.stop_reason = seq.stop_reason

    def fail_request(self, seq: Sequence, exc: BaseException, step: int) -> TokenOutput:
        """fail() and the request's terminal output, at once (a failure inside the ledger)."""
        self.fail(seq, exc)
        return self.terminal_output(seq, step)

    def fail(self, seq: Sequence, exc: BaseException) -> None:
        """End a request whose inputs made its work fail: finish_reason "error", the failure as
        its stop_reason; blocks and slot freed."""
        log.warning("request %s failed: %s: %s", seq.request_id, type(exc).__name__, exc)
        if not seq.is_finished:
            self.sched.finish(seq, FinishReason.ERROR)
        seq.finish_reason = FinishReason.ERROR
        seq.stop_reason = f"{type(exc).__name__}: {exc}"

    def terminal_output(self, seq: Sequence, step: int) -> TokenOutput:
        """The single output of a request that ends without a token (abort, prompt too long)."""
        out = self.pool.acquire(step)
        out.request_id = seq.request_id
        out.token_id = -1
        out.index = seq.num_output_tokens
        out.num_output_tokens = seq.num_output_tokens
        out.is_anchor = True
        self._finish_output(seq, out)
        return out
