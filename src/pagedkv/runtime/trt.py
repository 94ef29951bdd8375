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

Host views of the tensors take their numpy dtype from ``pagedkv.trt_library.numpy_dtype`` (bfloat16 and fp8
included, which ``trt.nptype`` lacks). A loaded engine's I/O and profile are checked against the engine-I/O
contract (``pagedkv.engine_io.check_engine_io``, as ``pagedkv inspect`` does) and against the rewritten graph's
tensors. The engine's own optimization profile bounds every step: each input's shape
is checked against the profile's (min, max) before anything is copied, and a too-large step fails naming the
input, the dim and the ``pagedkv build`` limit to raise.

The flavour that runs the engine is the one its build record names (``pagedkv.builder.engine_record``), else
TensorRT when installed, else TensorRT-RTX; the plugin library is registered with
``pagedkv.trt_library.load_plugin_library`` (``IPluginRegistry.load_library``: TensorRT calls the library's
``getCreators``), as the builder does. TensorRT-RTX runs engines only on the compute capabilities it supports,
not 9.0 (measured on an H200: "TensorRT-RTX does not support this compute capability"); ``why_no_engine_runtime``
says so before anything is built. Everything here imports TensorRT lazily; the ``trt`` tests run it on a machine
that can.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np

from pagedkv import engine_io, trt_library
from pagedkv.runtime.backends import BackendUnavailable
from pagedkv.runtime.executor import Executor, StepInputs, StepOutputs, pad_decode_step

ALIGN = 256  # bytes between tensors of an arena


def why_no_engine_runtime(flavour: trt_library.Flavour | None = None) -> str | None:
    """None when an engine can run here (a flavour installed, a GPU it supports), else the reason."""
    from pagedkv import cuda

    try:
        f = flavour or trt_library.flavour("auto")
    except trt_library.TensorRTUnavailable as exc:
        return str(exc)
    reason = trt_library.why_unavailable(f)
    if reason:
        return reason
    no_gpu = cuda.why_no_gpu()
    if no_gpu:
        return f"{f.title} runs engines on a GPU: {no_gpu}"
    cc = cuda.compute_capability()
    runs_on = [f"{c // 10}.{c % 10}" for c in trt_library.RTX_COMPUTE_CAPABILITIES]
    if f is trt_library.TENSORRT_RTX and cc not in runs_on:
        return (f"TensorRT-RTX does not run engines on compute capability {cc} (it runs on {', '.join(runs_on)}); "
                "TensorRT (pip install tensorrt) does")
    return None


def check_available(flavour: trt_library.Flavour | None = None) -> None:
    """Raise ``BackendUnavailable`` (``TensorRTUnavailable`` without TensorRT) when an engine cannot run here."""
    reason = why_no_engine_runtime(flavour)
    if reason:
        if flavour is None and not trt_library.installed():
            raise trt_library.TensorRTUnavailable(reason)
        raise BackendUnavailable(f"trt backend unavailable: {reason}")


def _engine_flavour(data: bytes) -> trt_library.Flavour | None:
    from pagedkv.builder.engine_record import read_record

    record = read_record(data).record
    return trt_library.FLAVOURS.get(record["builder"]["flavour"]) if record else None


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
        data = Path(engine).read_bytes()
        flavour = _engine_flavour(data)
        check_available(flavour)
        trt = trt_library.import_flavour(flavour or trt_library.flavour("auto"))
        self._trt = trt
        self.graph = RewrittenGraph.load(rewritten)
        trt_library.load_plugin_library(trt, plugin_library)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(data)
        if self.engine is None:
            raise RuntimeError(f"{trt_library.flavour_of(trt).title} could not deserialize {engine}"
                               + trt_library.with_plugin_messages(plugin_library))
        tensors, self.profile = trt_library.engine_tensors(trt, self.engine)
        problems = engine_io.check_engine_io(tensors, self.profile)
        if problems:
            raise GraphError(f"engine {engine}: its I/O breaks the engine-I/O contract (pagedkv.engine_io): "
                             + "; ".join(problems))
        names = [name for name, _, _, _ in tensors]
        expected = set(self.graph.input_names) | set(self.graph.output_names)
        if set(names) != expected:
            raise GraphError(f"engine {engine}: its tensors {sorted(set(names) ^ expected)} differ from the rewritten "
                             "graph's (was it built from this graph?)")
        self.context = self.engine.create_execution_context()
        self._inputs = [name for name, is_input, _, _ in tensors if is_input]
        self._dtype = {n: trt_library.numpy_dtype(trt, self.engine.get_tensor_dtype(n)) for n in names}
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
        return self.profile[name][2]

    def _check_profile(self, name: str, shape: tuple) -> None:
        """A ValueError naming the input, the dim and the ``pagedkv build`` limit that bounds it when ``shape`` is
        outside the engine's profile (TensorRT would only log that ``set_input_shape`` failed)."""
        from pagedkv.builder.build import DIM_LIMITS

        lo, _, hi = self.profile[name]
        if len(shape) == len(lo) and all(a <= d <= b for d, a, b in zip(shape, lo, hi)):
            return
        spec = engine_io.spec_of(name)
        dims = spec[0].shape if spec is not None and len(spec[0].shape) == len(shape) == len(lo) else ()
        dim = next((d for d, n, a, b in zip(dims, shape, lo, hi) if not a <= n <= b), None)
        fix = (f" (dim {dim}): rebuild the engine with a larger {DIM_LIMITS[dim]}" if dim in DIM_LIMITS
               else ": the graph fixes it")
        raise ValueError(f"{name}: this step's shape {list(shape)} is outside the engine's profile "
                         f"{list(lo)}..{list(hi)}{fix}")

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
            self._check_profile(name, array.shape)
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
                raise RuntimeError(f"{trt_library.flavour_of(self._trt).title} execute_async_v3 failed (see its log)"
                                   + trt_library.with_plugin_messages())
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
