"""Build a TensorRT engine from a rewritten graph, and run it step by step (``compare --backend trt``).

    pagedkv build rewritten.onnx -o model.engine [--max-tokens 4096 --max-seqs 64 --max-blocks 256]

Plugins: the library is loaded with ``IPluginRegistry.load_library(pagedkv._lib.plugin_library_path())``
(the documented path: TensorRT calls the library's ``getCreators``), then polygraphy's loaders parse and
build: ``NetworkFromOnnxPath(..., strongly_typed=True)`` (TensorRT 11 requires strong typing; on 10 it
keeps the graph's own precisions, which is what a rewritten float16 graph wants) and
``EngineBytesFromNetwork(network, CreateConfig(profiles=[...]))``. polygraphy's own ``LoadPlugins`` only
``dlopen``s a library, which relies on the library's self-registration; ``load_library`` does not.

Optimization profile (one): every dynamic engine input gets (min, opt, max) from ``ProfileSpec``:
T tokens of a step (``input_ids`` [1, T], ``position_ids`` [T]), B sequences (``cu_q_lens`` [B+1],
``past_lens`` [B], ``block_table_{g}`` [B, MB]) and MB block-table columns. ``kv_pools`` is static
[num_pool_groups, 4].

Running (``TrtSession``): the KV manager owns device pools (``storage="device"``) and gives block tables;
engine inputs and outputs are cuda-python ``DeviceBuffer``s bound by address with
``IExecutionContext.set_tensor_address`` and run with ``execute_async_v3`` on the manager's stream, so a
copy-on-write the manager enqueued lands before the step's writes. After each step every
``kv_write_status_{i}`` is checked (``pagedkv.step.raise_for_status``).

TensorRT is not installable in this workplace: everything here imports it lazily and says
"TensorRT not available" with the reason when it is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedkv.builder.runtime.backends import BackendUnavailable
from pagedkv.builder.runtime.session import ManagedKVSession


class TensorRTUnavailable(BackendUnavailable):
    pass


def why_no_tensorrt() -> str | None:
    if importlib.util.find_spec("tensorrt") is None:
        return "TensorRT not available: the `tensorrt` Python package is not installed"
    return None


def _trt():
    reason = why_no_tensorrt()
    if reason:
        raise TensorRTUnavailable(reason)
    import tensorrt

    return tensorrt


def load_plugin_library(trt, library: str | Path | None = None) -> Path:
    """Register our creators with TensorRT's plugin registry (idempotent per process and path)."""
    from pagedkv import _lib

    path = Path(library) if library else _lib.plugin_library_path()
    key = str(path.resolve())
    if key not in _loaded_libraries:
        handle = trt.get_plugin_registry().load_library(key)
        if handle is None:
            raise RuntimeError(f"IPluginRegistry.load_library({key}) failed (see the TensorRT log above)")
        _loaded_libraries[key] = handle
    return path


_loaded_libraries: dict[str, object] = {}


@dataclass(frozen=True)
class ProfileSpec:
    """(min, opt, max) of the step dimensions; see the module docstring."""

    max_tokens: int = 4096
    opt_tokens: int = 256
    max_seqs: int = 64
    opt_seqs: int = 8
    max_blocks: int = 256  # block-table columns (MB) per sequence
    opt_blocks: int = 32

    def __post_init__(self):
        for name in ("max_tokens", "opt_tokens", "max_seqs", "opt_seqs", "max_blocks", "opt_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for opt, mx in (("opt_tokens", "max_tokens"), ("opt_seqs", "max_seqs"), ("opt_blocks", "max_blocks")):
            if getattr(self, opt) > getattr(self, mx):
                raise ValueError(f"{opt}={getattr(self, opt)} exceeds {mx}={getattr(self, mx)}")

    def shapes(self, graph) -> dict[str, tuple[tuple, tuple, tuple]]:
        """Per engine input of a ``RewrittenGraph``: (min, opt, max) shapes."""
        out = {
            "input_ids": ((1, 1), (1, self.opt_tokens), (1, self.max_tokens)),
            "kv_pools": ((graph.num_groups, 4),) * 3,
            "cu_q_lens": ((2,), (self.opt_seqs + 1,), (self.max_seqs + 1,)),
            "past_lens": ((1,), (self.opt_seqs,), (self.max_seqs,)),
        }
        for g in range(graph.num_groups):
            out[f"block_table_{g}"] = ((1, 1), (self.opt_seqs, self.opt_blocks), (self.max_seqs, self.max_blocks))
        if "position_ids" in graph.input_names:
            out["position_ids"] = ((1,), (self.opt_tokens,), (self.max_tokens,))
        unknown = [n for n in graph.input_names if n not in out]
        if unknown:
            raise ValueError(f"engine inputs {unknown} are not part of the plugin contract; cannot size a profile")
        return out


def build_engine(onnx_path: str | Path, engine_path: str | Path, *, profile: ProfileSpec = ProfileSpec(),
                 plugin_library: str | Path | None = None, workspace_bytes: int | None = None) -> Path:
    """Parse the rewritten ONNX with our plugins, build a strongly typed engine, save it."""
    trt = _trt()
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, NetworkFromOnnxPath, Profile

    from pagedkv.builder.runtime.graph import RewrittenGraph

    load_plugin_library(trt, plugin_library)
    graph = RewrittenGraph.load(str(onnx_path))
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


class TrtSession(ManagedKVSession):
    """A TensorRT engine of a rewritten graph, with the same ``step`` API as ``PagedSession``.

    Args:
        rewritten: the rewritten ONNX (path or ModelProto): its plugin attributes give the pool groups.
        engine: a serialized engine path; None builds one (into a temporary file) from ``rewritten``.
        num_blocks: blocks per pool group.
        profile: used when building.
    """

    def __init__(self, rewritten, *, engine: str | Path | None = None, num_blocks=512,
                 profile: ProfileSpec = ProfileSpec(), plugin_library=None):
        import tempfile

        import onnx

        from pagedkv import cuda
        from pagedkv.builder.runtime.graph import RewrittenGraph
        from pagedkv.kvcache.manager import KVCacheManager

        trt = _trt()
        reason = cuda.why_no_gpu()
        if reason:
            raise BackendUnavailable(f"trt backend unavailable: {reason}")
        self._trt = trt
        self._tmp = None
        if engine is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="pagedkv-trt-")
            src = rewritten
            if isinstance(rewritten, onnx.ModelProto):
                src = Path(self._tmp.name) / "rewritten.onnx"
                onnx.save(rewritten, str(src))
            engine = build_engine(src, Path(self._tmp.name) / "model.engine", profile=profile,
                                  plugin_library=plugin_library)
        self.graph = RewrittenGraph.load(rewritten if isinstance(rewritten, onnx.ModelProto) else str(rewritten))
        load_plugin_library(trt, plugin_library)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(Path(engine).read_bytes())
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not deserialize {engine}")
        self.context = self.engine.create_execution_context()
        self.manager = KVCacheManager(self.graph.groups, num_blocks, storage="device")
        self.stream = self.manager.stream
        self._buffers: dict[str, cuda.DeviceBuffer] = {}
        self._status_outputs = [f"kv_write_status_{layer.index}" for layer in self.graph.layers]

    def _buffer(self, name: str, nbytes: int):
        from pagedkv import cuda

        buf = self._buffers.get(name)
        if buf is None or buf.nbytes < nbytes:
            if buf is not None:
                buf.close()
            buf = cuda.DeviceBuffer(max(nbytes, 1))
            self._buffers[name] = buf
        return buf

    def step(self, entries) -> list[np.ndarray]:
        trt, ctx = self._trt, self.context
        batch, feed = self._begin_step(entries, self.manager.kv_pools)
        for name, array in feed.items():
            array = np.ascontiguousarray(array, dtype=trt.nptype(self.engine.get_tensor_dtype(name)))
            buf = self._buffer(name, array.nbytes)
            buf.upload(array, self.stream)
            feed[name] = array  # keep the host source alive until the stream is synchronized
            ctx.set_input_shape(name, array.shape)
            ctx.set_tensor_address(name, buf.ptr)
        outputs = {}
        for name in [self.graph.logits] + self._status_outputs:
            shape = tuple(ctx.get_tensor_shape(name))
            dtype = np.dtype(trt.nptype(self.engine.get_tensor_dtype(name)))
            buf = self._buffer(name, int(np.prod(shape)) * dtype.itemsize)
            ctx.set_tensor_address(name, buf.ptr)
            outputs[name] = (shape, dtype, buf)
        if not ctx.execute_async_v3(self.stream.handle):
            self._unreserve(entries)
            raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log)")
        host = {name: buf.download(shape, dtype, self.stream) for name, (shape, dtype, buf) in outputs.items()}
        with self._unreserve_on_error(entries):
            self._check_statuses(self._status_outputs, [host[name] for name in self._status_outputs], batch)
        return self._commit_step(entries, batch, host[self.graph.logits].astype(np.float32))

    def close(self) -> None:
        for buf in self._buffers.values():
            buf.close()
        self._buffers = {}
        super().close()  # the KV manager
        self.context = self.engine = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


# ---- CLI ----------------------------------------------------------------------------------------------
def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rewritten", help="rewritten ONNX (pagedkv rewrite output)")
    parser.add_argument("-o", "--output", required=True, help="engine file to write")
    parser.add_argument("--plugins", default=None, help="plugin library (default: the installed one)")
    parser.add_argument("--workspace-mib", type=int, default=None)
    defaults = ProfileSpec()
    for name in ("max_tokens", "opt_tokens", "max_seqs", "opt_seqs", "max_blocks", "opt_blocks"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))


def run_build(args) -> int:
    reason = why_no_tensorrt()
    if reason:
        print(f"pagedkv build: {reason}. Engines need TensorRT >= 10 (pip install tensorrt on a machine with "
              "a GPU); the rewritten graph can still be checked with `pagedkv compare`.")
        return 2
    profile = ProfileSpec(**{k: getattr(args, k) for k in ("max_tokens", "opt_tokens", "max_seqs", "opt_seqs",
                                                           "max_blocks", "opt_blocks")})
    ws = args.workspace_mib * 2**20 if args.workspace_mib else None
    path = build_engine(args.rewritten, args.output, profile=profile, plugin_library=args.plugins,
                        workspace_bytes=ws)
    print(f"wrote {path}")
    return 0
