"""The OpenAI-compatible HTTP server over one ``Worker``: ``create_app(worker, model_name=...)`` (Starlette; run it
with uvicorn — ``pagedkv serve`` does, ``pagedkv.runtime.serve``).

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``"stream": true`` streams server-sent
events, ``data: {...}`` chunks then ``data: [DONE]``; ``stream_options.include_usage`` adds a last chunk with the
usage), ``GET /v1/models``, ``GET /health`` (200 while the engine thread runs, else 503), ``GET /metrics``
(Prometheus text: requests running / waiting / swapped, KV blocks used and total per pool group, preemptions,
TTFT / inter-token / end-to-end latency histograms, prompt and generated token counters, finished requests
by reason, rejected requests by status).

Requests take OpenAI's fields — ``prompt`` (text, token ids, or a list of either) or ``messages``,
``max_tokens`` (chat: ``max_completion_tokens`` too), ``temperature`` (default 1, as OpenAI), ``top_p``,
``presence_penalty``, ``frequency_penalty``, ``seed``, ``stop``, ``logprobs`` (completions: the number of top
tokens; chat: ``logprobs: true`` and ``top_logprobs``), ``n`` (1 only) — and the extensions vLLM's clients send:
``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``,
``skip_special_tokens``, ``return_token_ids`` (each choice also carries its ``token_ids``). Defaults not given
by the request are ``SamplingParams``'; completions default to 16 tokens (OpenAI's), chat to the context limit.
Request bodies are validated by pydantic schemas (types); values by ``SamplingParams`` and
``Engine.check_request`` (ranges, vocabulary, context limit) — each rule in one place.

Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed JSON, wrong
types, bad sampling values, a prompt beyond the context limit (``context_length_exceeded``) or a feature not
offered (``n`` > 1, ``echo``, ``suffix``, ``best_of``, ``logit_bias``, tools); 404 for an unknown model or path;
429 when ``max_pending`` requests are in flight (the worker's bounded queue); 503 when the engine has stopped.
A client that disconnects — streaming or not — aborts its requests, and their KV blocks are freed before the
next step.

Design: everything (the metrics registry included) lives on the app, none of it global: several apps per
process are fine. The worker steps the engine on its own thread; handlers submit with the event loop, and
deltas come back through ``call_soon_threadsafe``.
"""


from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI reports impossible tokens like this
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


# ---- errors in OpenAI's shape ---------------------------------------------------------------------------
class ApiError(Exception):
    """An error response: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# SamplingParams field -> the request field that set it (error messages name what the client sent)
_FIELD_OF_PARAM = {"max_new_tokens": "max_tokens"}


def _value_error(exc: ValueError, *, prompt_field: str) -> ApiError:
    """A ValueError of ``SamplingParams`` / ``Engine.check_request`` / the tokenizer as a 400 naming the field."""
    from pagedkv.runtime.request import ContextLengthError

    message = str(exc)
    if isinstance(exc, ContextLengthError):
        return ApiError(400, message, param=prompt_field, code="context_length_exceeded")
    field, _, rest = message.partition(": ")
    if rest and field.isidentifier():
        name = _FIELD_OF_PARAM.get(field, field)
        return ApiError(400, f"{name}: {rest}", param=prompt_field if name in ("prompt", "chat") else name)
    return ApiError(400, message, param=prompt_field)


# ---- requests -------------------------------------------------------------------------------------------
TokenIds = list[StrictInt]


class _Request(BaseModel):
    """Fields both endpoints take. Unknown fields are ignored (clients send more than any server uses)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    stream: StrictBool = False
    stream_options: dict | None = None
    n: StrictInt = 1
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    presence_penalty: StrictFloat | StrictInt | None = None
    frequency_penalty: StrictFloat | StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    logit_bias: dict | None = None
    user: StrictStr | None = None
    # vLLM's extensions
    top_k: StrictInt | None = None
    min_p: StrictFloat | StrictInt | None = None
    repetition_penalty: StrictFloat | StrictInt | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    return_token_ids: StrictBool = False


class CompletionRequest(_Request):
    prompt: StrictStr | TokenIds | list[StrictStr] | list[TokenIds]
    max_tokens: StrictInt | None = COMPLETION_DEFAULT_MAX_TOKENS
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: StrictStr
    content: StrictStr | list[_TextPart] | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list | None = None
    response_format: dict | None = None


def _unsupported(req, *, chat: bool) -> None:
    """Refuse what is accepted by OpenAI's API but not implemented here, naming the field."""
    def refuse(field: str, why: str):
        raise ApiError(400, f"{field}: {why}", param=field, code="unsupported")

    if req.n != 1:
        refuse("n", f"only n=1 is supported, got {req.n}")
    if req.logit_bias:
        refuse("logit_bias", "not supported")
    if chat:
        if req.tools:
            refuse("tools", "tool calls are not supported")
        if req.response_format and req.response_format.get("type", "text") != "text":
            refuse("response_format", f"only type 'text' is supported, got {req.response_format.get('type')!r}")
    else:
        if req.echo:
            refuse("echo", "not supported")
        if req.suffix:
            refuse("suffix", "not supported")
        if req.best_of not in (None, 1):
            refuse("best_of", f"only best_of=1 is supported, got {req.best_of}")


def sampling_params(req, *, chat: bool):
    """The ``SamplingParams`` of a request (``ApiError`` 400 naming the field for a bad value)."""
    from pagedkv.runtime.sampling import SamplingParams

    _unsupported(req, chat=chat)
    values = {name: getattr(req, name) for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                                                      "top_k", "min_p", "repetition_penalty")
              if getattr(req, name) is not None}
    values.setdefault("temperature", 1.0)  # OpenAI's default (SamplingParams' own default is greedy)
    if values.get("top_k") == -1:  # vLLM's "off"
        values["top_k"] = 0
    if chat:
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens, logprobs = req.max_tokens, req.logprobs
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    try:
        return SamplingParams(max_new_tokens=max_tokens, seed=req.seed, logprobs=logprobs, stop=stop,
                              stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                              include_stop_str_in_output=req.include_stop_str_in_output,
                              skip_special_tokens=req.skip_special_tokens, **values)
    except ValueError as exc:
        error = _value_error(exc, prompt_field="messages" if chat else "prompt")
        if chat and error.param == "logprobs":
            error.param = "top_logprobs"
        raise error from None


def completion_prompts(prompt) -> list:
    """A completion request's prompts: one text or token-id list, or a list of them."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt: it is empty", param="prompt")
    return list(prompt)


def chat_prompt(messages) -> dict:
    """The worker's chat prompt: ``{"messages": [{"role", "content"}]}`` with text parts joined."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
        out.append({"role": m.role, "content": content or ""})
    return {"messages": out}


# ---- one request's stream -------------------------------------------------------------------------------
@dataclass
class _Choice:
    """What one request (one choice) produced so far."""

    index: int
    handle: object
    timing: object
    tokens: list
    text: list
    logprobs: list
    finish_reason: str | None = None
    error: str | None = None


class _Metrics:
    """The app's Prometheus registry: histograms and counters the handlers feed, gauges read from the worker
    when scraped."""

    def __init__(self, worker, model_name: str):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_WorkerCollector(worker))
        kw = {"registry": self.registry}
        self.ttft = Histogram("pagedkv_time_to_first_token_seconds", "Time from submission to the first token",
                              buckets=TTFT_BUCKETS, **kw)
        self.itl = Histogram("pagedkv_inter_token_latency_seconds", "Time between successive tokens of a request",
                             buckets=ITL_BUCKETS, **kw)
        self.e2e = Histogram("pagedkv_e2e_request_latency_seconds", "Time from submission to the last token",
                             buckets=E2E_BUCKETS, **kw)
        self.generated = Counter("pagedkv_generation_tokens", "Tokens generated", **kw)
        self.prompt = Counter("pagedkv_prompt_tokens", "Prompt tokens of submitted requests", **kw)
        self.finished = Counter("pagedkv_requests_finished", "Requests ended, by finish reason",
                                ["finish_reason"], **kw)
        self.rejected = Counter("pagedkv_requests_rejected", "Requests refused, by HTTP status", ["status"], **kw)
        self.model_name = model_name


class _WorkerCollector:
    """Gauges and counters read from ``Worker.metrics()`` at scrape time."""

    def __init__(self, worker):
        self.worker = worker

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self.worker.metrics()
        for name, key, doc in (("running", "running", "Requests in the running batch"),
                               ("waiting", "waiting", "Requests queued, not yet admitted"),
                               ("swapped", "swapped", "Requests preempted to the host tier")):
            yield GaugeMetricFamily(f"pagedkv_requests_{name}", doc, value=m[key])
        used = GaugeMetricFamily("pagedkv_kv_blocks_used", "KV blocks held by sequences", labels=["group"])
        total = GaugeMetricFamily("pagedkv_kv_blocks_total", "KV blocks of the pool", labels=["group"])
        for g, (u, t) in enumerate(zip(m["kv_blocks_used"], m["kv_blocks_total"])):
            used.add_metric([str(g)], u)
            total.add_metric([str(g)], t)
        yield used
        yield total
        for name, key, doc in (("preemptions", "preemptions", "Requests preempted by recompute"),
                               ("swaps_out", "swaps_out", "Requests swapped to the host tier"),
                               ("prefix_tokens_reused", "prefix_tokens_reused", "Prompt tokens found in the prefix "
                                                                                "cache"),
                               ("engine_steps", "steps", "Engine steps run")):
            yield CounterMetricFamily(f"pagedkv_{name}", doc, value=m[key])


class _Server:
    """The handlers of one app (``create_app``)."""

    def __init__(self, worker, model_name: str):
        self.worker = worker
        self.model_name = model_name
        self.tokenizer = worker.engine.tokenizer
        self.metrics = _Metrics(worker, model_name)
        self.created = int(time.time())

    # ---- requests in -----------------------------------------------------------------------------------
    async def parse(self, request, model):
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            raise ApiError(400, f"the body is not valid JSON ({exc})", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}", code="invalid_json")
        try:
            req = model.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = _field_path(first["loc"])
            raise ApiError(400, f"{where or 'body'}: {first['msg']}", param=where or None) from None
        if req.model is not None and req.model != self.model_name:
            raise ApiError(404, f"model: {req.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        return req

    def submit(self, prompts, params, *, prompt_field: str) -> list[_Choice]:
        from pagedkv.runtime.api import WorkerBusy, WorkerClosed
        from pagedkv.runtime.latency import RequestTiming

        loop = asyncio.get_running_loop()
        choices = []
        try:
            for i, prompt in enumerate(prompts):
                timing = RequestTiming()
                handle = self.worker.submit(prompt, params, loop=loop)
                choices.append(_Choice(i, handle, timing, [], [], []))
                self.metrics.prompt.inc(len(handle.prompt_ids))
        except BaseException as exc:
            for c in choices:
                self.worker.abort(c.handle.id)
            if isinstance(exc, WorkerBusy):
                raise ApiError(429, str(exc), type="rate_limit_error", code="rate_limit_exceeded") from None
            if isinstance(exc, WorkerClosed):
                raise ApiError(503, str(exc), type="service_unavailable", code="engine_stopped") from None
            if isinstance(exc, ValueError):
                raise _value_error(exc, prompt_field=prompt_field) from None
            raise
        return choices

    def take(self, choice: _Choice, delta) -> None:
        """Account a delta of ``choice`` (its tokens, text, logprobs, timing and the metrics)."""
        gap = choice.timing.arrived(len(delta.token_ids))
        if delta.token_ids:
            self.metrics.generated.inc(len(delta.token_ids))
            if gap is None:
                self.metrics.ttft.observe(choice.timing.ttft)
            else:
                for _ in delta.token_ids:
                    self.metrics.itl.observe(gap)
        choice.tokens += delta.token_ids
        choice.text.append(delta.text)
        choice.logprobs += delta.logprobs
        if delta.finished:
            choice.finish_reason, choice.error = delta.finish_reason, delta.error
            self.metrics.e2e.observe(choice.timing.finish())
            self.metrics.finished.labels(delta.finish_reason or "unknown").inc()

    def abort(self, choices) -> None:
        """End the choices still running (their client is gone): their KV is freed before the next step."""
        for c in choices:
            if c.finish_reason is None:
                self.worker.abort(c.handle.id)
                c.finish_reason = "abort"
                self.metrics.finished.labels("abort").inc()

    # ---- responses out ---------------------------------------------------------------------------------
    def token_text(self, token: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token}"
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def completion_logprobs(self, logprobs, offset: int = 0) -> dict:
        tokens = [self.token_text(lp.token) for lp in logprobs]
        offsets, at = [], offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [max(lp.logprob, MIN_LOGPROB) for lp in logprobs],
                "top_logprobs": [{self.token_text(t): max(v, MIN_LOGPROB) for t, v in lp.top} for lp in logprobs],
                "text_offset": offsets}

    def chat_logprobs(self, logprobs) -> dict:
        def entry(token, value):
            text = self.token_text(token)
            return {"token": text, "logprob": max(value, MIN_LOGPROB), "bytes": list(text.encode())}

        return {"content": [entry(lp.token, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in logprobs]}

    def usage(self, choices) -> dict:
        prompt = sum(len(c.handle.prompt_ids) for c in choices)
        completion = sum(len(c.tokens) for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def choice_body(self, c: _Choice, *, chat: bool, want_logprobs: bool, return_token_ids: bool, text: str,
                    logprobs, token_ids, finish_reason, offset: int = 0) -> dict:
        body: dict = {"index": c.index}
        if chat:
            body["logprobs"] = self.chat_logprobs(logprobs) if want_logprobs else None
        else:
            body["text"] = text
            body["logprobs"] = self.completion_logprobs(logprobs, offset) if want_logprobs else None
        body["finish_reason"] = finish_reason
        if return_token_ids:
            body["token_ids"] = list(token_ids)
        return body


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _field_path(loc) -> str:
    """A pydantic error location as the request's field path ("messages.0.content"), without the tags pydantic
    adds for the member of a union it tried ("temperature.float")."""
    return ".".join(str(p) for p in loc
                    if isinstance(p, int) or not (p in _UNION_TAGS or "[" in p or "-" in p))


def _error_of(choices) -> ApiError | None:
    for c in choices:
        if c.error is not None or c.finish_reason == "error":
            return ApiError(500, f"generation failed: {c.error or 'unknown error'}", type="server_error",
                            code="engine_error")
    return None


async def _deltas(server: _Server, choices):
    """(choice, delta) as they arrive, over all choices."""
    if len(choices) == 1:
        async for delta in choices[0].handle:
            yield choices[0], delta
        return
    iters = [c.handle.__aiter__() for c in choices]
    pending = {asyncio.ensure_future(it.__anext__()): i for i, it in enumerate(iters)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                i = pending.pop(task)
                try:
                    delta = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(iters[i].__anext__())] = i
                yield choices[i], delta
    finally:
        for task in pending:
            task.cancel()


async def _until_disconnect(request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(payload) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def create_app(worker, *, model_name: str, close_worker: bool = False):
    """The ASGI app over a running ``Worker`` (module docstring). ``close_worker``: close it at shutdown."""
    import contextlib

    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    server = _Server(worker, model_name)

    def error_response(err: ApiError) -> JSONResponse:
        if err.status in (429, 503):
            server.metrics.rejected.labels(str(err.status)).inc()
        headers = {"Retry-After": "1"} if err.status in (429, 503) else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    class _SSEResponse(StreamingResponse):
        """Server-sent events that abort their requests however the response ends (finished, client gone,
        cancelled, failed)."""

        def __init__(self, content, choices):
            super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            self.choices = choices

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                server.abort(self.choices)

    async def generate(request, *, chat: bool):
        model = ChatRequest if chat else CompletionRequest
        req = await server.parse(request, model)
        params = sampling_params(req, chat=chat)
        prompts = [chat_prompt(req.messages)] if chat else completion_prompts(req.prompt)
        choices = server.submit(prompts, params, prompt_field="messages" if chat else "prompt")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        want_logprobs = params.logprobs is not None
        shape = dict(chat=chat, want_logprobs=want_logprobs, return_token_ids=req.return_token_ids)
        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))
            return _SSEResponse(_stream(server, choices, rid, created, shape, include_usage), choices)
        collect = asyncio.ensure_future(_collect(server, choices))
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client went away (or the handler was cancelled): free the KV now
                collect.cancel()
                server.abort(choices)
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)  # nobody reads it
        collect.result()
        error = _error_of(choices)
        if error is not None:
            return error_response(error)
        body_choices = []
        for c in choices:
            text = "".join(c.text)
            body = server.choice_body(c, text=text, logprobs=c.logprobs, token_ids=c.tokens,
                                      finish_reason=c.finish_reason, **shape)
            if chat:
                body["message"] = {"role": "assistant", "content": text}
            body_choices.append(body)
        out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
               "model": server.model_name, "choices": body_choices, "usage": server.usage(choices)}
        if req.return_token_ids:
            out["prompt_token_ids"] = [c.handle.prompt_ids for c in choices]
        return JSONResponse(out)

    async def completions(request):
        return await generate(request, chat=False)

    async def chat_completions(request):
        return await generate(request, chat=True)

    async def models(request):
        return JSONResponse({"object": "list", "data": [
            {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "pagedkv",
             "max_model_len": worker.engine.max_model_len}]})

    async def health(request):
        if not worker.alive:
            return error_response(ApiError(503, "the engine is not running", type="service_unavailable",
                                           code="engine_stopped"))
        return JSONResponse({"status": "ok"})

    async def metrics(request):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def on_api_error(request, exc: ApiError):
        return error_response(exc)

    async def on_http_error(request, exc: HTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       type=kind))

    async def on_error(request, exc: Exception):
        return error_response(ApiError(500, f"{type(exc).__name__}: {exc}", type="server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if close_worker:
            worker.close()

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                            Route("/v1/models", models, methods=["GET"]),
                            Route("/health", health, methods=["GET"]),
                            Route("/metrics", metrics, methods=["GET"])],
                    exception_handlers={ApiError: on_api_error, HTTPException: on_http_error, Exception: on_error},
                    lifespan=lifespan)
    app.state.server = server
    return app


async def _collect(server: _Server, choices) -> None:
    async for choice, delta in _deltas(server, choices):
        server.take(choice, delta)


async def _stream(server: _Server, choices, rid: str, created: int, shape: dict, include_usage: bool):
    chat = shape["chat"]
    head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": server.model_name}
    if chat:  # OpenAI's first chunk of each choice: the role
        for c in choices:
            yield _sse(head | {"choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
    offsets = [0] * len(choices)
    async for c, delta in _deltas(server, choices):
        server.take(c, delta)
        if delta.finish_reason == "error":
            yield _sse(_error_of([c]).body())
            continue
        body = server.choice_body(c, text=delta.text, logprobs=delta.logprobs, token_ids=delta.token_ids,
                                  finish_reason=delta.finish_reason, offset=offsets[c.index], **shape)
        offsets[c.index] += len(delta.text)
        if chat:
            body["delta"] = {"content": delta.text} if delta.text or not delta.finished else {}
        yield _sse(head | {"choices": [body]})
    if include_usage:
        yield _sse(head | {"choices": [], "usage": server.usage(choices)})
    yield "data: [DONE]\n\n"
