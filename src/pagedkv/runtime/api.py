"""The Python API: ``LLM`` for scripts, ``Worker`` for serving frameworks.

    from pagedkv.runtime import LLM, SamplingParams
    with LLM("qwen2.paged.onnx", tokenizer="qwen2-dir", backend="reference") as llm:
        for c in llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_new_tokens=16)):
            print(c.id, c.output_ids, c.text)
        for delta in llm.stream(["Once upon a time"]):            # tokens as they come
            print(delta.text, end="", flush=True)

    worker = Worker(llm.engine)                        # the engine on its own thread, behind a queue
    handle = worker.submit([1, 2, 3], SamplingParams(max_new_tokens=8))
    for delta in handle: ...                          # or: async for, with submit(..., loop=asyncio loop)
    worker.abort(handle.id); worker.close()
    worker.call(lambda engine: engine.manager.validate()).result()   # run on the engine thread, between steps

``LLM`` opens the model (``open_executor``: a rewritten ``.onnx`` runs in ONNX Runtime with the plugin ops on the
float64 references or the CUDA kernels; an engine file runs in TensorRT), its tokenizer (``--tokenizer`` or the
model's own directory; none needed for token ids) and an ``Engine`` with the given limits, and drives the
engine in the calling thread. ``Worker`` holds no global state: any number of workers (one per engine) can live
in one process, each stepping its engine on its own thread; ``submit`` validates in the caller's thread and
raises there, deltas reach each request's handle (a thread-safe queue, or an asyncio queue fed with
``call_soon_threadsafe``), ``abort`` takes effect before the next step, ``call`` runs a function on the engine
thread between two steps (the one safe way to look inside a running engine). docs/runtime.md shows how a
Triton Python backend or a Dynamo worker hosts it; ``pagedkv.runtime.serve`` is an HTTP server over it.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pagedkv.runtime.request import FinishReason, Request, TokenLogprobs
from pagedkv.runtime.sampling import SamplingParams
from pagedkv.runtime.scheduler import SchedulerConfig

BACKENDS = ("auto", "reference", "cuda", "trt")
ENGINE_SUFFIXES = (".engine", ".plan", ".trt")


@dataclass
class Completion:
    """A finished request."""

    id: object
    prompt_ids: list[int]
    output_ids: list[int]
    text: str | None  # with a tokenizer
    finish_reason: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # with SamplingParams.logprobs
    error: str | None = None


@dataclass
class Delta:
    """What a request produced since its previous delta; the last one has ``finished`` set."""

    id: object
    token_ids: list[int]
    text: str  # new text ("" without a tokenizer)
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    error: str | None = None


def completion(r: Request) -> Completion:
    return Completion(r.id, r.prompt.tolist(), list(r.output), r.text if r.detokenizer is not None else None,
                      r.finish_reason.value if r.finish_reason else None, list(r.logprobs), r.error)


class _Cursor:
    """How much of a request's output its consumer has seen (tokens, text, logprobs)."""

    __slots__ = ("tokens", "text")

    def __init__(self):
        self.tokens = 0
        self.text = 0

    def delta(self, r: Request) -> Delta:
        finished = r.finished
        text = r.detokenizer.visible(finished) if r.detokenizer is not None else ""
        d = Delta(r.id, r.output[self.tokens:], text[self.text:], finished,
                  r.finish_reason.value if finished and r.finish_reason else None,
                  r.logprobs[self.tokens:] if r.params.logprobs is not None else [], r.error)
        self.tokens, self.text = len(r.output), len(text)
        return d


# ---- opening a model ------------------------------------------------------------------------------------
def is_engine_file(path) -> bool:
    return Path(path).suffix.lower() in ENGINE_SUFFIXES


def rewritten_graph_of(engine_path, graph=None) -> Path:
    """The rewritten ONNX an engine was built from: ``graph``, else ``X.onnx`` / ``X.paged.onnx`` beside
    ``X.engine``."""
    if graph is not None:
        return Path(graph)
    engine_path = Path(engine_path)
    for candidate in (engine_path.with_suffix(".onnx"), engine_path.with_suffix(".paged.onnx")):
        if candidate.is_file():
            return candidate
    raise ValueError(f"graph: the engine {str(engine_path)!r} needs the rewritten ONNX it was built from (its plugin "
                     f"attributes give the KV pools): none beside it as {engine_path.with_suffix('.onnx').name}; "
                     "give it (graph=..., --graph)")


def resolve_backend(model, backend: str) -> str:
    from pagedkv import cuda

    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if is_engine_file(model):
        if backend not in ("auto", "trt"):
            raise ValueError(f"backend: {str(model)!r} is a TensorRT engine, which only the trt backend runs")
        return "trt"
    if backend == "trt":
        raise ValueError(f"backend: trt runs engines; {str(model)!r} is a graph (build one: pagedkv build)")
    if backend == "auto":
        return "cuda" if cuda.why_no_gpu() is None else "reference"
    return backend


def open_executor(model, *, backend: str = "auto", graph=None, num_blocks=None, kv_memory_fraction: float = 0.5,
                  manager_kwargs: dict | None = None, plugin_library=None):
    """An executor for ``model`` (a rewritten ``.onnx`` or an engine file). ``num_blocks`` None: 1024 per
    pool group for the reference backend, ``kv_memory_fraction`` of the free device memory otherwise."""
    from pagedkv.runtime.graph import RewrittenGraph

    backend = resolve_backend(model, backend)
    source = rewritten_graph_of(model, graph) if backend == "trt" else Path(model)
    if num_blocks is None:
        if backend == "reference":
            num_blocks = 1024
        else:
            from pagedkv import cuda
            from pagedkv.kvcache.sizing import blocks_for_budget, budget_from_free_memory

            groups = RewrittenGraph.load(str(source)).groups
            num_blocks = blocks_for_budget(groups, budget_from_free_memory(kv_memory_fraction, cuda.mem_get_info()[0]))
    if backend == "trt":
        from pagedkv.runtime.trt import TrtExecutor

        return TrtExecutor(str(source), engine=model, num_blocks=num_blocks, manager_kwargs=manager_kwargs,
                           plugin_library=plugin_library)
    from pagedkv.runtime.session import OrtExecutor

    return OrtExecutor(str(source), backend=backend, num_blocks=num_blocks, manager_kwargs=manager_kwargs)


def _prompt_ids(prompt, tokenizer) -> list[int]:
    """Token ids of a prompt: a string (encoded), token ids, or ``{"messages": [...]}`` (chat template)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: text needs a tokenizer (give tokenizer=DIR), or pass token ids")
        return tokenizer.encode(prompt)
    if isinstance(prompt, dict):
        if "messages" not in prompt:
            raise ValueError(f"prompt: a dict prompt needs 'messages', got keys {sorted(prompt)}")
        if tokenizer is None:
            raise ValueError("prompt: chat messages need a tokenizer with a chat template")
        return tokenizer.chat(prompt["messages"])
    ids = np.asarray(prompt)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"prompt: expected text or a list of token ids, got {type(prompt).__name__}")
    return ids.tolist()


class LLM:
    """A model, its tokenizer and an engine, driven in the calling thread (module docstring).

    Args:
        model: a rewritten ``.onnx`` (``pagedkv rewrite``) or an engine (``pagedkv build``; ``graph`` is the
            rewritten ONNX it came from, found beside it by default).
        tokenizer: a directory with ``tokenizer.json``, a ``Tokenizer``, or None: the model's directory when it
            has one, else token ids only.
        backend: "auto" (an engine: trt; a graph: cuda with a GPU, else reference), "reference", "cuda", "trt".
        num_blocks: KV blocks per pool group (default: ``open_executor``'s); host_blocks: pinned host blocks
            per group for ``preemption="swap"``.
        max_num_seqs, max_num_batched_tokens, chunk_size, preemption: the scheduler's (``SchedulerConfig``).
        max_model_len: context limit (default: the model's ``max_position_embeddings`` and the pool's room).
        enable_prefix_reuse: share cached prompt prefixes (full-attention models only).
        eos_token_ids: default from the model directory's ``generation_config.json``.
        seed: base seed of requests without one.
    """

    def __init__(self, model, *, tokenizer=None, backend: str = "auto", graph=None, num_blocks=None,
                 host_blocks: int = 0, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 chunk_size: int = 512, preemption: str = "recompute", max_model_len: int | None = None,
                 enable_prefix_reuse: bool = True, eos_token_ids=None, seed: int = 0, debug_validate: bool = False,
                 plugin_library=None):
        from pagedkv.pool_group import WindowMode
        from pagedkv.runtime import tokenizer as tok
        from pagedkv.runtime.engine import Engine
        from pagedkv.runtime.graph import RewrittenGraph

        backend = resolve_backend(model, backend)
        model_dir = Path(model).parent
        if isinstance(tokenizer, (str, Path)):
            tokenizer = tok.Tokenizer.from_dir(tokenizer)
        elif tokenizer is None and tok.has_tokenizer(model_dir):
            tokenizer = tok.Tokenizer.from_dir(model_dir)
        self.tokenizer = tokenizer
        info_dir = tokenizer.path if tokenizer is not None and tokenizer.path is not None else model_dir
        if eos_token_ids is None:
            eos_token_ids = tok.eos_token_ids(info_dir) or (tokenizer.eos_token_ids if tokenizer else ())
        limit = max_model_len or tok.max_positions(info_dir)
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                 chunk_size=chunk_size, preemption=preemption)
        source = rewritten_graph_of(model, graph) if is_engine_file(model) else model
        groups = RewrittenGraph.load(str(source)).groups
        reuse = enable_prefix_reuse and all(g.mode == WindowMode.FULL for g in groups)
        self.executor = open_executor(model, backend=backend, graph=graph, num_blocks=num_blocks,
                                      plugin_library=plugin_library,
                                      manager_kwargs={"host_blocks": host_blocks, "enable_prefix_reuse": reuse,
                                                      "debug_validate": debug_validate})
        self.engine = Engine(self.executor, config, max_model_len=limit, eos_token_ids=eos_token_ids,
                             tokenizer=tokenizer, seed=seed)
        self._ids = itertools.count()

    @property
    def backend(self) -> str:
        return self.executor.name

    def close(self) -> None:
        self.executor.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _add(self, prompts, params, ids) -> list[Request]:
        single = isinstance(prompts, (str, dict)) or (len(prompts) and isinstance(prompts[0], (int, np.integer)))
        prompts = [prompts] if single else list(prompts)
        if isinstance(params, SamplingParams) or params is None:
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in prompts] if ids is None else list(ids)
        if len(ids) != len(prompts) or len(set(ids)) != len(ids):
            raise ValueError(f"ids: expected {len(prompts)} distinct request ids, got {ids}")
        tokens = [_prompt_ids(p, self.tokenizer) for p in prompts]
        added = []
        try:
            for rid, p, sp in zip(ids, tokens, params):
                added.append(self.engine.add_request(rid, p, sp))
        except BaseException:
            for r in added:
                self.engine.abort(r.id)
            raise
        return added

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None, *, ids=None,
                 quiet: bool = True) -> list[Completion]:
        """Complete every prompt (text, token ids, or ``{"messages": [...]}``; one or a list); one
        ``Completion`` per prompt, in order. ``ids``: the requests' ids (default ``llm-<n>``)."""
        from pagedkv.userio import progress

        requests = self._add(prompts, params, ids)
        with progress(total=len(requests), desc="generate", unit="req", quiet=quiet) as bar:
            while self.engine.has_unfinished:
                done = sum(r.finished for r in self.engine.step())
                bar.update(done)
        return [completion(r) for r in requests]

    def stream(self, prompts, params=None, *, ids=None) -> Iterator[Delta]:
        """Deltas of every prompt's request as the steps produce them (interleaved; ``Delta.id`` tells them
        apart, ``finished`` marks each one's last)."""
        requests = self._add(prompts, params, ids)
        cursors = {r.id: _Cursor() for r in requests}
        try:
            while any(not r.finished for r in requests):
                for r in self.engine.step():
                    if r.id in cursors:
                        yield cursors[r.id].delta(r)
        finally:  # a consumer that stops early aborts what is left
            for r in requests:
                if not r.finished:
                    self.engine.abort(r.id)

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> Completion:
        return self.generate({"messages": messages}, params)[0]


# ---- the embeddable worker ------------------------------------------------------------------------------
_DONE = object()


class RequestHandle:
    """A submitted request: iterate it (``for`` / ``async for``) for its deltas; ``abort()`` ends it.
    ``prompt_ids``: its prompt as the engine sees it (after tokenization or the chat template)."""

    def __init__(self, worker: "Worker", request_id, loop=None, prompt_ids: Sequence[int] = ()):
        self.id = request_id
        self.prompt_ids = list(prompt_ids)
        self._worker = worker
        self._loop = loop
        if loop is None:
            self._queue = queue.SimpleQueue()
        else:
            import asyncio

            self._queue = asyncio.Queue()

    def _put(self, item) -> None:  # engine thread
        if self._loop is None:
            self._queue.put(item)
        else:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __iter__(self) -> Iterator[Delta]:
        if self._loop is not None:
            raise TypeError("this handle was submitted with an event loop: use `async for`")
        while (item := self._queue.get()) is not _DONE:
            yield item

    async def __aiter__(self):
        if self._loop is None:
            raise TypeError("this handle was submitted without an event loop: use `for`")
        while (item := await self._queue.get()) is not _DONE:
            yield item

    def result(self) -> Completion:
        """Wait for the end (synchronous handles): the whole output."""
        deltas = list(self)
        tokens = [t for d in deltas for t in d.token_ids]
        last = deltas[-1] if deltas else Delta(self.id, [], "", True, FinishReason.ERROR.value, error="no output")
        return Completion(self.id, self.prompt_ids, tokens, "".join(d.text for d in deltas) or None,
                          last.finish_reason, [lp for d in deltas for lp in d.logprobs], last.error)

    def abort(self) -> None:
        self._worker.abort(self.id)


class Worker:
    """An ``Engine`` stepped on its own thread (module docstring). Thread-safe: ``submit``, ``abort``, ``call``,
    ``metrics`` and ``close`` may be called from any thread.

    Args:
        engine: the engine to drive (e.g. ``LLM(...).engine``); the worker owns its stepping from now on.
        max_pending: submitted requests not finished yet, beyond which ``submit`` raises ``WorkerBusy``
            (a server answers 429/503).
    """

    def __init__(self, engine, *, max_pending: int = 4096):
        self.engine = engine
        self.max_pending = int(max_pending)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list = []  # ("add", handle, prompt ids, params) / ("abort", id) / ("call", fn, future)
        self._handles: dict[object, tuple[RequestHandle, _Cursor]] = {}
        self._ids = itertools.count()
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="pagedkv-worker", daemon=True)
        self._thread.start()

    # ---- called from any thread ------------------------------------------------------------------------
    def submit(self, prompt, params: SamplingParams | None = None, *, request_id=None, loop=None) -> RequestHandle:
        """Queue a request (text, token ids or ``{"messages": [...]}``). Bad input raises here (``ValueError``,
        ``ContextLengthError``); ``WorkerBusy`` when ``max_pending`` requests are in flight."""
        ids = _prompt_ids(prompt, self.engine.tokenizer)
        params = params or SamplingParams()
        self.engine.check_request(ids, params)
        with self._lock:
            self._check_open()
            if len(self._handles) >= self.max_pending:
                raise WorkerBusy(f"worker: {len(self._handles)} requests in flight (max_pending={self.max_pending})")
            request_id = f"req-{next(self._ids)}" if request_id is None else request_id
            if request_id in self._handles:
                raise ValueError(f"request_id: {request_id!r} is in flight already")
            handle = RequestHandle(self, request_id, loop, ids)
            self._handles[request_id] = (handle, _Cursor())
            self._inbox.append(("add", handle, ids, params))
            self._wake.notify()
        return handle

    def abort(self, request_id) -> None:
        """End a request (its blocks freed before the next step); unknown or finished ids are ignored."""
        with self._lock:
            self._inbox.append(("abort", request_id))
            self._wake.notify()

    def call(self, fn) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between two steps; the future holds its result (or its
        exception). ``WorkerClosed`` when the worker has stopped."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._check_open()
            self._inbox.append(("call", fn, future))
            self._wake.notify()
        return future

    @property
    def alive(self) -> bool:
        """The engine thread runs and accepts requests (neither closed nor failed)."""
        with self._lock:
            return not self._closed and self._error is None and self._thread.is_alive()

    def _check_open(self) -> None:  # (under the lock)
        if self._closed or self._error is not None:
            reason = f"{type(self._error).__name__}: {self._error}" if self._error is not None else "closed"
            raise WorkerClosed(f"worker: not accepting requests ({reason})")

    def stream(self, request_id) -> Iterator[Delta]:
        """The deltas of a submitted request (the same as iterating its handle)."""
        with self._lock:
            entry = self._handles.get(request_id)
        if entry is None:
            raise KeyError(f"request_id: {request_id!r} is not in flight")
        return iter(entry[0])

    def metrics(self) -> dict:
        """A snapshot for monitoring: requests per state, KV blocks used per pool group, scheduler counters."""
        with self._lock:
            sched, mgr = self.engine.scheduler, self.engine.manager
            return {"running": len(sched.running), "waiting": len(sched.waiting) + sum(
                        1 for op in self._inbox if op[0] == "add"), "swapped": len(sched.swapped),
                    "in_flight": len(self._handles),
                    "kv_blocks_total": list(mgr.num_blocks),
                    "kv_blocks_used": [nb - mgr.num_free(g) for g, nb in enumerate(mgr.num_blocks)],
                    "steps": sched.stats.steps, "preemptions": sched.stats.preemptions,
                    "swaps_out": sched.stats.swaps_out, "prefix_tokens_reused": sched.stats.prefix_tokens_reused}

    def close(self) -> None:
        """Stop the thread; unfinished requests end as aborted."""
        with self._lock:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- the engine thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                while not self._inbox and not engine.has_unfinished and not self._closed:
                    self._wake.wait()
                inbox, self._inbox = self._inbox, []
                closing = self._closed
            for op in inbox:
                if op[0] == "add":
                    _, handle, ids, params = op
                    try:
                        engine.add_request(handle.id, ids, params)
                    except Exception as exc:  # checked in submit; what remains is a race on the id
                        self._end(handle.id, Delta(handle.id, [], "", True, FinishReason.ERROR.value, error=str(exc)))
                elif op[0] == "call":
                    _, fn, future = op
                    if future.set_running_or_notify_cancel():
                        try:
                            future.set_result(fn(engine))
                        except BaseException as exc:  # the caller's function failed: it gets the exception
                            future.set_exception(exc)
                else:
                    aborted = engine.abort(op[1])
                    if aborted is not None:
                        self._publish([aborted])
            if closing:
                self._publish([engine.abort(request_id) for request_id in list(engine.requests)])
                return
            if not engine.has_unfinished:
                continue
            try:
                updated = engine.step()
            except Exception as exc:  # the engine is broken: fail everything in flight, accept nothing more
                self._fail(exc)
                return
            self._publish(updated)

    def _fail(self, exc: Exception) -> None:
        """After an engine error: every request in flight ends with it; queued calls get it."""
        engine = self.engine
        with self._lock:
            self._error = exc
            inbox, self._inbox = self._inbox, []
        error = f"{type(exc).__name__}: {exc}"
        for request_id in list(engine.requests):
            engine.abort(request_id)
            self._end(request_id, Delta(request_id, [], "", True, FinishReason.ERROR.value, error=error))
        for op in inbox:
            if op[0] == "add":
                self._end(op[1].id, Delta(op[1].id, [], "", True, FinishReason.ERROR.value, error=error))
            elif op[0] == "call" and op[2].set_running_or_notify_cancel():
                op[2].set_exception(WorkerClosed(f"worker: stopped ({error})"))

    def _publish(self, requests) -> None:
        for r in requests:
            with self._lock:
                entry = self._handles.get(r.id)
            if entry is None:
                continue
            handle, cursor = entry
            delta = cursor.delta(r)
            handle._put(delta)
            if delta.finished:
                self._end(r.id, None)

    def _end(self, request_id, delta) -> None:
        with self._lock:
            entry = self._handles.pop(request_id, None)
        if entry is not None:
            if delta is not None:
                entry[0]._put(delta)
            entry[0]._put(_DONE)


class WorkerBusy(RuntimeError):
    """Too many requests in flight (``Worker.max_pending``): try again later (a server answers 429)."""


class WorkerClosed(RuntimeError):
    """The worker no longer runs: closed, or its engine failed (the message says which; a server answers 503)."""
