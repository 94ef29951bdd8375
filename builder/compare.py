"""Prove that a rewritten graph computes what the original computes, step by step.

    pagedkv compare original.onnx rewritten.onnx [--backend reference|cuda|trt] [--prompts 3]
                    [--prompt-lens 5,17,33] [--decode-steps 8] [--chunk-size 16] [--atol A --rtol R]

N prompts of different lengths go through (optionally chunked) prefill and M greedy decode steps on both
graphs, with one schedule (``pagedkv.runtime.loop.Schedule``) so the inputs are identical. The original runs the
whole schedule first (its logits choose every token) and is closed before the rewritten graph replays the same
steps, so only one of the two models is ever resident (a model past 2 GB costs one copy of its weights):

* original: ONNX Runtime, dense past K/V, one sequence per run (``pagedkv.runtime.session.DenseSession``);
* rewritten: the chosen backend — ``reference`` (ONNX Runtime + numpy pools + float64 references),
  ``cuda`` (ONNX Runtime + device pools + CUDA kernels through the C API), ``trt`` (an engine built here with
  ``pagedkv.builder.build``, run by ``pagedkv.runtime.trt.TrtExecutor``) — every step packs all sequences
  (mixed prefill chunks and decodes).

The next token of each sequence is the argmax of the *original's* logits, fed to both, so a single
disagreement cannot derail the rest of the comparison; the rewritten argmax is reported beside it.
Per step the logits are compared with polygraphy's ``SimpleCompareFunc`` against a tolerance relative to
the output's scale: every element must satisfy ``|rewritten - original| <= atol + rtol * max|original|``
(passed to polygraphy as its element-wise absolute tolerance). Why the scale and not each element: the
rewritten graph stores K/V in the pool's cache dtype (fp16 at best: the contract has no fp32 cache), and a
storage rounding of relative size u perturbs every logit by about u times the logits' scale, also logits
that happen to be near zero; a per-element relative bound would fail on those for no fault. Wrong RoPE,
window, bias or scale give errors of the logits' own order and still fail by far. At the end the paged K/V of every sequence and layer is read back from
the pools (reference backend) and compared with the original's present K/V — the keys after RoPE, so this
checks the written cache itself, not only its effect on the logits.

Reduced precision: a rewritten float16 / bfloat16 graph is compared with its float32 original as the
reference. ONNX Runtime's CPU provider has no bfloat16 kernels and onnxruntime-extensions' Python ops (the
plugins' reference ops) take float32 only, so the CPU backends run 16-bit graphs emulated in float32
(``pagedkv.builder.precision.emulate_in_float32``): weights exact, every op computing in float32 and rounding
its result to the graph's dtype, as an unfused 16-bit execution does. The ``trt`` backend builds its engine from
the graph itself. The CLI's default tolerance is the loosest of the cache dtype's and the activations' dtype's
(``default_tolerance``; ``pagedkv.tolerances.MODEL_TOLERANCES``).

Exit status (CLI): 0 when every step is within tolerance and every greedy token agrees, 1 otherwise.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import numpy as np

from pagedkv.tolerances import MODEL_TOLERANCES, TOLERANCES
from pagedkv.userio import atomic_output, progress

REWRITTEN_BACKENDS = ("reference", "cuda", "trt")
DEFAULT_PROMPT_LENS = (5, 17, 33, 12, 26, 9, 40, 3)


@dataclass
class StepResult:
    step: int
    entries: list[tuple[object, int, str]]  # (sequence, new tokens, "prefill" | "decode")
    max_abs: float
    max_scaled: float  # max abs error / max|original| of the compared output
    passed: bool
    argmax_agree: int  # rows of the step whose rewritten argmax equals the original's
    rows: int
    # (sequence, original argmax, rewritten argmax, decisive): a disagreement is *decisive* when the original
    # logits rank its token above the rewritten pick by more than the step's tolerance. Near-ties (random
    # weights make many) can flip under the cache dtype's rounding without any error in the rewrite.
    greedy: list[tuple[object, int, int, bool]] = field(default_factory=list)
    bound: float = 0.0  # the step's tolerance on |rewritten - original|: atol + rtol * max|original|

    @property
    def greedy_agree(self) -> bool:
        return all(o == r or not decisive for _, o, r, decisive in self.greedy)


@dataclass
class KVResult:
    layer: int
    seq: object
    max_abs: float
    max_scaled: float  # max abs error / max|original| of the compared output
    passed: bool
    positions: int  # positions compared (resident in the paged cache)


@dataclass
class CompareReport:
    backend: str
    atol: float
    rtol: float
    chunk_size: int
    prompt_lens: list[int]
    decode_steps: int
    steps: list[StepResult] = field(default_factory=list)
    kv: list[KVResult] = field(default_factory=list)
    dtypes: tuple[str, str] = ("float32", "float32")  # activations of (original, rewritten)
    emulated: bool = False  # a 16-bit graph ran emulated in float32 (module docstring)

    @property
    def logits_passed(self) -> bool:
        return all(s.passed for s in self.steps)

    @property
    def greedy_passed(self) -> bool:
        return all(s.greedy_agree for s in self.steps)

    @property
    def kv_passed(self) -> bool:
        return all(k.passed for k in self.kv)

    @property
    def passed(self) -> bool:
        return bool(self.steps) and self.logits_passed and self.greedy_passed and self.kv_passed

    @property
    def max_abs(self) -> float:
        return max((s.max_abs for s in self.steps), default=0.0)

    @property
    def greedy_tokens(self) -> dict:
        out: dict = {}
        for s in self.steps:
            for seq, orig, _, _ in s.greedy:
                out.setdefault(seq, []).append(orig)
        return out

    def to_json(self) -> dict:
        """The report for ``pagedkv compare --json``: per step the logits' max abs error, its ratio to the
        logits' scale (``max_rel``) and the step's bound, and each greedy token of both graphs (``tie``: they
        differ by less than the tolerance); per (sequence, layer) the paged K/V against the present K/V."""
        steps = [{"step": s.step, "rows": s.rows,
                  "batch": [{"seq": seq, "tokens": n, "kind": kind} for seq, n, kind in s.entries],
                  "logits": {"max_abs": s.max_abs, "max_rel": s.max_scaled, "bound": s.bound, "passed": s.passed},
                  "argmax_agree": s.argmax_agree,
                  "greedy": [{"seq": seq, "original": o, "rewritten": r, "agree": o == r, "tie": o != r and not d}
                             for seq, o, r, d in s.greedy]}
                 for s in self.steps]
        kv = [{"seq": k.seq, "layer": k.layer, "max_abs": k.max_abs, "max_rel": k.max_scaled,
               "positions": k.positions, "passed": k.passed} for k in self.kv]
        return {"passed": self.passed, "logits_passed": self.logits_passed, "greedy_passed": self.greedy_passed,
                "kv_passed": self.kv_passed, "backend": self.backend, "atol": self.atol, "rtol": self.rtol,
                "prompt_lens": self.prompt_lens, "chunk_size": self.chunk_size, "decode_steps": self.decode_steps,
                "dtypes": {"original": self.dtypes[0], "rewritten": self.dtypes[1]}, "emulated": self.emulated,
                "max_abs": self.max_abs, "steps": steps, "kv": kv}

    def plot(self, path, *, inputs=()) -> None:
        """A PNG of each step's max abs logits error against its tolerance (matplotlib Agg, log scale), written
        atomically (``inputs``: paths it must not overwrite)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        fig = Figure(figsize=(8, 4.5), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        steps = [s.step for s in self.steps]
        errors = [max(s.max_abs, 1e-30) for s in self.steps]  # an exact step still shows, at the floor
        ax.semilogy(steps, errors, "o-", label="max |rewritten - original| of the logits")
        ax.semilogy(steps, [s.bound for s in self.steps], "--", color="tab:red",
                    label=f"tolerance {self.atol:g} + {self.rtol:g} * max|original|")
        failed = [(s.step, e) for s, e in zip(self.steps, errors) if not s.passed]
        if failed:
            ax.scatter(*zip(*failed), color="tab:red", zorder=3, label="out of tolerance")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step (prefill chunks and decodes of every sequence)")
        ax.set_ylabel("logits error")
        ax.set_title(f"pagedkv compare, {self.backend} backend: {'PASSED' if self.passed else 'FAILED'}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        with atomic_output(path, inputs=inputs, name="--plot") as tmp:
            fig.savefig(tmp, format="png")

    def __str__(self) -> str:
        dtypes = f"{self.dtypes[0]} original, {self.dtypes[1]} rewritten" + (
            " (16-bit graphs emulated in float32: each op's result rounded)" if self.emulated else "")
        lines = [f"compare: backend={self.backend}, prompts {self.prompt_lens}, chunk {self.chunk_size or 'none'}, "
                 f"{self.decode_steps} decode steps, {dtypes}, "
                 f"tolerance |diff| <= {self.atol:g} + {self.rtol:g} * max|original|",
                 f"{'step':>4}  {'tokens':>6}  {'batch':<34} {'max abs':>9}  {'abs/scale':>9}  {'argmax':>7}  greedy"]
        for s in self.steps:
            batch = " ".join(f"{seq}:{kind[0]}{n}" for seq, n, kind in s.entries)
            if not s.greedy:
                greedy = "-"
            elif all(o == r for _, o, r, _ in s.greedy):
                greedy = "ok"
            elif s.greedy_agree:  # only near-ties differ
                greedy = "tie " + ", ".join(f"{q}:{o}~{r}" for q, o, r, _ in s.greedy if o != r)
            else:
                greedy = "DIFF " + ", ".join(f"{q}:{o}!={r}" for q, o, r, d in s.greedy if o != r and d)
            flag = "" if s.passed else "  FAIL"
            lines.append(f"{s.step:>4}  {s.rows:>6}  {batch[:34]:<34} {s.max_abs:9.2e}  {s.max_scaled:9.2e}  "
                         f"{s.argmax_agree:>3}/{s.rows:<3}  {greedy}{flag}")
        if self.kv:
            worst = max(self.kv, key=lambda k: k.max_abs)
            bad = [k for k in self.kv if not k.passed]
            lines.append(f"paged K/V vs present K/V: {len(self.kv)} (sequence, layer) pairs, max abs {worst.max_abs:.2e}"
                         + (f", FAILED for {[(k.seq, k.layer) for k in bad]}" if bad else ", all within tolerance"))
        lines.append("PASSED" if self.passed else
                     f"FAILED (logits {'ok' if self.logits_passed else 'out of tolerance'}, greedy "
                     f"{'ok' if self.greedy_passed else 'differs'}, kv {'ok' if self.kv_passed else 'differs'})")
        return "\n".join(lines)


def _compare_arrays(name, expected, got, atol, rtol):
    """polygraphy's element-wise comparison of one output with the scale-relative bound
    ``atol + rtol * max|expected|`` (module docstring). Returns (passed, max abs err, max abs err / scale)."""
    from polygraphy.comparator import IterationResult, SimpleCompareFunc
    from polygraphy.logger import G_LOGGER

    expected = np.ascontiguousarray(expected, dtype=np.float64)
    got = np.ascontiguousarray(got, dtype=np.float64)
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    bound = atol + rtol * scale
    func = SimpleCompareFunc(atol=bound, rtol=0.0, check_error_stat="elemwise")
    with G_LOGGER.verbosity(G_LOGGER.CRITICAL):
        res = func(IterationResult({name: expected}, runner_name="original"),
                   IterationResult({name: got}, runner_name="rewritten"))
    out = res[name]
    max_abs = float(out.max_absdiff)
    return bool(out), max_abs, (max_abs / scale if scale else max_abs)


def make_prompts(num: int, lens, vocab: int, seed: int) -> list[np.ndarray]:
    lens = list(lens) if lens else list(DEFAULT_PROMPT_LENS[:num])
    if len(lens) < num:
        raise ValueError(f"prompt_lens: {len(lens)} lengths given for {num} prompts")
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(n), dtype=np.int64) for n in lens[:num]]


def _blocks_needed(groups, prompt_lens, decode_steps) -> list[int]:
    """Blocks per pool group for all sequences at their final length, plus one per sequence of slack."""
    out = []
    for spec in groups:
        need = sum(int(spec.layout.pages_needed(n + decode_steps)) + 1 for n in prompt_lens)
        out.append(max(need, 4))
    return out


def open_rewritten(rewritten, backend: str, num_blocks):
    """A session with ``.step`` / ``.free`` / ``.has_sequence`` over the rewritten graph (path or ModelProto);
    for ``trt``, an engine is built from it first (into a temporary directory, gone once the session has it)."""
    if backend in ("reference", "cuda"):
        from pagedkv.runtime.session import OrtExecutor

        return OrtExecutor(rewritten, backend=backend, num_blocks=num_blocks)
    if backend == "trt":
        import tempfile
        from pathlib import Path

        import onnx

        from pagedkv import onnx_io
        from pagedkv.builder.build import build_engine
        from pagedkv.runtime import trt

        trt.check_available()  # before building: why an engine cannot run here
        with tempfile.TemporaryDirectory(prefix="pagedkv-trt-") as tmp:
            source = rewritten
            if isinstance(rewritten, onnx.ModelProto):
                source = onnx_io.save(rewritten, Path(tmp) / "rewritten.onnx")
            engine = build_engine(source, Path(tmp) / "model.engine").engine
            return trt.TrtExecutor(rewritten, engine=engine, num_blocks=num_blocks)
    raise ValueError(f"backend: expected one of {REWRITTEN_BACKENDS}, got {backend!r}")


def activation_dtype(model) -> str:
    """numpy name of a graph's activation dtype: its weights' (``precision.model_dtype``)."""
    from pagedkv.builder.precision import dtype_name, model_dtype

    return dtype_name(model_dtype(model))


@dataclass
class _OriginalStep:
    """One step of the original's run, kept for the replay on the rewritten graph."""

    entries: list  # [(sequence, new token ids)]
    kinds: list[str]  # "prefill" | "decode" per entry
    logits: list[np.ndarray]  # per entry [n_i, vocab]
    picks: list[int | None]  # the token chosen after each entry (None: mid-prompt chunk)


def _run_original(original, prompts, decode_steps: int, chunk_size: int, check_kv: bool, head_dims):
    """The original through the whole schedule (it alone chooses the tokens), then closed: only one of the two
    graphs is ever resident, so a big model costs one copy of its weights. ``head_dims``: the rewritten layers'
    (for an original that leaves them symbolic). -> (steps, dense presents by (sequence, layer) when ``check_kv``)."""
    from pagedkv.runtime.loop import Prompt, Schedule
    from pagedkv.runtime.session import DenseSession

    dense = DenseSession(original, head_dims)
    sched = Schedule([Prompt(f"s{i}", p) for i, p in enumerate(prompts)], decode_steps=decode_steps,
                     chunk_size=chunk_size)
    steps = []
    while entries := sched.next_step():
        kinds = ["decode" if r.fed == r.prompt.size and r.generated else "prefill" for r in sched.pending]
        logits = dense.step(entries)
        picks = [int(np.argmax(e[-1])) if sched.wants_next_token(i) else None for i, e in enumerate(logits)]
        sched.advance(picks)
        steps.append(_OriginalStep(entries, kinds, logits, picks))
    layers = range(dense.graph.num_layers) if check_kv else ()
    presents = {(r.id, layer): dense.present(r.id, layer) for r in sched.requests for layer in layers}
    return steps, presents


def compare(original, rewritten, *, backend: str = "reference", num_prompts: int | None = None, prompt_lens=None,
            prompts=None, decode_steps: int = 8, chunk_size: int = 0, seed: int = 0, atol: float = 1e-5,
            rtol: float = 1e-5, kv_atol: float | None = None, kv_rtol: float | None = None,
            check_kv: bool = True, num_blocks=None, quiet: bool = True) -> CompareReport:
    """Run both graphs on the same schedule; see the module docstring. ``original``: path or ModelProto of
    the decoder-with-past graph; ``rewritten``: path or ModelProto of the rewritten graph (or, for
    ``backend="trt"``, the rewritten ONNX an engine is built from: ``open_rewritten``). Paths are opened with
    ``pagedkv.onnx_io`` (any size); the original runs first, to the end, then the rewritten graph replays its steps.
    ``quiet``: no progress bar (``pagedkv.userio.progress``: one tick per step, on a terminal only)."""
    from pagedkv import onnx_io
    from pagedkv.builder.precision import emulate_in_float32
    from pagedkv.runtime.graph import DecoderGraph, RewrittenGraph

    original_model = onnx_io.load_if_path(original, "original graph")
    rewritten = onnx_io.load_if_path(rewritten, "rewritten graph")
    dtypes = (activation_dtype(original_model), activation_dtype(rewritten))
    runnable = emulate_in_float32(original_model)
    emulated = runnable is not original_model
    if emulated:
        original = runnable
    graph = RewrittenGraph.load(rewritten)
    decoder = DecoderGraph.load(original_model)
    check_same_model(decoder, graph, vocab_size(original_model, decoder.logits))
    if prompts is None:
        if num_prompts is None:
            num_prompts = len(prompt_lens) if prompt_lens else 3
        prompts = make_prompts(num_prompts, prompt_lens, vocab_size(original_model, decoder.logits), seed)
    lens = [int(len(p)) for p in prompts]
    if num_blocks is None:
        num_blocks = _blocks_needed(graph.groups, lens, decode_steps)
    report = CompareReport(backend, atol, rtol, chunk_size, lens, decode_steps, dtypes=dtypes)
    kv_atol = atol if kv_atol is None else kv_atol
    kv_rtol = rtol if kv_rtol is None else kv_rtol

    head_dims = [layer.write.pool.head_dim for layer in graph.layers] if graph.layers else None
    steps, presents = _run_original(original, prompts, decode_steps, chunk_size, check_kv and backend == "reference",
                                    head_dims)
    del original, runnable  # the original's run is over: only the rewritten graph is resident from here on
    if backend != "trt":  # the CPU backends' plugin ops take float32 (module docstring); an engine takes the graph
        runnable = emulate_in_float32(rewritten)  # after the original's run: one model resident at a time
        emulated |= runnable is not rewritten
        rewritten = runnable
    report.emulated = emulated
    paged = open_rewritten(rewritten, backend, num_blocks)
    bar = progress(desc="compare", unit="step", quiet=quiet)
    try:
        for index, step in enumerate(steps, start=1):
            bar.update()
            got = paged.step(step.entries)
            exp_all, got_all = np.concatenate(step.logits), np.concatenate(got)
            ok, max_abs, max_scaled = _compare_arrays("logits", exp_all, got_all, atol, rtol)
            agree = int(np.sum(np.argmax(exp_all, -1) == np.argmax(got_all, -1)))
            tol = atol + rtol * float(np.max(np.abs(exp_all)))
            result = StepResult(index, [(sid, len(t), k) for (sid, t), k in zip(step.entries, step.kinds)],
                                max_abs, max_scaled, ok, agree, exp_all.shape[0], bound=tol)
            for (sid, _), e, g, o in zip(step.entries, step.logits, got, step.picks):
                if o is not None:
                    r = int(np.argmax(g[-1]))
                    result.greedy.append((sid, o, r, bool(e[-1][o] - e[-1][r] > tol)))
            report.steps.append(result)
        for (seq, layer), present in presents.items():
            report.kv.append(_compare_kv(present, paged, seq, layer, kv_atol, kv_rtol))
    finally:
        bar.close()
        paged.close()
    return report


def _compare_kv(present, paged, seq, layer, atol, rtol) -> KVResult:
    k_exp, v_exp = present
    k_got, v_got = paged.read_kv(seq, layer)
    resident = ~np.isnan(k_got[0, :, 0])  # windowed caches release old positions
    exp = np.concatenate([k_exp[:, resident], v_exp[:, resident]]).astype(np.float64)
    got = np.concatenate([k_got[:, resident], v_got[:, resident]])
    ok, max_abs, max_scaled = _compare_arrays("kv", exp, got, atol, rtol)
    return KVResult(layer, seq, max_abs, max_scaled, ok, int(resident.sum()))


def check_same_model(original, rewritten, vocab: int) -> None:
    """GraphError unless the rewritten graph (``RewrittenGraph``) can be the rewrite of the original
    (``DecoderGraph`` with ``vocab``): the same layers, KV heads and head dims per layer, and vocabulary."""
    from pagedkv.runtime.graph import GraphError

    def differ(what, a, b):
        raise GraphError(f"original and rewritten are graphs of different models: {what} {a} vs {b} (compare a "
                         "graph with its own `pagedkv rewrite` output)")

    if len(rewritten.layers) != original.num_layers:
        differ("layers", original.num_layers, len(rewritten.layers))
    if rewritten.vocab != vocab:
        differ("vocabulary", vocab, rewritten.vocab)
    for layer, kv_heads, head_dim in zip(rewritten.layers, original.kv_heads, original.head_dims):
        pool = layer.write.pool
        if pool.num_kv_heads != kv_heads or head_dim and pool.head_dim != head_dim:  # head_dim 0: symbolic there
            differ(f"layer {layer.index} (KV heads, head dim)", (kv_heads, head_dim),
                   (pool.num_kv_heads, pool.head_dim))


def vocab_size(model, logits: str) -> int:
    """The static vocabulary size (last dim) of the ``logits`` output."""
    for o in model.graph.output:
        if o.name == logits:
            dims = o.type.tensor_type.shape.dim
            if dims and dims[-1].HasField("dim_value"):
                return int(dims[-1].dim_value)
    raise ValueError("original graph: the logits output has no static vocabulary dimension; pass prompts")


# ---- CLI ----------------------------------------------------------------------------------------------
def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("original", help="decoder-with-past ONNX (before the rewrite)")
    parser.add_argument("rewritten", help="rewritten ONNX (pagedkv rewrite output)")
    parser.add_argument("--backend", choices=REWRITTEN_BACKENDS, default="reference",
                        help="runs the rewritten graph: reference (numpy), cuda (the kernels), trt (an engine)")
    parser.add_argument("--prompts", type=int, default=3, help="number of prompts (ragged lengths)")
    parser.add_argument("--prompt-lens", default=None, help="comma-separated prompt lengths")
    parser.add_argument("--decode-steps", type=int, default=8, help="greedy decode steps after the prefill")
    parser.add_argument("--chunk-size", type=int, default=0, help="prefill chunk (0: whole prompt at once)")
    parser.add_argument("--seed", type=int, default=0, help="random prompts")
    parser.add_argument("--atol", type=float, default=None,
                        help="default: by the rewritten graph's cache and activation dtypes (docs/builder.md, "
                             "compare)")
    parser.add_argument("--rtol", type=float, default=None,
                        help="relative to max|original|; default: by the dtypes, as --atol")
    parser.add_argument("--no-kv-check", action="store_true", help="skip the paged-vs-present K/V check")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (per step: max abs and "
                                                            "relative error, tolerance, greedy tokens and ties)")
    parser.add_argument("--plot", default=None, metavar="PNG", help="draw each step's error against the tolerance")


# Default tolerances of the CLI by the cache dtype of the rewritten pools, for float32 activations (16-bit
# activations add pagedkv.tolerances.MODEL_TOLERANCES: default_tolerance takes the loosest). fp16/bf16 come from
# the one table (pagedkv.tolerances). Its fp8/int8 entries are per element in units of the scale; through a
# whole model the logits move by more, so the CLI allows 10% of the logits' scale there.
CLI_TOLERANCE_BY_CACHE = {"FP16": TOLERANCES["float16"], "BF16": TOLERANCES["bfloat16"],
                          "FP8_E4M3": (1e-1, 1e-1), "INT8": (1e-1, 1e-1)}


def default_tolerance(rewritten, original=None) -> tuple[float, float]:
    """(atol, rtol) for comparing ``rewritten`` (path or ModelProto) with its original: the loosest of its pools'
    cache dtypes (``CLI_TOLERANCE_BY_CACHE``) and of the activation dtypes of both graphs
    (``pagedkv.tolerances.MODEL_TOLERANCES``, for 16-bit graphs)."""
    from pagedkv import onnx_io
    from pagedkv.runtime.graph import RewrittenGraph

    rewritten = onnx_io.load_if_path(rewritten, "rewritten graph")  # weights stay on disk: only types are read
    graph = RewrittenGraph.load(rewritten)
    candidates = [CLI_TOLERANCE_BY_CACHE[g.cache_dtype.name] for g in graph.groups]
    for model in (rewritten, original):
        if model is not None:
            candidates.append(MODEL_TOLERANCES[activation_dtype(onnx_io.load_if_path(model, "original graph"))])
    return max(candidates, key=lambda t: t[0])


def run_compare(args) -> int:
    from pagedkv import onnx_io
    from pagedkv.runtime.backends import BackendUnavailable
    from pagedkv.runtime.graph import GraphError, is_rewritten
    from pagedkv.userio import (UsageError, check_float, check_input_file, check_int, check_output_path,
                                parse_int_list, print_json)

    paths = check_input_file(args.original, "original"), check_input_file(args.rewritten, "rewritten")
    lens = parse_int_list("--prompt-lens", args.prompt_lens, low=1) if args.prompt_lens else None
    num = len(lens) if lens else check_int("--prompts", args.prompts, low=1)
    check_int("--decode-steps", args.decode_steps, low=0)
    check_int("--chunk-size", args.chunk_size, low=0)
    atol, rtol = args.atol, args.rtol
    for name, value in (("--atol", atol), ("--rtol", rtol)):
        if value is not None:
            check_float(name, value, low=0.0)
    if args.plot is not None:
        check_output_path(args.plot, paths, "--plot")
    original, rewritten = (onnx_io.load(p, name) for p, name in zip(paths, ("original", "rewritten")))
    if is_rewritten(original) and not is_rewritten(rewritten):
        raise UsageError(f"original: {str(paths[0])!r} is the rewritten graph and rewritten: {str(paths[1])!r} the "
                         "original; the arguments are swapped (pagedkv compare ORIGINAL REWRITTEN)")
    try:
        if atol is None or rtol is None:
            default = default_tolerance(rewritten, original)
            atol = default[0] if atol is None else atol
            rtol = default[1] if rtol is None else rtol
        report = compare(original, rewritten, backend=args.backend, num_prompts=num, prompt_lens=lens,
                         decode_steps=args.decode_steps, chunk_size=args.chunk_size, seed=args.seed, atol=atol,
                         rtol=rtol, check_kv=not args.no_kv_check, quiet=args.quiet or args.json)
    except (BackendUnavailable, GraphError) as exc:
        raise UsageError(str(exc)) from None
    if args.plot is not None:
        report.plot(args.plot, inputs=paths)
    if args.json:
        print_json(report.to_json())
    else:
        print(report)
    return 0 if report.passed else 1
