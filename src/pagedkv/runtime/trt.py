"""A TensorRT engine of a rewritten graph, run step by step (``TrtSession``; ``compare --backend trt``).

The KV manager owns device pools (``storage="device"``) and gives block tables; engine inputs and outputs are
cuda-python ``DeviceBuffer``s bound by address with ``IExecutionContext.set_tensor_address`` and run with
``execute_async_v3`` on the manager's stream, so a copy-on-write the manager enqueued lands before the step's
writes. Host views of the tensors take their numpy dtype from ``pagedkv.trt_library.numpy_dtype`` (bfloat16 and
fp8 included, which ``trt.nptype`` lacks). After each step every ``kv_write_status_{i}`` is checked
(``pagedkv.step.raise_for_status``).

The engine's own optimization profile bounds every step: before a step runs, each input's shape is checked against
the profile's (min, max) and a too-large step fails naming the input and the ``pagedkv build`` limit to raise;
block tables narrower than the profile's minimum width (a static ``--max-blocks``) are padded with -1 columns.

The flavour that runs the engine is the one its build record names (``pagedkv.builder.engine_record``), else
TensorRT when installed, else TensorRT-RTX. TensorRT-RTX runs engines only on the compute capabilities it supports,
not 9.0 (measured on an H200: "TensorRT-RTX does not support this compute capability"); ``why_no_engine_runtime``
says so before anything is built.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pagedkv import trt_library
from pagedkv.runtime.backends import BackendUnavailable
from pagedkv.runtime.session import ManagedKVSession

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
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.profile = {n: tuple(tuple(s) for s in self.engine.get_tensor_profile_shape(n, 0)) for n in names
                        if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT}
        self.dtypes = {n: trt_library.numpy_dtype(trt, self.engine.get_tensor_dtype(n)) for n in names}
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

    def _fit_to_profile(self, name: str, array: np.ndarray) -> np.ndarray:
        """``array`` as the engine's profile takes it: a block table padded with -1 columns up to the minimum
        width; any shape outside (min, max) is a ValueError naming the input, its profile and the limit."""
        from pagedkv import engine_io
        from pagedkv.layout import INVALID_BLOCK

        lo, _, hi = self.profile[name]
        if name.startswith(engine_io.SPECS[engine_io.BLOCK_TABLE].prefix) and array.shape[1] < lo[1]:
            pad = np.full((array.shape[0], lo[1] - array.shape[1]), INVALID_BLOCK, array.dtype)
            array = np.concatenate([array, pad], axis=1)
        if len(array.shape) != len(lo) or any(not a <= d <= b for d, a, b in zip(array.shape, lo, hi)):
            limit = {engine_io.INPUT_IDS: "--max-tokens", engine_io.POSITION_IDS: "--max-tokens",
                     engine_io.CU_Q_LENS: "--max-batch", engine_io.PAST_LENS: "--max-batch"}.get(
                name, "--max-context / --max-batch" if name.startswith("block_table") else "the graph")
            raise ValueError(f"{name}: this step's shape {list(array.shape)} is outside the engine's profile "
                             f"{list(lo)}..{list(hi)}; rebuild the engine with a larger {limit}")
        return array

    def step(self, entries) -> list[np.ndarray]:
        ctx = self.context
        batch, feed = self._begin_step(entries, self.manager.kv_pools)
        try:
            feed = {name: self._fit_to_profile(name, np.ascontiguousarray(a, dtype=self.dtypes[name]))
                    for name, a in feed.items()}
        except ValueError:
            self._unreserve(entries)
            raise
        for name, array in feed.items():  # `feed` keeps each host source alive until the stream is synchronized
            buf = self._buffer(name, array.nbytes)
            buf.upload(array, self.stream)
            ctx.set_input_shape(name, array.shape)
            ctx.set_tensor_address(name, buf.ptr)
        outputs = {}
        for name in (self.graph.logits, *self.graph.status_outputs):
            shape = tuple(ctx.get_tensor_shape(name))
            dtype = self.dtypes[name]
            buf = self._buffer(name, int(np.prod(shape)) * dtype.itemsize)
            ctx.set_tensor_address(name, buf.ptr)
            outputs[name] = (shape, dtype, buf)
        if not ctx.execute_async_v3(self.stream.handle):
            self._unreserve(entries)
            raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log)"
                               + trt_library.with_plugin_messages())
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
