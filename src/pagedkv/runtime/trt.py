"""A TensorRT engine of a rewritten graph as an executor (``TrtExecutor``; ``compare --backend trt``).

The KV manager owns device pools (``storage="device"``); ``kv_pools`` is uploaded once and bound by address.
Every other engine input has a fixed place in one device arena, sized from the engine's optimization profile
(its max shapes), mirrored by a pinned staging arena: a step packs its inputs into the staging arena at those
offsets and sends them with one ``cudaMemcpyAsync``; the sampling outputs and the ``kv_write_status_{i}``
records live in one output arena that comes back with one copy; logits (only when asked for) in their own
buffer. Tensors are bound by their ``pagedkv.engine_io`` names with ``set_input_shape`` /
``set_tensor_address`` and run with ``execute_async_v3`` on the manager's stream, so a copy-on-write the
manager enqueued lands before the step's writes.

CUDA graphs: because no address ever changes, a decode step (one token and one logits row per sequence) is
padded to a bucket of sequences and block-table columns (``pad_decode_step``; padding rows write into a block
the executor holds) and, the first time a bucket is seen, ``execute_async_v3`` runs once (TensorRT updates its
state after a shape change), is captured (``cudaStreamBeginCapture`` / ``cudaStreamEndCapture``) and
instantiated; later steps of that bucket only upload their inputs and ``cudaGraphLaunch`` it. Prefill and mixed
steps run eagerly. The plugins launch kernels only (no allocation, no synchronization), so they capture.

The plugin library is registered with ``IPluginRegistry.load_library`` (``load_plugin_library``: TensorRT calls
the library's ``getCreators``); the builder (``pagedkv.builder.build``) uses the same function before it parses
a graph. TensorRT is not installable in this workplace: everything here imports it lazily and says "TensorRT
not available" with the reason when it is missing; the ``trt`` tests run it on a machine that has it.
"""

from __future__ import annotations

import importlib.util
from collections import OrderedDict
from pathlib import Path

import numpy as np

from pagedkv import engine_io
from pagedkv.runtime.backends import BackendUnavailable
from pagedkv.runtime.executor import Executor, StepInputs, StepOutputs, pad_decode_step

ALIGN = 256  # bytes between tensors of an arena


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


def _numpy_dtype(trt, dtype) -> np.dtype:
    """numpy dtype of a TensorRT tensor dtype (``trt.nptype`` has no bfloat16)."""
    if dtype == trt.DataType.BF16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(trt.nptype(dtype))


def _bucket(n: int, cap: int) -> int:
    """The next power of two >= n, at most ``cap`` (and at least n)."""
    return max(n, min(cap, 1 << max(0, int(n - 1).bit_length())))


class _Arena:
    """Fixed offsets of named tensors in one device buffer (+ a pinned mirror): ``place`` each at its max size."""

    def __init__(self):
        self.offsets: dict[str, int] = {}
        self.capacity: dict[str, int] = {}
        self.size = 0
        self.device = self.pinned = None

    def place(self, name: str, nbytes: int) -> None:
        self.offsets[name] = self.size
        self.capacity[name] = nbytes
        self.size += -(-max(nbytes, 1) // ALIGN) * ALIGN

    def allocate(self) -> None:
        from pagedkv import cuda

        self.device = cuda.DeviceBuffer(self.size)
        self.pinned = cuda.PinnedBuffer(self.size)

    def address(self, name: str) -> int:
        return self.device.ptr + self.offsets[name]

    def put(self, name: str, array: np.ndarray) -> int:
        """Copy ``array`` into the pinned mirror at the tensor's offset; returns the end of its bytes."""
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if raw.size > self.capacity[name]:
            raise ValueError(f"{name}: {raw.size} bytes exceed the engine profile's maximum "
                             f"({self.capacity[name]} bytes); rebuild the engine with larger limits")
        start = self.offsets[name]
        self.pinned.view()[start:start + raw.size] = raw
        return start + raw.size

    def get(self, name: str, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        return self.pinned.view(dtype, shape, offset=self.offsets[name]).copy()

    def close(self) -> None:
        for buf in (self.device, self.pinned):
            if buf is not None:
                buf.close()
        self.device = self.pinned = None


class TrtExecutor(Executor):
    """A TensorRT engine of a rewritten graph (module docstring).

    Args:
        rewritten: the rewritten ONNX (path or ModelProto) the engine was built from: its plugin attributes
            give the pool groups, its outputs the heads.
        engine: the serialized engine's path (``pagedkv build`` / ``pagedkv.builder.build.build_engine``).
        num_blocks: blocks per pool group.
        plugin_library: the plugin library (default: the installed one).
        manager_kwargs: extra ``KVCacheManager`` arguments.
        cuda_graphs: capture and replay decode steps (module docstring).
        max_graphs: captured buckets kept (least recently used are released).
    """

    name = "trt"

    def __init__(self, rewritten, *, engine: str | Path, num_blocks=512, plugin_library=None,
                 manager_kwargs: dict | None = None, cuda_graphs: bool = True, max_graphs: int = 32):
        from pagedkv.kvcache.manager import KVCacheManager
        from pagedkv.runtime.graph import GraphError, RewrittenGraph

        self._graphs: OrderedDict = OrderedDict()  # bucket key -> (graph, graph exec)
        self._graph_key = None  # the bucket of the step being run (None: eager)
        self._in, self._out, self._logits = _Arena(), _Arena(), None
        self.stream = self.context = self.engine = None
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
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        expected = set(self.graph.input_names) | set(self.graph.output_names)
        if set(names) != expected:
            raise GraphError(f"engine {engine}: its tensors {sorted(set(names) ^ expected)} differ from the rewritten "
                             "graph's (was it built from this graph?)")
        self.context = self.engine.create_execution_context()
        self._inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self._dtype = {n: _numpy_dtype(trt, self.engine.get_tensor_dtype(n)) for n in names}
        self.cuda_graphs, self.max_graphs = bool(cuda_graphs), int(max_graphs)
        self.manager = KVCacheManager(self.graph.groups, num_blocks, storage="device", **(manager_kwargs or {}))
        try:
            self.stream = self.manager.stream
            self._max = {n: self._max_shape(n) for n in self._inputs}
            for n in self._inputs:
                if n != engine_io.KV_POOLS:
                    self._in.place(n, int(np.prod(self._max[n])) * self._dtype[n].itemsize)
            rows = self._max[engine_io.LOGITS_ROWS][0]
            top = self.graph.num_top_logprobs
            self._out_shapes = {engine_io.NEXT_TOKENS: (rows,), engine_io.NEXT_LOGPROBS: (rows,),
                                engine_io.TOP_TOKENS: (rows, top), engine_io.TOP_LOGPROBS: (rows, top)}
            if not self.graph.sampling:
                self._out_shapes = {}
            self._out_shapes.update({s: (engine_io.SPECS[engine_io.KV_WRITE_STATUS].shape[0],)
                                     for s in self.graph.status_outputs})
            for n, shape in self._out_shapes.items():
                self._out.place(n, int(np.prod(shape)) * self._dtype[n].itemsize)
            self._in.allocate()
            self._out.allocate()
            self.context.set_tensor_address(engine_io.KV_POOLS, self.manager.kv_pools_device().ptr)
            for n in self._in.offsets:
                self.context.set_tensor_address(n, self._in.address(n))
            for n in self._out.offsets:
                self.context.set_tensor_address(n, self._out.address(n))
        except BaseException:
            self.close()
            raise

    def kv_pools(self) -> np.ndarray:
        return self.manager.kv_pools()

    def _max_shape(self, name: str) -> tuple:
        """An input's largest shape: the optimization profile's max for dynamic dims, else its static shape."""
        shape = tuple(self.engine.get_tensor_shape(name))
        if all(d >= 0 for d in shape):
            return shape
        return tuple(self.engine.get_tensor_profile_shape(name, 0)[2])

    # ---- steps -----------------------------------------------------------------------------------------
    def execute(self, inputs: StepInputs) -> StepOutputs:
        B = inputs.batch.num_seqs
        decode = (self.cuda_graphs and inputs.sampling is not None and not inputs.want_logits and B
                  and inputs.batch.num_tokens == B and len(inputs.logits_rows) == B)
        if not decode:
            self._graph_key = None
            return super().execute(inputs)
        max_batch = self._max[engine_io.PAST_LENS][0]
        pad_rows = self.pad_blocks(max_batch)
        width = max(max(inputs.batch.meta(g).max_blocks, pad_rows[g].size) for g in range(self.graph.num_groups))
        cols = self.graph.max_blocks or _bucket(width, self._max[engine_io.block_table_name(0)][1])
        padded = pad_decode_step(inputs, batch=_bucket(B, max_batch), width=cols, pad_rows=pad_rows)
        self._graph_key = (padded.batch.num_seqs, cols, padded.sampling.penalty_tokens.shape[1])
        out = super().execute(padded)
        return StepOutputs(None, out.next_tokens[:B], out.next_logprobs[:B], out.top_tokens[:B], out.top_logprobs[:B])

    def _logits_buffer(self, nbytes: int) -> int:
        from pagedkv import cuda

        if self._logits is None or self._logits.nbytes < nbytes:
            if self._logits is not None:
                self._logits.close()
            self._logits = cuda.DeviceBuffer(nbytes)
            self._release_graphs()  # captured graphs hold the old address
        return self._logits.ptr

    def _run(self, feed, outputs):
        from pagedkv import cuda

        rt, ctx = cuda._rt(), self.context
        extent = 0
        for name, array in feed.items():
            if name == engine_io.KV_POOLS:
                continue
            array = np.asarray(array, dtype=self._dtype[name])
            extent = max(extent, self._in.put(name, array))
            ctx.set_input_shape(name, array.shape)
        cuda.check(rt.cudaMemcpyAsync(self._in.device.ptr, self._in.pinned.ptr, extent,
                                      rt.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream.raw), "upload step inputs")
        rows = len(feed[engine_io.LOGITS_ROWS])
        logits_dtype = self._dtype[engine_io.LOGITS]
        ctx.set_tensor_address(engine_io.LOGITS, self._logits_buffer(rows * self.graph.vocab * logits_dtype.itemsize))
        key = self._graph_key
        if key is not None and key in self._graphs:
            self._graphs.move_to_end(key)
            cuda.check(rt.cudaGraphLaunch(self._graphs[key][1], self.stream.raw), "cudaGraphLaunch")
        else:
            if not ctx.execute_async_v3(self.stream.handle):
                raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log)")
            if key is not None:
                self._capture(key)
        cuda.check(rt.cudaMemcpyAsync(self._out.pinned.ptr, self._out.device.ptr, self._out.size,
                                      rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream.raw), "download outputs")
        got = {}
        if engine_io.LOGITS in outputs:
            logits = np.empty((rows, self.graph.vocab), dtype=logits_dtype)
            cuda.check(rt.cudaMemcpyAsync(logits.ctypes.data, self._logits.ptr, logits.nbytes,
                                          rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream.raw), "download logits")
            got[engine_io.LOGITS] = logits
        self.stream.synchronize()
        for name in outputs:
            if name in self._out_shapes:
                shape = self._out_shapes[name]
                shape = shape if name not in engine_io.SAMPLING_OUTPUTS else (rows, *shape[1:])
                got[name] = self._out.get(name, shape, self._dtype[name])
        return got

    def _capture(self, key) -> None:
        """Capture the step just run (its shapes are set and TensorRT has run them once) as a CUDA graph."""
        from pagedkv import cuda

        rt = cuda._rt()
        cuda.check(rt.cudaStreamBeginCapture(self.stream.raw, rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal),
                   "cudaStreamBeginCapture")
        ok = self.context.execute_async_v3(self.stream.handle)
        graph = cuda.check(rt.cudaStreamEndCapture(self.stream.raw), "cudaStreamEndCapture")
        if not ok:
            cuda.check(rt.cudaGraphDestroy(graph), "cudaGraphDestroy")
            raise RuntimeError("TensorRT execute_async_v3 failed while capturing a CUDA graph")
        instance = cuda.check(rt.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
        self._graphs[key] = (graph, instance)
        while len(self._graphs) > self.max_graphs:
            self._destroy(self._graphs.popitem(last=False)[1])

    def _destroy(self, pair) -> None:
        from pagedkv import cuda

        rt = cuda._rt()
        graph, instance = pair
        cuda.check(rt.cudaGraphExecDestroy(instance), "cudaGraphExecDestroy")
        cuda.check(rt.cudaGraphDestroy(graph), "cudaGraphDestroy")

    def _release_graphs(self) -> None:
        while self._graphs:
            self._destroy(self._graphs.popitem()[1])

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def close(self) -> None:
        if self.stream is not None and self.manager is not None:
            self.stream.synchronize()
        self._release_graphs()
        self._in.close()
        self._out.close()
        if self._logits is not None:
            self._logits.close()
            self._logits = None
        super().close()  # the KV manager (and its stream)
        self.context = self.engine = self.stream = None
