"""The engine: requests in, one step at a time — schedule, execute, sample, stop — tokens out.

    engine = Engine(OrtExecutor("model.paged.onnx"), SchedulerConfig(max_num_seqs=32), eos_token_ids=(2,))
    engine.add_request("a", prompt_ids, SamplingParams(max_new_tokens=32))
    while engine.has_unfinished:
        for request in engine.step():       # the requests that got a token (or finished) in this step
            ...                             # request.output, request.text, request.finish_reason

A step (``step``): the scheduler picks decodes and prefill chunks and reserves their KV
(``pagedkv.runtime.scheduler``); the KV manager builds the step metadata for all of them at once
(``build_step_many``); the executor runs the step and its sampling head picks the next token of every request
whose known tokens are now all in the cache (one logits row each: ``logits_rows``); the step is committed
(``commit_many``); each sampled request gets its token, its logprobs when asked for, its text with a tokenizer,
and is finished at an EOS / stop token, a stop string, ``max_new_tokens`` or the context limit — its blocks
freed at once. The engine holds no global state and is single-threaded: ``pagedkv.runtime.api.Worker`` runs it
on a thread behind a queue.

Host time per step is kept in ``timing`` (schedule / prepare / execute / finish, seconds):
``benchmarks/bench_runtime.py`` measures it.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np

from pagedkv.pool_group import WindowMode
from pagedkv.runtime.executor import SamplingInputs, StepInputs
from pagedkv.runtime.request import ContextLengthError, FinishReason, Request, RequestState, TokenLogprobs
from pagedkv.runtime.sampling import SamplingParams, derive_seed, host_sample, sampling_inputs
from pagedkv.runtime.scheduler import Scheduler, SchedulerConfig


@dataclass
class StepTiming:
    """Host seconds of the last step's phases; ``execute`` is the executor's run (device or ONNX Runtime)."""

    schedule: float = 0.0  # scheduler + KV reservations
    prepare: float = 0.0  # step metadata, input ids, sampling rows
    execute: float = 0.0
    finish: float = 0.0  # commit, tokens, stops, frees

    @property
    def host(self) -> float:
        return self.schedule + self.prepare + self.finish


_ONE = np.uint64(1)  # (a draw counter's step)


class _SamplerRows:
    """The per-request values a step's samplers need as arrays (kept while the same requests sample again):
    sampling-parameter rows, seeds, draw counters (tokens generated so far), the counter of each one's last
    token (``max_new_tokens - 1``), and which of them stop exactly at the model's EOS (``default_stop``) or
    need the per-token slow path (``slow``: penalties, logprobs, text, their own stop tokens)."""

    def __init__(self, samplers: list, eos: frozenset):
        self.requests = list(samplers)
        n = len(samplers)
        self.params = np.stack([r.row for r in samplers]) if n else np.zeros((0, 8), np.float32)
        self.seeds = np.fromiter((r.seed for r in samplers), np.uint64, n)
        self.counters = np.fromiter((len(r.output) for r in samplers), np.uint64, n)
        self.last_counter = np.fromiter((r.max_tokens - 1 for r in samplers), np.uint64, n)  # (max_tokens >= 1)
        self.eos = tuple(sorted(eos))
        self.default_stop = np.fromiter((r.stop_ids == eos for r in samplers), bool, n)
        self.slow = np.fromiter((r.extras or r.stop_ids != eos for r in samplers), bool, n)
        self.slow_any = bool(self.slow.any())


class Engine:
    """Continuous batching over one executor (module docstring).

    Args:
        executor: an ``Executor`` (``OrtExecutor``, ``TrtExecutor``); the engine drives its KV manager.
        config: the scheduler's limits and preemption policy.
        max_model_len: context limit (prompt + output tokens); default: what the KV pool (and a static block
            table) can hold for one sequence.
        eos_token_ids: the model's EOS ids (``tokenizer.eos_token_ids(model_dir)``), where generation stops.
        tokenizer: a ``pagedkv.runtime.tokenizer.Tokenizer`` for text output and stop strings (optional).
        seed: base of the seeds of requests that bring none.
    """

    def __init__(self, executor, config: SchedulerConfig | None = None, *, max_model_len: int | None = None,
                 eos_token_ids=(), tokenizer=None, seed: int = 0):
        self.executor = executor
        self.manager = executor.manager
        self.graph = executor.graph
        self.config = config or SchedulerConfig()
        self.scheduler = Scheduler(self.manager, self.config)
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.seed = int(seed)
        capacity = self._capacity()
        self.max_model_len = min(int(max_model_len), capacity) if max_model_len else capacity
        self.requests: dict[object, Request] = {}  # unfinished requests by id
        self._arrivals = itertools.count()
        self.timing = StepTiming()
        self._last: tuple = ([], None)  # the previous step's samplers and their tokens
        self._rows = _SamplerRows([], self.eos_token_ids)  # the previous step's samplers, as arrays
        self._penalized = 0  # unfinished requests with penalties

    def _capacity(self) -> int:
        """Tokens one sequence can hold: every full-attention group's pool (and a static block-table width)."""
        graph, mgr = self.graph, self.manager
        limits = [nb * g.page_size for g, nb in zip(mgr.groups, mgr.num_blocks) if g.mode == WindowMode.FULL]
        if graph.max_blocks:
            limits += [graph.max_blocks * g.page_size for g in mgr.groups if g.mode == WindowMode.FULL]
        return min(limits) if limits else 2 ** 31 - 1

    # ---- requests --------------------------------------------------------------------------------------
    def check_request(self, prompt_ids, params: SamplingParams) -> tuple[np.ndarray, int]:
        """Validate a request without touching the engine's state (safe from any thread): the prompt as int64
        ids and the resolved max_new_tokens. ``ValueError`` for a bad prompt or parameters,
        ``ContextLengthError`` when prompt + max_new_tokens exceed the context limit."""
        prompt = np.asarray(prompt_ids).ravel()
        if prompt.size == 0:
            raise ValueError("prompt: it is empty")
        if not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError(f"prompt: expected token ids (integers), got {prompt.dtype}")
        prompt = prompt.astype(np.int64)
        vocab = self.graph.vocab
        bad = np.flatnonzero((prompt < 0) | (prompt >= vocab))
        if bad.size:
            raise ValueError(f"prompt: token {int(prompt[bad[0]])} at position {int(bad[0])} is outside the "
                             f"vocabulary [0, {vocab})")
        room = self.max_model_len - prompt.size
        max_tokens = params.max_new_tokens if params.max_new_tokens is not None else room
        if prompt.size + max_tokens > self.max_model_len or max_tokens < 1:
            raise ContextLengthError(f"prompt of {prompt.size} tokens + max_new_tokens {max_tokens} exceed the "
                                     f"context limit of {self.max_model_len} tokens")
        top = self.graph.num_top_logprobs if self.graph.sampling else vocab
        if params.logprobs is not None and params.logprobs > top:
            raise ValueError(f"logprobs: {params.logprobs} exceeds the {top} top logprobs the graph reports "
                             "(pagedkv rewrite --top-logprobs)")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer")
        return prompt, int(max_tokens)

    def add_request(self, request_id, prompt_ids, params: SamplingParams | None = None) -> Request:
        """Queue a request (``check_request``'s errors, naming the request)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r}: an unfinished request has this id already")
        try:
            prompt, max_tokens = self.check_request(prompt_ids, params)
        except ValueError as exc:
            raise type(exc)(f"request {request_id!r}: {exc}") from None
        arrival = next(self._arrivals)
        seed = params.seed if params.seed is not None else derive_seed(self.seed, arrival)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        request = Request(request_id, prompt, params, arrival=arrival, seed=seed, max_tokens=max_tokens,
                          stop_ids=stop_ids)
        if self.tokenizer is not None:
            from pagedkv.runtime.tokenizer import TextStream

            request.detokenizer = TextStream(self.tokenizer, params.stop,
                                             include_stop=params.include_stop_str_in_output,
                                             skip_special_tokens=params.skip_special_tokens)
            request.extras = True
        self.requests[request_id] = request
        self._penalized += request.penalties is not None
        self.scheduler.add(request)
        return request

    def abort(self, request_id) -> Request | None:
        """End an unfinished request now, its KV blocks freed at once; returns it (None when there is none)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.remove(request)
        self._finished(request, FinishReason.ABORT)
        return request

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def _finished(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        self._penalized -= request.penalties is not None
        request.state = RequestState.FINISHED
        request.finish_reason = reason
        request.error = error

    # ---- a step ----------------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one step; returns the requests that got a token in it (finished ones included)."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan:
            return []
        mgr = self.manager
        decodes, prefills = plan.decodes, plan.prefills
        nd = len(decodes)
        if prefills:
            reqs = decodes + [r for r, _ in prefills]
            counts = np.ones(len(reqs), dtype=np.int64)
            counts[nd:] = [n for _, n in prefills]
        else:  # decodes only: one token each
            reqs, counts = decodes, 1
        t1 = time.perf_counter()
        ids = plan.decode_ids if not prefills and plan.decode_ids is not None else [r.id for r in reqs]
        seqs = mgr.seq_batch(ids, "step")  # (decodes only: the batch the scheduler's reserve_many checked)
        try:
            batch = mgr.build_step_many(seqs, counts, page_indices=False)
            if prefills:  # a prefill chunk samples when it reaches the end of its request's known tokens
                sampled = list(range(nd)) + [nd + i for i, (r, n) in enumerate(prefills)
                                             if r.num_computed + n == r.num_tokens]
                samplers = [reqs[i] for i in sampled]
                rows = (batch.cu_q_lens[1:] - 1)[sampled].astype(np.int32)
            else:
                samplers, rows = decodes, np.arange(nd, dtype=np.int32)
            input_ids = self._input_ids(decodes, prefills)
            if samplers:
                inputs = self._sampling_inputs(samplers)
            else:  # only prefill chunks short of their prompt's end: one row still runs (engines need R >= 1)
                rows, inputs = (batch.cu_q_lens[-1:] - 1).astype(np.int32), SamplingInputs.greedy(1)
            t2 = time.perf_counter()
            if self.graph.sampling:
                out = self.executor.execute(StepInputs(batch, input_ids, rows, inputs))
                tokens, logprobs, top_tokens, top_logprobs = (out.next_tokens, out.next_logprobs, out.top_tokens,
                                                              out.top_logprobs)
            else:  # no sampling head in the graph: the logits come to the host
                out = self.executor.execute(StepInputs(batch, input_ids, rows, None, want_logits=True))
                top = max([r.params.logprobs or 0 for r in samplers] + [1])
                tokens, logprobs, top_tokens, top_logprobs = host_sample(out.logits, inputs, top_logprobs=top)
        except BaseException:
            for seq_id in seqs.ids:
                mgr.unreserve(seq_id)
            raise
        t3 = time.perf_counter()
        mgr.commit_many(seqs, counts, tokens_of=(lambda i, a, b: reqs[i].tokens(a, b)) if mgr.prefix_reuse else None)
        mgr.drain_copies()  # the storage executed them; the log would only grow
        if prefills:
            for r, n in zip(reqs, counts.tolist()):
                r.num_computed += n
        else:
            for r in decodes:
                r.num_computed += 1
        self._last = (samplers, tokens[:len(samplers)])
        # A step of prefill chunks short of their prompts' ends ran one placeholder row: no request takes it
        finished = self._take_tokens(samplers, tokens, logprobs, top_tokens, top_logprobs) if samplers else []
        if finished:
            self.scheduler.finish_many(finished)
            for r in finished:
                del self.requests[r.id]
        t4 = time.perf_counter()
        self.timing = StepTiming(t1 - t0, t2 - t1, t3 - t2, t4 - t3)
        return samplers

    def _input_ids(self, decodes, prefills) -> np.ndarray:
        """The step's tokens: each decode's last token (in steady state, the previous step's picks), then the
        prefill chunks."""
        last, tokens = self._last
        if decodes and last == decodes:  # the same requests as the previous step, in the same order
            fed = tokens.astype(np.int64)
        else:
            fed = np.fromiter((r.output[-1] if r.output else r.prompt[-1] for r in decodes), np.int64, len(decodes))
        if not prefills:
            return fed
        return np.concatenate([fed] + [np.asarray(r.tokens(r.num_computed, r.num_computed + n), dtype=np.int64)
                                       for r, n in prefills])

    def _sampling_inputs(self, samplers) -> SamplingInputs:
        """The sampling head's rows. In steady state (the previous step's samplers again, in the same order)
        the parameter rows, seeds and stop limits are reused and each draw counter advances by the one token
        it got."""
        rows = self._rows
        if rows.requests == samplers:
            rows.counters = rows.counters + _ONE
        else:
            self._rows = rows = _SamplerRows(samplers, self.eos_token_ids)
        penalties = [r.penalties for r in samplers] if self._penalized else None
        return sampling_inputs(rows.params, rows.seeds, rows.counters, penalties)

    def _take_tokens(self, samplers, tokens, logprobs, top_tokens, top_logprobs) -> list[Request]:
        """Append each sampler's token; finish those at a stop token, a stop string or max_new_tokens."""
        rows = self._rows  # (the rows of these samplers: _sampling_inputs ran for them)
        ended = rows.counters >= rows.last_counter  # (the token drawn now is the last one allowed)
        for eos in rows.eos:  # (a handful of ids: cheaper than np.isin)
            ended |= rows.default_stop & (tokens == eos)
        values = tokens.tolist()
        for r, t in zip(samplers, values):
            r.output.append(t)
            r.num_tokens += 1
        check = np.flatnonzero(ended | rows.slow).tolist() if rows.slow_any else np.flatnonzero(ended).tolist()
        finished = []
        for i in check:
            r, t = samplers[i], values[i]
            stopped = t in r.stop_ids
            if r.extras:
                if r.penalties is not None:
                    r.penalties.add_output(t)
                n = r.params.logprobs
                if n is not None:
                    r.logprobs.append(TokenLogprobs(t, float(logprobs[i]), tuple(
                        zip(top_tokens[i, :n].tolist(), top_logprobs[i, :n].tolist()))))
                if r.detokenizer is not None:
                    stopped = r.detokenizer.push(t) or stopped
                    r.text = r.detokenizer.text
            if stopped:
                self._finished(r, FinishReason.STOP)
                finished.append(r)
            elif len(r.output) >= r.max_tokens:
                self._finished(r, FinishReason.LENGTH)
                finished.append(r)
        return finished

    def run(self) -> None:
        """Step until every request has finished."""
        while self.has_unfinished:
            self.step()
