"""``pagedkv bench MODEL``: offline throughput and online latency of the runtime, in-process on a ``Worker`` or
against a running ``pagedkv serve``.

    pagedkv bench model.paged.onnx --num-prompts 64 --input-len 128 --output-len 32        # offline
    pagedkv bench model.paged.onnx --request-rate 4,inf --len-dist normal --plot bench.png --json
    pagedkv bench model.paged.onnx --url http://127.0.0.1:8000 --request-rate 2             # a running server

Every run sends the same requests (``--num-prompts``; one fixed, seeded set):

* ``--request-rate inf`` (the default): **offline throughput**, every request submitted at once;
* ``--request-rate R``: **online latency**, requests arriving as a Poisson process of R per second (exponential
  gaps, seeded).

Requests: synthetic token ids with input / output lengths drawn from ``--len-dist`` — ``fixed``, ``uniform``
(within ``--len-spread`` of the mean, relative) or ``normal`` (standard deviation ``--len-spread`` x mean), at
least 1 — or a prompts file (``--prompts-file F.jsonl``, lines ``{"prompt": "..."}`` or ``{"input_ids": [...]}``,
optional ``"max_tokens"``). Every request generates exactly its output length (``ignore_eos``), greedy unless
``--temperature``. Per run: requests per second, output and total tokens per second, and mean / p50 / p90 / p99 of
the time to first token (TTFT), the inter-token latency (ITL, every gap between tokens), the time per output
token after the first (TPOT, per request) and the end-to-end latency — measured as the client sees them
(``pagedkv.runtime.latency``, the same accounting ``pagedkv serve``'s metrics use). A table on stdout, or
``--json`` (with ``-o FILE``, written atomically); ``--plot PNG`` draws the latency distributions and the
throughput of every run.

In-process, the engine flags are ``pagedkv generate``'s; with ``--url`` (loopback or any host) they are the
server's business and MODEL only gives the vocabulary for synthetic prompts. The server is asked for token ids
(``return_token_ids``), so tokens are counted exactly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import dataclass

import numpy as np

from pagedkv.userio import UsageError, atomic_output, check_float, check_input_file, check_int, progress

LEN_DISTS = ("fixed", "uniform", "normal")
PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "itl", "tpot", "e2e")


@dataclass(frozen=True)
class LengthDist:
    """Token counts: ``fixed`` at ``mean``; ``uniform`` in mean x [1 - spread, 1 + spread]; ``normal`` with
    standard deviation spread x mean; rounded, at least 1 (and at most ``high`` when given)."""

    kind: str
    mean: int
    spread: float = 0.0

    def __post_init__(self):
        if self.kind not in LEN_DISTS:
            raise ValueError(f"len_dist: expected one of {', '.join(LEN_DISTS)}, got {self.kind!r}")
        if self.mean < 1:
            raise ValueError(f"length: must be >= 1, got {self.mean}")
        if not 0 <= self.spread <= (1 if self.kind == "uniform" else math.inf):
            raise ValueError(f"len_spread: expected {'[0, 1]' if self.kind == 'uniform' else '>= 0'} for "
                             f"{self.kind}, got {self.spread}")

    def sample(self, rng: np.random.Generator, n: int, high: int | None = None) -> np.ndarray:
        if self.kind == "fixed":
            x = np.full(n, float(self.mean))
        elif self.kind == "uniform":
            x = rng.uniform(self.mean * (1 - self.spread), self.mean * (1 + self.spread), n)
        else:
            x = rng.normal(self.mean, self.spread * self.mean, n)
        return np.clip(np.rint(x), 1, high if high is not None else None).astype(np.int64)


@dataclass
class BenchRequest:
    prompt: object  # token ids (list) or text
    max_tokens: int


def synthetic_requests(n: int, inputs: LengthDist, outputs: LengthDist, vocab: int, seed: int,
                       max_model_len: int | None = None) -> list[BenchRequest]:
    """``n`` requests of random token ids; output lengths are cut so that prompt + output fit ``max_model_len``."""
    rng = np.random.default_rng(seed)
    limit = None if max_model_len is None else max_model_len - 1
    ins = inputs.sample(rng, n, limit)
    outs = outputs.sample(rng, n)
    if max_model_len is not None:
        outs = np.minimum(outs, max_model_len - ins)
    return [BenchRequest(rng.integers(0, vocab, int(i)).tolist(), int(o)) for i, o in zip(ins, outs)]


def file_requests(path, outputs: LengthDist, seed: int, limit: int | None = None) -> list[BenchRequest]:
    """The prompts of a JSON-lines file (``pagedkv.runtime.generate.read_prompt_lines``), each with its
    ``max_tokens`` or a length drawn from ``outputs``."""
    from pagedkv.runtime.generate import read_prompt_lines

    lines = read_prompt_lines(path, "--prompts-file", text=True)[:limit]
    drawn = outputs.sample(np.random.default_rng(seed), len(lines))
    out = []
    for (rid, prompt, record), n in zip(lines, drawn):
        max_tokens = record.get("max_tokens", int(n))
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise UsageError(f"--prompts-file {path}: line {rid!r}: max_tokens must be an integer >= 1, got "
                             f"{max_tokens!r}")
        out.append(BenchRequest(prompt, max_tokens))
    return out


# ---- clients ---------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    timing: object  # pagedkv.runtime.latency.RequestTiming
    prompt_tokens: int
    error: str | None = None


class WorkerClient:
    """Requests into a ``Worker`` in this process (deltas through the event loop)."""

    def __init__(self, worker, temperature: float = 0.0, seed: int = 0):
        self.worker, self.temperature, self.seed = worker, temperature, seed

    async def run(self, index: int, req: BenchRequest) -> Outcome:
        from pagedkv.runtime.latency import RequestTiming
        from pagedkv.runtime.sampling import SamplingParams

        params = SamplingParams(max_new_tokens=req.max_tokens, ignore_eos=True, temperature=self.temperature,
                                seed=self.seed + index if index >= 0 else None)
        timing = RequestTiming()
        handle = self.worker.submit(req.prompt, params, loop=asyncio.get_running_loop())
        error = None
        try:
            async for delta in handle:
                timing.arrived(len(delta.token_ids))
                if delta.finished:
                    error = delta.error or (None if delta.finish_reason in ("length", "stop") else
                                            f"finished: {delta.finish_reason}")
        finally:
            self.worker.abort(handle.id)  # (a no-op once finished)
        timing.finish()
        return Outcome(timing, len(handle.prompt_ids), error)

    async def close(self) -> None:
        pass


class HttpClient:
    """Streaming ``/v1/completions`` requests to a server (``pagedkv serve`` or any OpenAI-compatible one that
    returns ``token_ids`` per chunk and usage)."""

    def __init__(self, url: str, model: str | None, temperature: float = 0.0, seed: int = 0, timeout: float = 600):
        import httpx

        self.url = url.rstrip("/")
        self.model, self.temperature, self.seed = model, temperature, seed
        self.http = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None,
                                                                         max_keepalive_connections=64))

    async def run(self, index: int, req: BenchRequest) -> Outcome:
        from pagedkv.runtime.latency import RequestTiming

        body = {"prompt": req.prompt, "max_tokens": req.max_tokens, "ignore_eos": True, "stream": True,
                "temperature": self.temperature, "return_token_ids": True, "stream_options": {"include_usage": True}}
        if index >= 0:  # (warm-up requests: index < 0, no seed)
            body["seed"] = self.seed + index
        if self.model:
            body["model"] = self.model
        timing, prompt_tokens, error = RequestTiming(), 0, None
        try:
            async with self.http.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    return Outcome(timing, 0, f"HTTP {r.status_code}: {text[:200]}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        error = event["error"].get("message", "error")
                    for choice in event.get("choices", []):
                        timing.arrived(len(choice.get("token_ids", [])))
                    if event.get("usage"):
                        prompt_tokens = event["usage"]["prompt_tokens"]
        except Exception as exc:  # noqa: BLE001 - a failed request is counted, the run goes on
            error = f"{type(exc).__name__}: {exc}"
        timing.finish()
        return Outcome(timing, prompt_tokens, error)

    async def close(self) -> None:
        await self.http.aclose()


# ---- a run -----------------------------------------------------------------------------------------------
def arrival_times(n: int, rate: float, seed: int) -> np.ndarray:
    """Seconds after the start at which each request is sent: all at 0 (rate inf) or a Poisson process."""
    if math.isinf(rate):
        return np.zeros(n)
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))


async def run_load(client, requests: list[BenchRequest], rate: float, *, seed: int = 0, quiet: bool = True) -> dict:
    """Send ``requests`` at ``rate`` (module docstring); returns the run's summary (``summarize``)."""
    times = arrival_times(len(requests), rate, seed)
    outcomes: list = [None] * len(requests)
    with progress(total=len(requests), desc=f"bench {'offline' if math.isinf(rate) else f'{rate:g} req/s'}",
                  unit="req", quiet=quiet) as bar:
        async def one(i):
            outcomes[i] = await client.run(i, requests[i])
            bar.update(1)

        start = time.perf_counter()
        tasks = []
        for i, at in enumerate(times):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(i)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(outcomes, requests, duration, rate)


def _stats(values) -> dict:
    """mean and percentiles in milliseconds (None without values)."""
    v = np.asarray(values, dtype=np.float64) * 1e3
    if v.size == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    return {"mean": float(v.mean()), **{f"p{p}": float(np.percentile(v, p)) for p in PERCENTILES}}


def summarize(outcomes: list[Outcome], requests: list[BenchRequest], duration: float, rate: float) -> dict:
    ok = [o for o in outcomes if o.error is None]
    t = [o.timing for o in ok]
    output = sum(x.tokens for x in t)
    prompt = sum(o.prompt_tokens for o in ok)
    tpot = [(x.e2e - x.ttft) / (x.tokens - 1) for x in t if x.tokens > 1]
    return {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "mode": "offline" if math.isinf(rate) else "online",
        "requests": len(outcomes), "completed": len(ok), "failed": len(outcomes) - len(ok),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
        "duration_s": duration,
        "prompt_tokens": prompt, "output_tokens": output,
        "expected_output_tokens": sum(r.max_tokens for r in requests),
        "request_throughput": len(ok) / duration if duration else None,
        "output_throughput": output / duration if duration else None,
        "total_throughput": (prompt + output) / duration if duration else None,
        "ttft_ms": _stats([x.ttft for x in t if x.ttft is not None]),
        "itl_ms": _stats([g for x in t for g in x.gaps]),
        "tpot_ms": _stats(tpot),
        "e2e_ms": _stats([x.e2e for x in t]),
        "per_request": {"ttft_s": [x.ttft for x in t], "e2e_s": [x.e2e for x in t],
                        "output_tokens": [x.tokens for x in t]},
    }


def table(runs: list[dict]) -> str:
    """One line per run: throughput, then mean / p50 / p90 / p99 of each latency (ms)."""
    head = (f"{'rate':>6} {'reqs':>5} {'fail':>4} {'time s':>7} {'req/s':>7} {'out tok/s':>9} {'tot tok/s':>9}  "
            + "  ".join(f"{m.upper() + ' ms':<27}" for m in METRICS))
    sub = " " * 55 + "  ".join(f"{'mean':>6} {'p50':>6} {'p90':>6} {'p99':>6}" for _ in METRICS)
    lines = [head, sub]
    for r in runs:
        cells = []
        for m in METRICS:
            s = r[f"{m}_ms"]
            cells.append(" ".join(f"{s[k]:6.1f}" if s[k] is not None else f"{'-':>6}"
                                  for k in ("mean", "p50", "p90", "p99")))
        lines.append(f"{str(r['request_rate']):>6} {r['requests']:>5} {r['failed']:>4} {r['duration_s']:7.2f} "
                     f"{r['request_throughput'] or 0:7.2f} {r['output_throughput'] or 0:9.1f} "
                     f"{r['total_throughput'] or 0:9.1f}  " + "  ".join(cells))
    return "\n".join(lines)


def plot(runs: list[dict], path, title: str) -> None:
    """TTFT, inter-token and end-to-end latency distributions (CDFs) of every run and their throughput."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7.5), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    panels = (("ttft_s", "time to first token (ms)"), ("e2e_s", "end-to-end latency (ms)"))
    for ax, (key, label) in zip(axes[0], panels):
        for r in runs:
            v = np.sort(np.asarray(r["per_request"][key], dtype=np.float64) * 1e3)
            if v.size:
                ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=f"rate {r['request_rate']}")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[1, 0]
    for r in runs:
        s = r["itl_ms"]
        if s["mean"] is not None:
            ax.plot(list(PERCENTILES), [s[f"p{p}"] for p in PERCENTILES], marker="o", label=f"rate {r['request_rate']}")
    ax.set_xlabel("percentile")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_xticks(list(PERCENTILES))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax = axes[1, 1]
    names = [str(r["request_rate"]) for r in runs]
    ax.bar(names, [r["output_throughput"] or 0 for r in runs], color="#4e79a7")
    ax.set_xlabel("request rate (req/s; inf = offline)")
    ax.set_ylabel("output tokens / s")
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format="png")


# ---- the CLI ---------------------------------------------------------------------------------------------
def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from pagedkv.runtime.generate import add_engine_arguments, add_model_arguments

    add_model_arguments(parser)
    load = parser.add_argument_group("load")
    load.add_argument("--num-prompts", type=int, default=64, help="requests per run")
    load.add_argument("--request-rate", default="inf",
                      help="comma-separated arrival rates in requests/s, a run each; inf: all at once (offline)")
    load.add_argument("--input-len", type=int, default=128, help="mean prompt length (synthetic prompts)")
    load.add_argument("--output-len", type=int, default=32, help="mean output length")
    load.add_argument("--len-dist", choices=LEN_DISTS, default="fixed", help="distribution of both lengths")
    load.add_argument("--len-spread", type=float, default=0.5,
                      help="uniform: half-width relative to the mean; normal: standard deviation / mean")
    load.add_argument("--prompts-file", default=None,
                      help='JSON lines {"prompt": "..."} or {"input_ids": [...]}, optional "max_tokens"')
    load.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    load.add_argument("--seed", type=int, default=0, help="prompts, lengths, arrivals and sampling")
    load.add_argument("--warmup", type=int, default=1, help="requests run before the timed runs")
    load.add_argument("--url", default=None, help="benchmark a running server (pagedkv serve) instead of an "
                                                  "in-process worker; engine flags are then ignored")
    load.add_argument("--served-model-name", default=None, help="with --url: the model to ask for (default: the "
                                                                "server's)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    out.add_argument("-o", "--output", default=None, help="write the JSON results to this file")
    out.add_argument("--plot", default=None, help="draw the latencies and throughput to this PNG")
    add_engine_arguments(parser, max_num_seqs=256)


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in str(text).split(","):
        rate = check_float("--request-rate", part.strip(), low=0.0, low_open=True) if part.strip() != "inf" \
            else math.inf
        rates.append(rate)
    return rates


def _requests(args, vocab: int, max_model_len: int | None) -> list[BenchRequest]:
    outputs = LengthDist(args.len_dist, args.output_len, args.len_spread)
    if args.prompts_file:
        return file_requests(args.prompts_file, outputs, args.seed, limit=args.num_prompts)
    inputs = LengthDist(args.len_dist, args.input_len, args.len_spread)
    return synthetic_requests(args.num_prompts, inputs, outputs, vocab, args.seed, max_model_len)


async def _bench(client, requests, rates, args) -> list[dict]:
    warm = requests[:max(0, args.warmup)]
    if warm:
        await asyncio.gather(*(client.run(-1 - i, r) for i, r in enumerate(warm)))
    runs = []
    for rate in rates:
        runs.append(await run_load(client, requests, rate, seed=args.seed, quiet=args.quiet))
    await client.close()
    return runs


def run_bench(args) -> int:
    from pagedkv.userio import print_json

    check_int("--num-prompts", args.num_prompts, low=1)
    check_int("--input-len", args.input_len, low=1)
    check_int("--output-len", args.output_len, low=1)
    check_float("--len-spread", args.len_spread, low=0.0, high=1.0 if args.len_dist == "uniform" else None)
    check_int("--warmup", args.warmup, low=0)
    check_float("--temperature", args.temperature, low=0.0)
    rates = parse_rates(args.request_rate)
    if args.prompts_file:
        check_input_file(args.prompts_file, "--prompts-file")
    if args.url is not None:
        from pagedkv.runtime.graph import RewrittenGraph

        try:
            import httpx  # noqa: F401
        except ImportError:
            raise UsageError("--url: needs httpx (pip install 'pagedkv[serve]')") from None
        model = check_input_file(args.model, "model")
        vocab = RewrittenGraph.load(str(model)).vocab if model.suffix.lower() == ".onnx" else None
        if vocab is None and not args.prompts_file:
            raise UsageError("--url: synthetic prompts need the vocabulary: give the rewritten .onnx as MODEL, or "
                             "--prompts-file")
        requests = _requests(args, vocab or 1, None)
        client = HttpClient(args.url, args.served_model_name, args.temperature, args.seed)
        target = args.url
        runs = asyncio.run(_bench(client, requests, rates, args))
    else:
        from pagedkv.runtime.api import Worker
        from pagedkv.runtime.generate import open_llm

        with open_llm(args, seed=args.seed) as llm:
            requests = _requests(args, llm.engine.graph.vocab, llm.engine.max_model_len)
            with Worker(llm.engine, max_pending=len(requests) + max(args.warmup, 0) + 1) as worker:
                try:
                    runs = asyncio.run(_bench(WorkerClient(worker, args.temperature, args.seed), requests, rates,
                                              args))
                except ValueError as exc:  # a prompt the engine refuses (context limit, vocabulary)
                    raise UsageError(str(exc)) from None
            target = f"{llm.backend} backend, in-process"
    title = (f"pagedkv bench {args.model} ({target}): {len(requests)} requests, "
             + (f"prompts from {args.prompts_file}" if args.prompts_file else
                f"input {args.input_len} / output {args.output_len} tokens ({args.len_dist})"))
    results = {"model": str(args.model), "target": target, "num_prompts": len(requests),
               "input_len": None if args.prompts_file else args.input_len, "output_len": args.output_len,
               "len_dist": args.len_dist, "len_spread": args.len_spread, "prompts_file": args.prompts_file,
               "temperature": args.temperature, "seed": args.seed, "runs": runs}
    if args.output:
        with atomic_output(args.output, inputs=[args.model, args.prompts_file]) as tmp:
            tmp.write_text(json.dumps(results, indent=2) + "\n")
    if args.plot:
        plot(runs, args.plot, title)
    if args.json:
        print_json(results)
    else:
        print(f"# {title}")
        print(table(runs))
    return 1 if any(r["failed"] for r in runs) else 0
