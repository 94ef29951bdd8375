"""A TensorRT engine of a rewritten graph, run step by step (``TrtSession``; ``compare --backend trt``).

The KV manager owns device pools (``storage="device"``) and gives block tables; engine inputs and outputs are
cuda-python ``DeviceBuffer``s bound by address with ``IExecutionContext.set_tensor_address`` and run with
``execute_async_v3`` on the manager's stream, so a copy-on-write the manager enqueued lands before the step's
writes. After each step every ``kv_write_status_{i}`` is checked (``pagedkv.step.raise_for_status``).

The plugin library is registered with ``IPluginRegistry.load_library`` (``load_plugin_library``: TensorRT
calls the library's ``getCreators``); the builder (``pagedkv.builder.build``) uses the same function before it
parses a graph.

TensorRT is not installable in this workplace: everything here imports it lazily and says
"TensorRT not available" with the reason when it is missing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from pagedkv.runtime.backends import BackendUnavailable
from pagedkv.runtime.session import ManagedKVSession


class TensorRTUnavailable(BackendUnavailable):
    pass


def why_no_tensorrt() -> str | None:
    if importlib.util.find_spec("tensorrt") is None:
        return "TensorRT not available: the `tensorrt` Python package is not installed"
    return None


def import_tensorrt():
    """The ``tensorrt`` module, or ``TensorRTUnavailable`` saying why not."""
    reason = why_no_tensorrt()
    if reason:
        raise TensorRTUnavailable(reason)
    import tensorrt

    return tensorrt


def check_available() -> None:
    """Raise ``BackendUnavailable`` (``TensorRTUnavailable`` without TensorRT) when an engine cannot run here."""
    from pagedkv import cuda

    import_tensorrt()
    reason = cuda.why_no_gpu()
    if reason:
        raise BackendUnavailable(f"trt backend unavailable: {reason}")


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


class TrtSession(ManagedKVSession):
    """A TensorRT engine of a rewritten graph, with the same ``step`` API as ``PagedSession``.

    Args:
        rewritten: the rewritten ONNX (path or ModelProto) the engine was built from: its plugin attributes
            give the pool groups.
        engine: the serialized engine's path (``pagedkv build`` / ``pagedkv.builder.build.build_engine``).
        num_blocks: blocks per pool group.
        plugin_library: the plugin library (default: the installed one).
    """

    def __init__(self, rewritten, *, engine: str | Path, num_blocks=512, plugin_library=None):
        from pagedkv import cuda
        from pagedkv.kvcache.manager import KVCacheManager
        from pagedkv.runtime.graph import RewrittenGraph

        check_available()
        trt = import_tensorrt()
        self._trt = trt
        self.graph = RewrittenGraph.load(rewritten)
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
        for name in (self.graph.logits, *self.graph.status_outputs):
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
            self._check_statuses([host[name] for name in self.graph.status_outputs], batch)
        return self._commit_step(entries, batch, host[self.graph.logits].astype(np.float32))

    def close(self) -> None:
        for buf in self._buffers.values():
            buf.close()
        self._buffers = {}
        super().close()  # the KV manager
        self.context = self.engine = None
