"""``pagedkv demo``: the main job — a small model, end to end, on the best backend this machine has.

    pagedkv demo                       # outputs in a temporary folder it names
    pagedkv demo -o demo-out --backend reference

1. **Model**: a tiny Hugging Face decoder (Qwen2 by default: GQA, QKV bias; random weights) exported to ONNX
   when torch and transformers are installed, else the dependency-free synthetic decoder
   (``pagedkv.onnx_export.synthetic``) — ``model.onnx``.
2. **Rewrite**: attention -> ``PagedKVQKVWrite`` + ``PagedKVAttention`` on 16-token fp16 pages, with the sampling
   head (``model.paged.onnx``; fp16 weights for TensorRT).
3. **Backend**: a TensorRT engine (``model.engine``) when TensorRT and a GPU are present; else the CUDA kernels
   (ONNX Runtime, plugin ops on the GPU) when a GPU is; else the float64 references. The summary says which ran
   and why the better ones did not.
4. **Requests**: five prompts through the continuous-batching engine, two of them arriving while others run;
   prefill is chunked (16 tokens) and mixed with decodes in the same steps, and two prompts share a 40-token
   prefix, so the later one finds its full pages in the prefix cache and skips their prefill. The page map is
   drawn while both hold the shared blocks (``pagemap.png``, ``pagedkv.kvcache.pagemap``).
5. **Accuracy against ONNX Runtime on the original graph**: ``pagedkv compare`` on the same prompts (logits of
   every prefill chunk and decode step within the dtype's tolerance; the paged K/V equal to the original's
   present K/V on the reference backend), and every greedy token the batched engine produced equal to the
   original graph's own greedy continuation of the prompt alone — a difference is accepted only as a near-tie
   of the original's logits (within the same tolerance) and ends that request's comparison.

Outputs (``-o DIR``, default a new temporary folder): ``model.onnx``, ``model.paged.onnx`` (each with its
``.onnx.data``: ``pagedkv.onnx_io``), ``model.engine`` (TensorRT), ``pagemap.png``, ``summary.txt`` (what is printed) and ``summary.json``. Exit status 0 when every check
passes, 1 otherwise. On the references it takes seconds (most of it importing torch).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pagedkv.userio import UsageError, atomic_output

DEMO_BACKENDS = ("auto", "reference", "cuda", "trt")
SOURCES = ("auto", "hf", "synthetic")
DEFAULT_FAMILY = "qwen2"
NEW_TOKENS = 12
CHUNK = 16
SHARED_PREFIX = 40  # tokens: two full 16-token pages and part of a third
# (id, unique tokens, shares the prefix, arrives before step): "d" arrives once "b" has put the shared pages in
# the cache; "e" joins mid-stream
REQUESTS = (("a", 37, False, 0), ("b", 6, True, 0), ("c", 19, False, 0), ("e", 9, False, 3), ("d", 13, True, 5))
LIMITS = dict(max_num_seqs=5, max_num_batched_tokens=40, chunk_size=CHUNK, num_blocks=32)


@dataclass
class DemoModel:
    """What ``make_model`` wrote: the original graph, its rewrite and (trt) the engine."""

    source: str  # what the model is, in words
    original: Path
    rewritten: Path
    engine: Path | None = None
    blocks_rewritten: int = 0


@dataclass
class RequestResult:
    id: str
    prompt_len: int
    shares_prefix: bool
    arrives: int  # the step before which it was submitted
    output_ids: list[int]
    reference_ids: list[int]  # the original graph's greedy tokens, the prompt alone
    equal: int  # leading tokens equal to the reference
    tie_at: int | None = None  # a near-tie of the original's logits at this token (comparison ends there)
    passed: bool = True


@dataclass
class DemoReport:
    out_dir: Path
    model: DemoModel
    backend: str
    backend_why: str
    requests: list[RequestResult] = field(default_factory=list)
    steps: int = 0
    prefill_steps: int = 0  # steps with a prefill chunk
    mixed_steps: int = 0  # steps with prefill chunks and decodes together
    prefix_tokens_reused: int = 0
    preemptions: int = 0
    logits: dict = field(default_factory=dict)  # the compare report, summarized
    pagemap: Path | None = None
    pagemap_note: str = ""
    seconds: float = 0.0

    @property
    def tokens_passed(self) -> bool:
        return bool(self.requests) and all(r.passed for r in self.requests)

    @property
    def passed(self) -> bool:
        return self.tokens_passed and bool(self.logits.get("passed"))

    def to_json(self) -> dict:
        out = asdict(self)
        out.update(passed=self.passed, tokens_passed=self.tokens_passed)
        return json.loads(json.dumps(out, default=str))

    def __str__(self) -> str:
        m, lg = self.model, self.logits
        compared = sum(r.equal for r in self.requests)
        ties = sum(r.tie_at is not None for r in self.requests)
        late = ", ".join(f"{r.id} arriving at step {r.arrives}" for r in self.requests if r.arrives)
        lines = [
            f"pagedkv demo: the main job, outputs in {self.out_dir}",
            f"model     {m.source}: {m.original.name}",
            f"rewrite   {m.blocks_rewritten} attention blocks -> PagedKVQKVWrite + PagedKVAttention, fp16 KV pages "
            f"of {CHUNK} tokens, sampling head: {m.rewritten.name}" + (f", engine {m.engine.name}" if m.engine else ""),
            f"backend   {self.backend}: {self.backend_why}",
            f"requests  {len(self.requests)}: prompts of {', '.join(str(r.prompt_len) for r in self.requests)} tokens "
            f"({' and '.join(r.id for r in self.requests if r.shares_prefix)} share a {SHARED_PREFIX}-token prefix), "
            f"{NEW_TOKENS} greedy tokens each, {late}",
            f"engine    {self.steps} steps: {self.prefill_steps} with prefill chunks of <= {CHUNK} tokens, "
            f"{self.mixed_steps} mixing prefill chunks and decodes; {self.prefix_tokens_reused} prompt tokens taken "
            f"from the prefix cache; {self.preemptions} preemptions",
        ]
        for r in self.requests:
            verdict = ("equal to the original" if r.passed and r.tie_at is None else
                       f"equal up to a near-tie at token {r.tie_at}" if r.passed else
                       f"DIFFERS from the original at token {r.equal}: {r.reference_ids[r.equal]} expected")
            lines.append(f"  {r.id}  prompt {r.prompt_len:>3} -> {r.output_ids}  {verdict}")
        lines += [
            f"accuracy  logits vs ONNX Runtime on the original graph ({lg.get('steps', 0)} steps, chunked prefill + "
            f"decode): max |diff| {lg.get('max_abs', float('nan')):.2e}, {lg.get('max_scaled', float('nan')):.2e} of "
            f"the logits' scale (tolerance {lg.get('atol', 0):g} + {lg.get('rtol', 0):g} * scale)  "
            f"{'PASS' if lg.get('logits_passed') else 'FAIL'}",
        ]
        if lg.get("kv_pairs"):
            lines.append(f"          paged K/V vs the original's present K/V: {lg['kv_pairs']} (sequence, layer) "
                         f"pairs  {'PASS' if lg.get('kv_passed') else 'FAIL'}")
        lines += [
            f"          greedy tokens of the batched engine vs the original, each prompt alone: {compared} equal"
            f"{f', {ties} near-ties' if ties else ''}  {'PASS' if self.tokens_passed else 'FAIL'}",
            f"page map  {self.pagemap.name if self.pagemap else '-'} ({self.pagemap_note})",
            f"{'PASSED' if self.passed else 'FAILED'} in {self.seconds:.1f} s",
        ]
        return "\n".join(lines)


# ---- 1-3: model, rewrite, backend -----------------------------------------------------------------------
def choose_backend(requested: str = "auto") -> tuple[str, str]:
    """(backend, why): the best one this machine runs (``auto``) or the one asked for, with the reason."""
    from pagedkv import cuda
    from pagedkv.runtime import trt

    no_gpu = cuda.why_no_gpu()
    no_trt = trt.why_no_engine_runtime()  # a flavour installed that runs engines on this GPU
    if requested == "trt" and no_trt:
        raise UsageError(f"--backend trt: {no_trt}")
    if requested == "cuda" and no_gpu:
        raise UsageError(f"--backend cuda: {no_gpu}")
    if requested == "reference":
        return "reference", "ONNX Runtime, plugin ops = the float64 references (asked for)"
    if requested == "trt" or (requested == "auto" and not no_trt):
        return "trt", "a TensorRT engine with the pagedkv plugins (a TensorRT that runs engines on this GPU is present)"
    if requested == "cuda" or not no_gpu:
        return "cuda", (f"ONNX Runtime, plugin ops = the CUDA kernels on the GPU"
                        f"{'' if requested == 'cuda' else f' (no engine: {no_trt})'}")
    return "reference", f"ONNX Runtime, plugin ops = the float64 references ({no_gpu}; TensorRT: {no_trt})"


def _synthetic_config():
    from pagedkv.onnx_export.synthetic import SyntheticConfig

    return SyntheticConfig(num_layers=2, hidden=128, num_heads=4, num_kv_heads=2, head_dim=64, vocab=256,
                           intermediate=256, qkv_bias=True, seed=0)


def make_model(out_dir: Path, *, backend: str, source: str = "auto", family: str = DEFAULT_FAMILY,
               seed: int = 0) -> DemoModel:
    """Steps 1-2 (and the engine for ``trt``), written into ``out_dir`` (each graph a .onnx and its .onnx.data)."""
    from pagedkv import onnx_io
    from pagedkv.builder.rewrite import RewriteOptions, rewrite_model
    from pagedkv.onnx_export import hf

    original, rewritten = out_dir / "model.onnx", out_dir / "model.paged.onnx"
    no_hf = hf.why_export_unavailable()
    if source == "hf" and no_hf:
        raise UsageError(f"--source hf: {no_hf}")
    if source == "hf" or (source == "auto" and not no_hf):
        model = hf.load_model(family, seed=seed)
        with warnings.catch_warnings():  # the tracer's notes on a tiny model are noise here
            warnings.simplefilter("ignore")
            hf.export_model(model, original, exporter="legacy", verify=False, source=family)
        c = model.config
        what = (f"tiny {type(model).__name__} from transformers ({c.num_hidden_layers} layers, hidden {c.hidden_size}, "
                f"{c.num_attention_heads} query / {getattr(c, 'num_key_value_heads', c.num_attention_heads)} KV heads, "
                f"vocabulary {c.vocab_size}, random weights)")
    else:
        from pagedkv.onnx_export.synthetic import export_synthetic

        cfg = _synthetic_config()
        export_synthetic(cfg, original)
        what = (f"synthetic decoder ({cfg.num_layers} layers, hidden {cfg.hidden}, {cfg.num_heads} query / "
                f"{cfg.num_kv_heads} KV heads, vocabulary {cfg.vocab}, random weights"
                f"{'; torch not installed' if source == 'auto' else ''})")
    result = rewrite_model(str(original), RewriteOptions(page_size=CHUNK, dtype="fp16" if backend == "trt" else None))
    onnx_io.save(result.model, rewritten, inputs=[original])  # model.paged.onnx + its .data, atomically
    made = DemoModel(what, original, rewritten, blocks_rewritten=len(result.report.layers))
    if backend == "trt":
        from pagedkv.builder.build import BuildLimits, build_engine

        made.engine = build_engine(rewritten, out_dir / "model.engine",
                                   limits=BuildLimits(max_batch=8, max_tokens=512, max_context=32 * CHUNK,
                                                      opt_batch=4, opt_tokens=64)).engine
    return made


# ---- 4: the requests ------------------------------------------------------------------------------------
def demo_prompts(vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, SHARED_PREFIX)
    out = {}
    for rid, n, shares, _ in REQUESTS:
        own = rng.integers(0, vocab, n)
        out[rid] = np.concatenate([shared, own]) if shares else own
    return out


def _run_requests(model: DemoModel, backend: str, prompts, out_dir: Path, report: DemoReport) -> dict:
    """Step 4 through the engine: outputs by request id; fills the report's engine counters and page map."""
    from pagedkv.kvcache.pagemap import SHARED, pagemap_cells, render_pagemap
    from pagedkv.runtime.api import LLM
    from pagedkv.runtime.sampling import SamplingParams

    arrivals: dict[int, list[str]] = {}
    for rid, _, _, step in REQUESTS:
        arrivals.setdefault(step, []).append(rid)
    target = model.engine if backend == "trt" else model.rewritten
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    got = {}
    with LLM(str(target), graph=str(model.rewritten) if backend == "trt" else None, backend=backend,
             debug_validate=True, **LIMITS) as llm:
        engine, manager = llm.engine, llm.executor.manager
        step = 0
        while step <= max(arrivals) or engine.has_unfinished:
            for rid in arrivals.get(step, []):
                got[rid] = engine.add_request(rid, prompts[rid], params)
            engine.step()
            step += 1
            shared = [c for panel in pagemap_cells(manager) for c in panel.cells if c.state == SHARED]
            if report.pagemap is None and shared:
                holders = sorted({str(s) for c in shared for s, _ in c.holders})
                report.pagemap_note = (f"after step {step}: {' and '.join(holders)} share {len(shared)} blocks of "
                                       "the common prefix")
                with atomic_output(out_dir / "pagemap.png") as tmp:
                    render_pagemap(manager, tmp, title=f"pagedkv demo: the KV pool after step {step}")
                report.pagemap = out_dir / "pagemap.png"
        stats = engine.scheduler.stats
        report.steps, report.prefill_steps, report.mixed_steps = stats.steps, stats.prefill_steps, stats.mixed_steps
        report.prefix_tokens_reused, report.preemptions = stats.prefix_tokens_reused, stats.preemptions
        manager.validate()
        if manager.sequences:
            raise RuntimeError(f"demo: sequences left in the KV manager: {manager.sequences}")
    if report.pagemap is None:
        report.pagemap_note = "no step had shared blocks"
    return {rid: list(r.output) for rid, r in got.items()}


# ---- 5: accuracy ----------------------------------------------------------------------------------------
def _token_check(original: Path, prompts, outputs, reference: dict, atol: float, rtol: float) -> list[RequestResult]:
    """Each request's tokens against the original's greedy tokens (``reference``); at the first difference,
    the original's logits after the engine's own tokens decide whether it is a near-tie."""
    from pagedkv.runtime.session import DenseSession

    dense = None
    results = []
    for rid, n, shares, step in REQUESTS:
        ours, want = outputs[rid], reference[rid]
        equal = next((j for j, (a, b) in enumerate(zip(ours, want)) if a != b), min(len(ours), len(want)))
        result = RequestResult(rid, len(prompts[rid]), shares, step, ours, want, equal)
        if equal < len(want):
            dense = dense or DenseSession(str(original))
            logits = dense.step([(rid, np.concatenate([prompts[rid], np.asarray(ours[:equal], np.int64)]))])[0][-1]
            dense.free(rid)
            gap = float(logits[want[equal]] - logits[ours[equal]])
            if gap <= atol + rtol * float(np.abs(logits).max()):
                result.tie_at = equal
            else:
                result.passed = False
        elif len(ours) != len(want):
            result.passed = False
        results.append(result)
    return results


def run_job(model: DemoModel, backend: str, backend_why: str, out_dir: Path, *, seed: int = 0) -> DemoReport:
    """Steps 4-5 on ``model`` (``make_model``'s); the report says what passed."""
    from pagedkv.builder.compare import compare, default_tolerance
    from pagedkv.runtime.graph import RewrittenGraph
    from pagedkv.tolerances import TOLERANCES

    t0 = time.perf_counter()
    report = DemoReport(out_dir, model, backend, backend_why)
    vocab = RewrittenGraph.load(str(model.rewritten)).vocab
    prompts = demo_prompts(vocab, seed)
    outputs = _run_requests(model, backend, prompts, out_dir, report)
    atol, rtol = default_tolerance(str(model.rewritten), str(model.original))
    if backend == "cuda":  # the kernels take 16-bit activations: the float32 graph's q, k, v are rounded at the
        atol, rtol = max((atol, rtol), TOLERANCES["bfloat16"])  # plugins (as tests/gpu compare with)
    ids = [rid for rid, *_ in REQUESTS]
    check = compare(str(model.original), str(model.rewritten), backend=backend, prompts=[prompts[r] for r in ids],
                    decode_steps=NEW_TOKENS, chunk_size=CHUNK, atol=atol, rtol=rtol)
    scaled = max((s.max_scaled for s in check.steps), default=float("nan"))
    report.logits = {"passed": check.logits_passed and check.kv_passed, "logits_passed": check.logits_passed,
                     "kv_passed": check.kv_passed, "kv_pairs": len(check.kv), "steps": len(check.steps),
                     "max_abs": check.max_abs, "max_scaled": scaled, "atol": atol, "rtol": rtol}
    greedy = check.greedy_tokens  # the original's argmax chain, keyed s0, s1, ... in prompt order
    reference = {rid: greedy.get(f"s{i}", []) for i, rid in enumerate(ids)}
    report.requests = _token_check(model.original, prompts, outputs, reference, atol, rtol)
    report.seconds = time.perf_counter() - t0
    return report


# ---- the CLI ---------------------------------------------------------------------------------------------
def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    from pagedkv.onnx_export._hf_families import FAMILIES

    parser.add_argument("-o", "--output-dir", default=None, help="where the model, engine, page map and summary "
                                                                "go (default: a new temporary folder)")
    parser.add_argument("--backend", choices=DEMO_BACKENDS, default="auto",
                        help="auto: a TensorRT engine with TensorRT and a GPU, else the CUDA kernels with a GPU, "
                             "else the references")
    parser.add_argument("--source", choices=SOURCES, default="auto",
                        help="auto: a tiny Hugging Face model when torch + transformers are installed, else synthetic")
    parser.add_argument("--family", choices=sorted(FAMILIES), default=DEFAULT_FAMILY, help="the Hugging Face family")
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts")


def run_demo(args) -> int:
    start = time.perf_counter()
    if args.output_dir is None:
        out_dir = Path(tempfile.mkdtemp(prefix="pagedkv-demo-"))
    else:
        out_dir = Path(args.output_dir)
        if out_dir.exists() and not out_dir.is_dir():
            raise UsageError(f"--output-dir: {str(out_dir)!r} is a file, expected a folder")
        out_dir.mkdir(parents=True, exist_ok=True)
    backend, why = choose_backend(args.backend)
    model = make_model(out_dir, backend=backend, source=args.source, family=args.family, seed=args.seed)
    report = run_job(model, backend, why, out_dir, seed=args.seed)
    report.seconds = time.perf_counter() - start
    text = str(report)
    with atomic_output(out_dir / "summary.txt") as tmp:
        tmp.write_text(text + "\n")
    with atomic_output(out_dir / "summary.json") as tmp:
        tmp.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    print(text)
    return 0 if report.passed else 1
