"""Build a TensorRT or TensorRT-RTX engine from a rewritten graph.

    pagedkv build rewritten.onnx -o model.engine [--builder auto|tensorrt|tensorrt_rtx]
        [--max-batch 64] [--max-tokens 2048] [--max-context 4096] [--compute-capability 80,86,89,120]
        [--timing-cache timing.cache] [--serialize-plugins] [--workspace-mib N]

One code path over the API both flavours share (``pagedkv.trt_library``): ``IPluginRegistry.load_library`` registers
``libpagedkv_plugins.so``, a strongly typed network (``NetworkDefinitionCreationFlag.STRONGLY_TYPED``: the graph's
own dtypes, as TensorRT 11 requires) is parsed with ``OnnxParser``, one optimization profile covers every dynamic
input, and ``build_serialized_network`` writes the plan. The flavour is TensorRT when installed, else TensorRT-RTX,
or ``--builder``. The builder is called directly rather than through polygraphy's loaders: polygraphy picks its
flavour once per process from ``POLYGRAPHY_USE_TENSORRT_RTX``, and its ``--plugins`` only dlopens a library, which
TensorRT-RTX cannot take (docs/plugin_io.md, "Loading the library"); the equivalent ``trtexec`` / ``polygraphy``
command lines are printed all the same (``equivalent_commands``).

Pre-flight (``preflight``, before TensorRT is imported), each failure one ``UsageError`` line: the input exists and
is a rewritten graph (``RewrittenGraph``), its plugin activations have a dtype of the capability table
(``pagedkv.config.SUPPORTED_IO_DTYPES``: float16 or bfloat16; ``pagedkv rewrite --dtype`` converts) and its engine
inputs the dtypes of ``pagedkv.engine_io``, the limits are sane, the plugin library exists and has code for every
target, the flavour is installed and can build here.

Optimization profile (``BuildLimits.profile``): from what the engine must serve, in the user's terms. ``max_tokens``
is T (new tokens of a step, all sequences), ``max_batch`` B (sequences of a step), ``max_context`` the tokens a
sequence may hold, which sizes MB (block-table columns) through each pool group's layout (``pages_needed``: a
cyclic group needs no more than its ring). Minima are 1 (T, B, MB) and 2 (B + 1); the shapes tuned for (opt) are
a decode step of the full batch over ``opt_context``. The heads' dims follow from the same limits: R (logits
rows) runs from 1 to T (``compare`` asks for every row; tuned for a decode step's one per sequence) and W
(penalty tokens per row: the distinct tokens of a sequence's prompt and output) from 1 to ``max_context``, at
most the vocabulary (tuned for 1: no penalties). A dim the graph fixes is kept (``pagedkv rewrite
--max-blocks`` makes MB static: ``max_context`` must then fit in it). The engine runs in
``pagedkv.runtime.trt.TrtExecutor``.

Targets: TensorRT builds for the GPU it runs on. TensorRT-RTX builds for compute capabilities (``--compute-
capability``; default its own default set, 80, 86, 89 and 120), each of which the plugin library must have code
for (its CUDA architectures, ``pagedkv doctor``).

The engine carries its build record in its plugin layers' metadata (``builder/engine_record.py``): ``pagedkv
inspect`` reads it back, without a GPU. The engine and the timing cache are written atomically
(``userio.atomic_output``): a failed build leaves nothing behind.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pagedkv import __version__, engine_io, trt_library
from pagedkv.userio import UsageError, atomic_output, check_input_file, check_int, check_output_path

DEFAULT_WORKSPACE_MIB = None  # TensorRT's default: the device's memory
INT32_MAX = 2 ** 31 - 1
# The option that bounds each symbolic dim of the profile (``BuildLimits.profile``), for errors that name it
DIM_LIMITS = {engine_io.NUM_TOKENS: "--max-tokens", engine_io.BATCH: "--max-batch",
              engine_io.BATCH_PLUS_1: "--max-batch", engine_io.MAX_BLOCKS: "--max-context",
              engine_io.NUM_LOGITS: "--max-tokens", engine_io.PENALTY_WIDTH: "--max-context"}


# ---- limits and the optimization profile ------------------------------------------------------------------
@dataclass(frozen=True)
class BuildLimits:
    """What the engine must serve (see the module docstring); ``profile`` turns it into shapes."""

    max_batch: int = 64  # sequences per step (B)
    max_tokens: int = 2048  # new tokens per step, all sequences together (T)
    max_context: int = 4096  # tokens a sequence holds after a step (sizes the block tables)
    opt_batch: int | None = None  # tuned for; default max_batch
    opt_tokens: int | None = None  # default opt_batch: a decode step
    opt_context: int | None = None  # default max_context

    def resolved(self) -> "BuildLimits":
        """With the opt defaults filled in; each value checked (``UsageError`` naming the option)."""
        for name in ("max_batch", "max_tokens", "max_context"):
            if check_int(_option(name), getattr(self, name), low=1) > INT32_MAX:
                raise UsageError(f"{_option(name)}: expected at most {INT32_MAX} (the plugins' int32 extents), got "
                                 f"{getattr(self, name)}")
        opt_batch = self.max_batch if self.opt_batch is None else self.opt_batch
        opt_tokens = min(opt_batch, self.max_tokens) if self.opt_tokens is None else self.opt_tokens
        opt_context = self.max_context if self.opt_context is None else self.opt_context
        for name, value, high in (("opt_batch", opt_batch, self.max_batch), ("opt_tokens", opt_tokens, self.max_tokens),
                                  ("opt_context", opt_context, self.max_context)):
            check_int(_option(name), value, low=1, high=high)
        for tokens, batch, what in ((self.max_tokens, self.max_batch, "max"), (opt_tokens, opt_batch, "opt")):
            if batch > tokens:
                raise UsageError(f"{_option(what + '_batch')}={batch} exceeds {_option(what + '_tokens')}={tokens}: "
                                 "every sequence of a step brings at least one token")
        return BuildLimits(self.max_batch, self.max_tokens, self.max_context, opt_batch, opt_tokens, opt_context)

    def profile(self, graph) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """(min, opt, max) shape of every engine input of a ``RewrittenGraph``; dims the graph fixes stay fixed."""
        lim = self.resolved()
        pages = [lambda n, g=g: int(g.layout.pages_needed(n)) for g in graph.groups]
        mb_max, mb_opt = max(p(lim.max_context) for p in pages), max(p(lim.opt_context) for p in pages)
        bounds = {engine_io.NUM_TOKENS: (1, lim.opt_tokens, lim.max_tokens),
                  engine_io.BATCH: (1, lim.opt_batch, lim.max_batch),
                  engine_io.BATCH_PLUS_1: (2, lim.opt_batch + 1, lim.max_batch + 1),
                  engine_io.MAX_BLOCKS: (1, mb_opt, mb_max),
                  engine_io.NUM_LOGITS: (1, lim.opt_batch, lim.max_tokens),
                  engine_io.PENALTY_WIDTH: (1, 1, min(lim.max_context, graph.vocab))}
        page_size = graph.groups[0].layout.page_size
        if mb_max * page_size > INT32_MAX:
            raise UsageError(f"max-context={lim.max_context}: {mb_max} pages of {page_size} tokens exceed int32 cache "
                             "positions (the plugins' bound)")
        if graph.max_blocks is not None:  # the graph fixes MB (pagedkv rewrite --max-blocks)
            if graph.max_blocks < mb_max:
                raise UsageError(f"max-context={lim.max_context}: a sequence needs up to {mb_max} pages, but the "
                                 f"graph's block tables are static with max_blocks={graph.max_blocks} (pagedkv "
                                 f"rewrite --max-blocks): rewrite with --max-blocks >= {mb_max} or lower --max-context")
            bounds[engine_io.MAX_BLOCKS] = (graph.max_blocks,) * 3
        bounds[engine_io.NUM_POOL_GROUPS] = (graph.num_groups,) * 3
        specs = dict(engine_io.engine_inputs(graph.num_groups, graph.explicit_positions, graph.sampling))
        unknown = sorted(set(graph.input_names) - set(specs))
        if unknown:
            raise UsageError(f"input: engine inputs {unknown} are not in the engine-I/O contract (pagedkv.engine_io); "
                             "cannot size a profile")
        shapes = {name: tuple(engine_io.resolve_shape(specs[name], {d: b[k] for d, b in bounds.items()})
                              for k in range(3)) for name in graph.input_names}
        unsized = sorted({d for lo, _, _ in shapes.values() for d in lo if isinstance(d, str)})
        if unsized:  # a symbolic dim the contract gained without a bound here
            raise UsageError(f"input: the engine-I/O contract's dims {unsized} have no profile bound; cannot size a "
                             "profile")
        dims = _graph_input_dims(graph.model)
        for name, (lo, _, _) in shapes.items():  # what the graph says must agree with the contract
            if len(dims[name]) != len(lo) or any(isinstance(g, int) and g != d for g, d in zip(dims[name], lo)):
                raise UsageError(f"input: engine input {name!r} has dims {dims[name]}; the engine-I/O contract "
                                 f"says {list(specs[name].shape)}")
        return shapes


def _option(name: str) -> str:
    return name.replace("_", "-")


def _graph_input_dims(model) -> dict[str, list]:
    """Each graph input's dims: ints where static, the dim_param name where symbolic."""
    out = {}
    for vi in model.graph.input:
        out[vi.name] = [d.dim_value if d.HasField("dim_value") else d.dim_param
                        for d in vi.type.tensor_type.shape.dim]
    return out


# ---- options and the pre-flight -------------------------------------------------------------------------------
@dataclass(frozen=True)
class BuildOptions:
    builder: str = "auto"  # trt_library.BUILDER_CHOICES
    compute_capabilities: tuple[int, ...] | None = None  # TensorRT-RTX targets, e.g. (80, 89); None: the default
    timing_cache: str | Path | None = None  # read when present, written after a successful build
    serialize_plugins: bool = False  # embed the plugin library in a version-compatible engine (TensorRT)
    workspace_mib: int | None = DEFAULT_WORKSPACE_MIB
    plugin_library: str | Path | None = None  # default: the installed libpagedkv_plugins.so


@dataclass
class BuildPlan:
    """Everything the build needs, checked before TensorRT is imported (``preflight``)."""

    source: Path
    output: Path
    graph: object  # RewrittenGraph
    limits: BuildLimits  # resolved
    shapes: dict
    options: BuildOptions
    flavour: trt_library.Flavour
    plugin_library: Path
    targets: tuple[int, ...] | None  # TensorRT-RTX compute capabilities; None: the build GPU (TensorRT)
    io_dtype: str
    notes: list[str] = field(default_factory=list)


def preflight(source, output, limits: BuildLimits = BuildLimits(), options: BuildOptions = BuildOptions()) -> BuildPlan:
    """Every check that needs no TensorRT (module docstring), in that order; ``UsageError`` on the first failure."""
    from pagedkv import _lib
    from pagedkv.config import SUPPORTED_IO_DTYPES
    from pagedkv.runtime.graph import GraphError, RewrittenGraph

    src = check_input_file(source, "input")
    out = check_output_path(output, [src])
    try:
        graph = RewrittenGraph.load(str(src))
    except GraphError as exc:
        raise UsageError(f"input: {str(src)!r} is not a rewritten graph: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - not ONNX at all
        raise UsageError(f"input: {str(src)!r} cannot be read as ONNX: {type(exc).__name__}: {exc}") from None
    dtypes = sorted({layer.io_dtype for layer in graph.layers})
    if any(d not in SUPPORTED_IO_DTYPES for d in dtypes) or len(dtypes) != 1:
        raise UsageError(f"input: the plugin activations are {'/'.join(dtypes)}; the plugins take "
                         f"{' or '.join(SUPPORTED_IO_DTYPES)} (capabilities.h), one for all layers: convert with "
                         "`pagedkv rewrite --dtype fp16|bf16`")
    _check_engine_input_dtypes(graph)
    resolved = limits.resolved()
    shapes = resolved.profile(graph)
    library = Path(options.plugin_library) if options.plugin_library else _lib.find_file(_lib.PLUGINS_NAME)
    if library is None or not library.is_file():
        raise UsageError(f"plugins: {str(library or _lib.PLUGINS_NAME)!r} not found "
                         f"(searched {[str(d) for d in _lib.lib_dirs()]}); build pagedkv or pass --plugins")
    if options.workspace_mib is not None:
        check_int("workspace-mib", options.workspace_mib, low=1)
    try:
        flavour = trt_library.flavour(options.builder)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except trt_library.TensorRTUnavailable as exc:
        raise UsageError(f"builder {options.builder}: {exc}") from None
    plan = BuildPlan(src, out, graph, resolved, shapes, options, flavour, library, None, dtypes[0])
    _check_targets(plan)
    if options.serialize_plugins and not flavour.can_serialize_plugins:
        raise UsageError(f"serialize-plugins: {flavour.title} engines do not embed plugin libraries "
                         "(IBuilderConfig.plugins_to_serialize with a version-compatible engine is TensorRT's)")
    if options.timing_cache is not None:
        if not flavour.has_timing_cache:
            raise UsageError(f"timing-cache: {flavour.title}'s timing cache operations are no-ops (deprecated since "
                             "TensorRT-RTX 1.2; it tunes at run time, with its runtime cache)")
        cache = Path(options.timing_cache)
        if cache.is_dir():
            raise UsageError(f"timing-cache: {str(cache)!r} is a directory, expected a file")
        check_output_path(cache, [src, out], "timing-cache")
    return plan


def _check_engine_input_dtypes(graph) -> None:
    import onnx

    specs = dict(engine_io.engine_inputs(graph.num_groups, graph.explicit_positions, graph.sampling))
    for vi in graph.model.graph.input:
        spec = specs.get(vi.name)
        got = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type).name
        if spec is not None and spec.dtype is not None and got != spec.dtype.name:
            raise UsageError(f"input: engine input {vi.name!r} is {got}, the engine I/O contract says "
                             f"{spec.dtype.name} (pagedkv.engine_io)")


def _check_targets(plan: BuildPlan) -> None:
    """TensorRT-RTX's targets, each one the plugin library can run on; TensorRT's is the build GPU."""
    from pagedkv import cuda

    requested = plan.options.compute_capabilities
    if not plan.flavour.builds_without_gpu:
        if requested:
            raise UsageError(f"compute-capability: {plan.flavour.title} builds for the GPU it runs on; only "
                             "TensorRT-RTX builds for listed compute capabilities (--builder tensorrt_rtx)")
        reason = cuda.why_no_gpu()
        if reason:
            raise UsageError(f"builder {plan.flavour.name}: {plan.flavour.title} builds on a GPU and {reason}; "
                             "TensorRT-RTX builds without one (--builder tensorrt_rtx)")
        return
    runnable = _runnable_targets()
    if requested:
        for cc in requested:
            if cc not in trt_library.RTX_COMPUTE_CAPABILITIES:
                raise UsageError(f"compute-capability {cc}: not a TensorRT-RTX target (its targets: "
                                 f"{', '.join(map(str, trt_library.RTX_COMPUTE_CAPABILITIES))})")
            if cc not in runnable:
                raise UsageError(f"compute-capability {cc}: the plugin library has no code that runs on it (built for "
                                 f"CUDA architectures {_architectures_text()}); runnable: "
                                 f"{', '.join(map(str, sorted(runnable)))}")
        plan.targets = tuple(requested)
        return
    plan.targets = tuple(cc for cc in trt_library.RTX_DEFAULT_TARGETS if cc in runnable)
    if not plan.targets:
        raise UsageError(f"compute-capability: none of TensorRT-RTX's default targets "
                         f"{trt_library.RTX_DEFAULT_TARGETS} can run the plugin library (built for "
                         f"{_architectures_text()}); rebuild pagedkv for them (PAGEDKV_CUDA_ARCHS) or pass "
                         "--compute-capability")
    if plan.targets != trt_library.RTX_DEFAULT_TARGETS:
        plan.notes.append(f"targets {', '.join(map(str, plan.targets))}: the plugin library has no code for "
                          f"{', '.join(str(c) for c in trt_library.RTX_DEFAULT_TARGETS if c not in plan.targets)}")


def _architectures_text() -> str:
    from pagedkv import _lib

    return _lib.build_info().get("cuda_architectures", "?")


def _runnable_targets(candidates=trt_library.RTX_COMPUTE_CAPABILITIES) -> set[int]:
    """The TensorRT-RTX targets the plugin library's code runs on: SASS of the same major and no newer minor, or
    PTX of no newer architecture (CMake's 'NN' is SASS + PTX, 'NN-real' SASS, 'NN-virtual' PTX)."""
    sass, ptx = set(), set()
    for item in _architectures_text().replace(";", ",").split(","):
        arch, _, kind = item.strip().partition("-")
        if not arch.isdigit():
            continue
        if kind in ("", "real"):
            sass.add(int(arch))
        if kind in ("", "virtual"):
            ptx.add(int(arch))
    return {cc for cc in candidates
            if any(s // 10 == cc // 10 and s <= cc for s in sass) or any(p <= cc for p in ptx)}


# ---- the build ---------------------------------------------------------------------------------------------
@dataclass
class BuildResult:
    engine: Path
    flavour: str
    version: str
    targets: list[str]
    seconds: float
    engine_bytes: int
    timing_cache: Path | None
    commands: list[str]
    notes: list[str]
    warnings: list[str]


def build_engine(source, engine_path, *, limits: BuildLimits = BuildLimits(), options: BuildOptions = BuildOptions(),
                 quiet: bool = True) -> BuildResult:
    """Pre-flight, then build and write the engine (and the timing cache) atomically."""
    return build(preflight(source, engine_path, limits, options), quiet=quiet)


def build(plan: BuildPlan, *, quiet: bool = True) -> BuildResult:
    trt = trt_library.import_flavour(plan.flavour)
    t0 = time.perf_counter()
    logger = _make_logger(trt, quiet)
    trt_library.load_plugin_library(trt, plan.plugin_library)
    trt_library.plugin_messages(plan.plugin_library)  # forget what earlier builds in this process left
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(plan.source)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise RuntimeError(f"{plan.flavour.title}'s ONNX parser refused {plan.source}: {'; '.join(errors)}"
                           + trt_library.with_plugin_messages(plan.plugin_library))
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in plan.shapes.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED  # layer metadata and names in the inspector
    if plan.options.workspace_mib:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, plan.options.workspace_mib * 2 ** 20)
    targets = _set_targets(trt, config, plan)
    if plan.options.serialize_plugins:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
        config.plugins_to_serialize = [str(plan.plugin_library)]
    cache = _load_timing_cache(config, plan.options.timing_cache)
    config.progress_monitor = _make_progress(trt, quiet)
    _attach_record(trt, network, plan, targets)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"{plan.flavour.title} could not build an engine from {plan.source}"
                           + (f": {'; '.join(logger.errors[-3:])}" if logger.errors else "")
                           + trt_library.with_plugin_messages(plan.plugin_library))
    with atomic_output(plan.output, inputs=[plan.source]) as tmp:
        tmp.write_bytes(bytes(serialized))
    saved_cache = None
    if cache is not None:
        with atomic_output(plan.options.timing_cache, inputs=[plan.source, plan.output], name="timing-cache") as tmp:
            tmp.write_bytes(bytes(cache.serialize()))
        saved_cache = Path(plan.options.timing_cache)
    return BuildResult(plan.output, plan.flavour.name, trt.__version__, targets, round(time.perf_counter() - t0, 2),
                       plan.output.stat().st_size, saved_cache, equivalent_commands(plan), plan.notes,
                       logger.warnings)


def _set_targets(trt, config, plan: BuildPlan) -> list[str]:
    """Set TensorRT-RTX's targets; the names of what the engine targets."""
    if plan.targets is None:
        from pagedkv import cuda

        return [f"build GPU (compute capability {cuda.compute_capability()})"]
    names = [f"SM{cc}" for cc in plan.targets]
    missing = [n for n in names if not hasattr(trt.ComputeCapability, n)]
    if missing:
        known = [n for n in dir(trt.ComputeCapability) if n.startswith("SM")]
        raise UsageError(f"compute-capability: {plan.flavour.title} {trt.__version__} has no target "
                         f"{', '.join(missing)}; its targets are {', '.join(known)}")
    config.num_compute_capabilities = len(names)
    for i, name in enumerate(names):
        config.set_compute_capability(getattr(trt.ComputeCapability, name), i)
    return names


def _load_timing_cache(config, path):
    if path is None:
        return None
    path = Path(path)
    cache = config.create_timing_cache(path.read_bytes() if path.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    return config.get_timing_cache()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _attach_record(trt, network, plan: BuildPlan, targets: list[str]) -> None:
    """The build record and each plugin layer's fields, into the plugin layers' metadata (engine_record.py)."""
    from pagedkv.builder import engine_record
    from pagedkv.config import ATTENTION_PLUGIN_NAME, WRITE_PLUGIN_NAME

    nodes = {}
    for layer in plan.graph.layers:
        nodes[layer.write_node] = (WRITE_PLUGIN_NAME, layer.write.to_attributes())
        nodes[layer.attention_node] = (ATTENTION_PLUGIN_NAME, layer.attention.to_attributes())
    plugin_layers, entries = [], []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.PLUGIN_V3:
            plugin, fields = nodes.get(layer.name, (None, {}))
            plugin_layers.append(layer)
            entries.append({"layer": layer.name, "plugin": plugin, "fields": fields})
    io = []
    for tensors, mode in (((network.get_input(i) for i in range(network.num_inputs)), "input"),
                          ((network.get_output(i) for i in range(network.num_outputs)), "output")):
        io += [[t.name, mode, trt_library.dtype_name(trt, t.dtype), list(t.shape)] for t in tensors]
    record = {
        "pagedkv": __version__,
        "builder": {"flavour": plan.flavour.name, "title": plan.flavour.title, "version": trt.__version__},
        "targets": targets,
        "strongly_typed": bool(network.get_flag(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)),
        "version_compatible": plan.options.serialize_plugins,
        "plugins_serialized": [plan.plugin_library.name] if plan.options.serialize_plugins else [],
        "limits": {**asdict(plan.limits), "page_size": plan.graph.groups[0].layout.page_size},
        "profile": {name: [list(s) for s in shapes] for name, shapes in plan.shapes.items()},
        "io": io,
        "io_dtype": plan.io_dtype,
        "source": {"file": plan.source.name, "sha256": _sha256(plan.source)},
        "plugin_library": {"file": plan.plugin_library.name, "sha256": _sha256(plan.plugin_library)},
    }
    if plugin_layers and not hasattr(plugin_layers[0], "metadata"):  # an older TensorRT 10 without ILayer.metadata
        plan.notes.append(f"{plan.flavour.title} {trt.__version__} has no ILayer.metadata: the engine carries no "
                          "build record (pagedkv inspect reads the header and plugin records only)")
        return
    for layer, text in zip(plugin_layers, engine_record.layer_metadata(entries, record)):
        layer.metadata = text


def _make_logger(trt, quiet: bool):
    class Logger(trt.ILogger):
        """Keeps warnings and errors (for the report and error lines); shows them unless quiet."""

        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors, self.warnings = [], []

        def log(self, severity, msg):
            if severity <= trt.ILogger.Severity.ERROR:
                self.errors.append(msg)
            elif severity == trt.ILogger.Severity.WARNING:
                self.warnings.append(msg)
            else:
                return
            if not quiet:
                print(f"[{trt.__name__}] {severity.name}: {msg}", file=sys.stderr)

    return Logger()


def _make_progress(trt, quiet: bool):
    from pagedkv.userio import progress

    class Progress(trt.IProgressMonitor):
        """TensorRT's build phases as nested progress bars (userio.progress: a terminal only, not with --quiet)."""

        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self._bars = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            self._bars[phase_name] = progress(total=num_steps, desc=phase_name, unit="step", quiet=quiet)

        def step_complete(self, phase_name, step):
            bar = self._bars.get(phase_name)
            if bar is not None:
                bar.update(1)
            return True  # never cancel

        def phase_finish(self, phase_name):
            bar = self._bars.pop(phase_name, None)
            if bar is not None:
                bar.close()

    return Progress()


# ---- the equivalent command lines ---------------------------------------------------------------------------
def _shape_arg(shape) -> str:
    return "x".join(str(d) for d in shape)


def equivalent_commands(plan: BuildPlan) -> list[str]:
    """trtexec (TensorRT) or tensorrt_rtx (TensorRT-RTX's trtexec) and, for TensorRT, polygraphy: the same build."""
    from pagedkv import _lib

    shapes = {k: ",".join(f"{name}:{_shape_arg(s[k])}" for name, s in plan.shapes.items()) for k in range(3)}
    tool = "trtexec" if plan.flavour is trt_library.TENSORRT else "tensorrt_rtx"
    cmd = [tool, f"--onnx={plan.source}", f"--saveEngine={plan.output}", f"--dynamicPlugins={plan.plugin_library}",
           f"--minShapes={shapes[0]}", f"--optShapes={shapes[1]}", f"--maxShapes={shapes[2]}", "--stronglyTyped",
           "--profilingVerbosity=detailed"]
    if plan.options.workspace_mib:
        cmd.append(f"--memPoolSize=workspace:{plan.options.workspace_mib}M")
    if plan.options.timing_cache:
        cmd.append(f"--timingCacheFile={plan.options.timing_cache}")
    if plan.options.serialize_plugins:
        cmd += ["--versionCompatible", f"--setPluginsToSerialize={plan.plugin_library}"]
    commands = [" ".join(cmd)]
    if plan.flavour is trt_library.TENSORRT:
        selfreg = _lib.find_file(_lib.SELFREG_NAME) or _lib.SELFREG_NAME
        poly = ["polygraphy", "convert", str(plan.source), "-o", str(plan.output), "--strongly-typed",
                "--plugins", str(selfreg), "--profiling-verbosity", "DETAILED"]
        for flag, k in (("--trt-min-shapes", 0), ("--trt-opt-shapes", 1), ("--trt-max-shapes", 2)):
            poly += [flag] + [f"{name}:[{','.join(map(str, s[k]))}]" for name, s in plan.shapes.items()]
        if plan.options.timing_cache:
            poly += ["--load-timing-cache", str(plan.options.timing_cache), "--save-timing-cache",
                     str(plan.options.timing_cache)]
        if plan.options.serialize_plugins:
            poly.append("--version-compatible")
        commands.append(" ".join(poly))
    return commands


# ---- CLI ----------------------------------------------------------------------------------------------
def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    d = BuildLimits()
    parser.add_argument("rewritten", help="rewritten ONNX (pagedkv rewrite output, fp16 or bf16: --dtype)")
    parser.add_argument("-o", "--output", required=True, help="engine file to write")
    parser.add_argument("--builder", choices=trt_library.BUILDER_CHOICES, default="auto",
                        help="tensorrt (builds on a GPU), tensorrt_rtx (builds without one) or auto: TensorRT when "
                             "installed, else TensorRT-RTX")
    limits = parser.add_argument_group("limits the engine serves (they size the optimization profile)")
    limits.add_argument("--max-batch", type=int, default=d.max_batch, help=f"sequences per step (default {d.max_batch})")
    limits.add_argument("--max-tokens", type=int, default=d.max_tokens,
                        help=f"new tokens per step, all sequences (default {d.max_tokens})")
    limits.add_argument("--max-context", type=int, default=d.max_context,
                        help=f"tokens a sequence holds (default {d.max_context}); sizes the block tables")
    limits.add_argument("--opt-batch", type=int, default=None, help="tuned for (default --max-batch)")
    limits.add_argument("--opt-tokens", type=int, default=None, help="tuned for (default --opt-batch: a decode step)")
    limits.add_argument("--opt-context", type=int, default=None, help="tuned for (default --max-context)")
    parser.add_argument("--compute-capability", default=None, metavar="CC[,CC...]",
                        help="TensorRT-RTX targets, e.g. 80,86,89,120 (default: TensorRT-RTX's own, those the plugin "
                             "library runs on)")
    parser.add_argument("--timing-cache", default=None, metavar="FILE", help="read when present, updated after the build")
    parser.add_argument("--serialize-plugins", action="store_true",
                        help="embed the plugin library in a version-compatible engine (TensorRT)")
    parser.add_argument("--workspace-mib", type=int, default=None, help="workspace memory pool limit")
    parser.add_argument("--plugins", default=None, help="plugin library (default: the installed one)")
    parser.add_argument("--json", action="store_true", help="print the build report as JSON")


def options_from_args(args) -> tuple[BuildLimits, BuildOptions]:
    from pagedkv.userio import parse_int_list

    limits = BuildLimits(args.max_batch, args.max_tokens, args.max_context, args.opt_batch, args.opt_tokens,
                         args.opt_context)
    ccs = tuple(parse_int_list("compute-capability", args.compute_capability, low=10)) if args.compute_capability \
        else None
    return limits, BuildOptions(args.builder, ccs, args.timing_cache, args.serialize_plugins, args.workspace_mib,
                                args.plugins)


def run_build(args) -> int:
    from pagedkv.userio import print_json

    limits, options = options_from_args(args)
    plan = preflight(args.rewritten, args.output, limits, options)
    result = build(plan, quiet=args.quiet or args.json)
    if args.json:
        print_json(result)
        return 0
    for note in result.notes:
        print(f"note: {note}")
    print(f"built {result.engine} ({result.engine_bytes} bytes) with {plan.flavour.title} {result.version} in "
          f"{result.seconds:g} s; targets: {', '.join(result.targets)}")
    print("profile (min / opt / max):")
    for name, (lo, opt, hi) in plan.shapes.items():
        print(f"  {name:<16} {list(lo)} / {list(opt)} / {list(hi)}")
    if result.timing_cache:
        print(f"timing cache: {result.timing_cache}")
    print("equivalent command line(s):")
    for cmd in result.commands:
        print(f"  {cmd}")
    return 0
