"""Build a TensorRT engine from a rewritten graph.

    pagedkv build rewritten.onnx -o model.engine [--max-tokens 4096 --max-seqs 64 --max-blocks 256]

Plugins: the library is registered with ``pagedkv.runtime.trt.load_plugin_library`` (the documented
``IPluginRegistry.load_library``: TensorRT calls the library's ``getCreators``), then polygraphy's loaders parse
and build: ``NetworkFromOnnxPath(..., strongly_typed=True)`` (TensorRT 11 requires strong typing; on 10 it
keeps the graph's own precisions, which is what a rewritten float16 graph wants) and
``EngineBytesFromNetwork(network, CreateConfig(profiles=[...]))``. polygraphy's own ``LoadPlugins`` only
``dlopen``s a library, which relies on the library's self-registration; ``load_library`` does not.

Optimization profile (one): every dynamic engine input (``pagedkv.engine_io``) gets (min, opt, max) from
``ProfileSpec``: T tokens of a step, B sequences, MB block-table columns, R logits rows (up to T: ``compare``
asks for every row) and W penalty tokens per row; ``kv_pools`` is static [num_pool_groups, 4]. The engine runs
in ``pagedkv.runtime.trt.TrtExecutor``.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from pagedkv import engine_io
from pagedkv.runtime.trt import import_tensorrt, load_plugin_library, why_no_tensorrt


@dataclass(frozen=True)
class ProfileSpec:
    """(min, opt, max) of the step dimensions; see the module docstring."""

    max_tokens: int = 4096
    opt_tokens: int = 256
    max_seqs: int = 64
    opt_seqs: int = 8
    max_blocks: int = 256  # block-table columns (MB) per sequence
    opt_blocks: int = 32
    max_penalty_tokens: int = 4096  # W: distinct prompt + output tokens a penalized row may carry
    opt_penalty_tokens: int = 1

    def __post_init__(self):
        for name in FIELDS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for opt, mx in (("opt_tokens", "max_tokens"), ("opt_seqs", "max_seqs"), ("opt_blocks", "max_blocks"),
                        ("opt_penalty_tokens", "max_penalty_tokens")):
            if getattr(self, opt) > getattr(self, mx):
                raise ValueError(f"{opt}={getattr(self, opt)} exceeds {mx}={getattr(self, mx)}")

    def bounds(self, num_pool_groups: int) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """(min, opt, max) values of ``pagedkv.engine_io``'s symbolic dims."""
        static = {engine_io.NUM_POOL_GROUPS: num_pool_groups}
        return ({engine_io.NUM_TOKENS: 1, engine_io.BATCH: 1, engine_io.BATCH_PLUS_1: 2, engine_io.MAX_BLOCKS: 1,
                 engine_io.NUM_LOGITS: 1, engine_io.PENALTY_WIDTH: 1, **static},
                {engine_io.NUM_TOKENS: self.opt_tokens, engine_io.BATCH: self.opt_seqs,
                 engine_io.BATCH_PLUS_1: self.opt_seqs + 1, engine_io.MAX_BLOCKS: self.opt_blocks,
                 engine_io.NUM_LOGITS: self.opt_seqs, engine_io.PENALTY_WIDTH: self.opt_penalty_tokens, **static},
                {engine_io.NUM_TOKENS: self.max_tokens, engine_io.BATCH: self.max_seqs,
                 engine_io.BATCH_PLUS_1: self.max_seqs + 1, engine_io.MAX_BLOCKS: self.max_blocks,
                 engine_io.NUM_LOGITS: self.max_tokens, engine_io.PENALTY_WIDTH: self.max_penalty_tokens, **static})

    def shapes(self, graph) -> dict[str, tuple[tuple, tuple, tuple]]:
        """Per engine input of a ``RewrittenGraph``: (min, opt, max) shapes."""
        bounds = self.bounds(graph.num_groups)
        inputs = engine_io.engine_inputs(graph.num_groups, graph.explicit_positions, graph.sampling)
        out = {name: tuple(engine_io.resolve_shape(spec, dims) for dims in bounds) for name, spec in inputs}
        unknown = [n for n in graph.input_names if n not in out]
        if unknown:
            raise ValueError(f"engine inputs {unknown} are not in the engine I/O contract (pagedkv.engine_io); cannot size a profile")
        return out


FIELDS = tuple(f.name for f in dataclasses.fields(ProfileSpec))


def build_engine(onnx_path: str | Path, engine_path: str | Path, *, profile: ProfileSpec = ProfileSpec(),
                 plugin_library: str | Path | None = None, workspace_bytes: int | None = None) -> Path:
    """Parse the rewritten ONNX with our plugins, build a strongly typed engine, save it. A graph whose plugin
    activations the plugins do not take (float32: a rewrite without ``--dtype``) is refused first, naming the fix
    (TensorRT would say "Failed to find any supported plugin/custom tactic format")."""
    from pagedkv.config import SUPPORTED_IO_DTYPES
    from pagedkv.runtime.graph import RewrittenGraph

    graph = RewrittenGraph.load(str(onnx_path))
    io_dtypes = sorted({layer.io_dtype for layer in graph.layers} - set(SUPPORTED_IO_DTYPES))
    if io_dtypes:
        raise ValueError(f"{onnx_path}: the plugin activations are {', '.join(io_dtypes)}; the plugins take "
                         f"{' or '.join(SUPPORTED_IO_DTYPES)}: rewrite with --dtype fp16|bf16")
    trt = import_tensorrt()
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, NetworkFromOnnxPath, Profile

    load_plugin_library(trt, plugin_library)
    prof = Profile()
    for name, (lo, opt, hi) in profile.shapes(graph).items():
        prof.add(name, min=lo, opt=opt, max=hi)
    pools = {trt.MemoryPoolType.WORKSPACE: int(workspace_bytes)} if workspace_bytes else None
    network = NetworkFromOnnxPath(str(onnx_path), strongly_typed=True)
    serialized = EngineBytesFromNetwork(network, config=CreateConfig(profiles=[prof], memory_pool_limits=pools))()
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path}")
    engine_path = Path(engine_path)
    engine_path.write_bytes(bytes(serialized))
    return engine_path


# ---- CLI ----------------------------------------------------------------------------------------------
def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rewritten", help="rewritten ONNX (pagedkv rewrite output)")
    parser.add_argument("-o", "--output", required=True, help="engine file to write")
    parser.add_argument("--plugins", default=None, help="plugin library (default: the installed one)")
    parser.add_argument("--workspace-mib", type=int, default=None)
    defaults = ProfileSpec()
    for name in FIELDS:
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))


def run_build(args) -> int:
    reason = why_no_tensorrt()
    if reason:
        print(f"pagedkv build: {reason}. Engines need TensorRT >= 10 (pip install tensorrt on a machine with "
              "a GPU); the rewritten graph can still be checked with `pagedkv compare`.")
        return 2
    profile = ProfileSpec(**{k: getattr(args, k) for k in FIELDS})
    ws = args.workspace_mib * 2**20 if args.workspace_mib else None
    path = build_engine(args.rewritten, args.output, profile=profile, plugin_library=args.plugins,
                        workspace_bytes=ws)
    print(f"wrote {path}")
    return 0
