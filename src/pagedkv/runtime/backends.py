"""Backends of the plugin ops: where the pools live and what computes the two plugins.

``ReferenceBackend`` (CPU): pools are the KV manager's numpy pools (``storage="numpy"``), the ``kv_pools``
address column holds handles to them, and the ops are the float64 references
(``pagedkv.reference.write.qkv_write`` / ``pagedkv.reference.attention.paged_attention``).

``CudaBackend`` (GPU): pools are the KV manager's device pools (``storage="device"``), ``kv_pools`` holds
their real addresses, and the ops are the CUDA kernels through the C API (``pagedkv.kernels.write`` /
``pagedkv.kernels.attention``): ONNX Runtime hands the PyOp host arrays, the backend uploads them, runs
the kernel on the manager's stream and downloads the result — slow, but the kernels see exactly the
engine's inputs.

``CudaBackend.timer`` (None by default): a ``KernelTimer`` puts CUDA events around every kernel launch, so a
benchmark can tell the kernels' device time from the rest of a step (benchmarks/bench_serving.py).

Both report a failed write the way the plugin does: the ``kv_write_status`` record
(``pagedkv.step.STATUS_*``), which the session turns into ``KVWriteError`` via ``raise_for_status``.
"""

from __future__ import annotations

import contextlib

import numpy as np

from pagedkv.config import AttentionConfig, WriteConfig
from pagedkv.step import (STATUS_BLOCK_OUT_OF_RANGE, STATUS_ENTRY, STATUS_FIELDS, STATUS_FLAGS, STATUS_INVALID_BLOCK,
                          STATUS_PAGE_IN_SEQ, STATUS_PAST_BLOCK_TABLE, STATUS_SEQ, KVWriteError, StepMetadata)

from pagedkv.runtime import ops

BACKENDS = ("reference", "cuda")


class BackendUnavailable(RuntimeError):
    """The backend cannot run on this machine (no GPU, no TensorRT); the message says why."""


def check_backend_available(name: str) -> None:
    if name == "cuda":
        from pagedkv import cuda

        reason = cuda.why_no_gpu()
        if reason:
            raise BackendUnavailable(f"cuda backend unavailable: {reason}")
    elif name not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {name!r}")


def status_from_error(err: KVWriteError, max_blocks: int) -> np.ndarray:
    """The plugin's ``kv_write_status`` record for a write the reference refused."""
    from pagedkv.layout import INVALID_BLOCK

    status = np.zeros(STATUS_FIELDS, dtype=np.int32)
    if err.page_in_seq >= max_blocks:
        flag = STATUS_PAST_BLOCK_TABLE
    elif err.entry == INVALID_BLOCK:
        flag = STATUS_INVALID_BLOCK
    else:
        flag = STATUS_BLOCK_OUT_OF_RANGE
    status[STATUS_FLAGS] = flag
    status[STATUS_SEQ], status[STATUS_PAGE_IN_SEQ], status[STATUS_ENTRY] = err.seq, err.page_in_seq, err.entry
    return status


def _meta(block_table, cu_q_lens, past_lens, position_ids=None) -> StepMetadata:
    return StepMetadata(block_table=block_table, cu_q_lens=cu_q_lens, past_lens=past_lens, position_ids=position_ids)


class ReferenceBackend:
    """numpy pools + float64 references; ``manager`` must have ``storage="numpy"``."""

    name = "reference"
    storage = "numpy"

    def __init__(self, manager):
        from pagedkv.kvcache.metadata import pool_descriptors

        if manager.storage_kind != "numpy":
            raise ValueError(f"ReferenceBackend: the KV manager needs storage='numpy', has {manager.storage_kind!r}")
        self.manager = manager
        self._handles = [ops.register_host_pool(manager.pool(g)) for g in range(len(manager.groups))]
        self._kv_pools = pool_descriptors(self._handles, manager.num_blocks)

    def kv_pools(self) -> np.ndarray:
        return self._kv_pools

    def write(self, cfg: WriteConfig, qkv, kv_pools, block_table, cu_q_lens, past_lens, position_ids, bias):
        from pagedkv.reference.write import qkv_write

        meta = _meta(block_table, cu_q_lens, past_lens, position_ids)
        pool = ops.resolve_host_pool(kv_pools, cfg.pool.pool_index)
        width = cfg.num_q_heads * cfg.pool.head_dim
        try:
            q = qkv_write(qkv, bias, meta, pool, cfg)
        except KVWriteError as err:  # the plugin skips such tokens and raises the status; q is meaningless
            return np.full((meta.num_tokens, width), np.nan, dtype=qkv.dtype), status_from_error(err, meta.max_blocks)
        return q.reshape(meta.num_tokens, width).astype(qkv.dtype), np.zeros(STATUS_FIELDS, dtype=np.int32)

    def attention(self, cfg: AttentionConfig, q, kv_pools, block_table, cu_q_lens, past_lens, kv_write_status):
        from pagedkv.reference.attention import paged_attention

        meta = _meta(block_table, cu_q_lens, past_lens)
        pool = ops.resolve_host_pool(kv_pools, cfg.pool.pool_index)
        width = cfg.num_q_heads * cfg.pool.head_dim
        if int(kv_write_status[STATUS_FLAGS]):  # the write skipped tokens: the step fails, output is moot
            return np.full((meta.num_tokens, width), np.nan, dtype=q.dtype)
        out = paged_attention(q.reshape(meta.num_tokens, cfg.num_q_heads, cfg.pool.head_dim), meta, pool, cfg)
        return out.reshape(meta.num_tokens, width).astype(q.dtype)

    def close(self) -> None:
        for h in self._handles:
            ops.release_host_pool(h)
        self._handles = []


class KernelTimer:
    """Device time of the kernels a ``CudaBackend`` launches (set ``backend.timer``): CUDA events before and
    after each launch on the backend's stream; ``collect()`` adds them up (milliseconds and launches per
    kernel) once they completed."""

    def __init__(self):
        self.ms: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._pending: list = []

    @contextlib.contextmanager
    def around(self, name: str, stream):
        from pagedkv.cuda import Event

        start, end = Event(timing=True), Event(timing=True)
        start.record(stream)
        try:
            yield
        finally:
            end.record(stream)
            self._pending.append((name, start, end))

    def collect(self) -> dict[str, float]:
        """Milliseconds per kernel so far (waits for the launches still running)."""
        for name, start, end in self._pending:
            self.ms[name] = self.ms.get(name, 0.0) + start.elapsed_ms(end)
            self.calls[name] = self.calls.get(name, 0) + 1
            start.close()
            end.close()
        self._pending = []
        return dict(self.ms)


class CudaBackend:
    """Device pools + the CUDA kernels through the C API; ``manager`` must have ``storage="device"``.

    The float32 activations ONNX Runtime hands over are cast to the kernels' 16-bit io dtype (bf16 for a bf16
    cache, fp16 otherwise) and the results cast back; every call uploads its inputs into fresh device buffers,
    launches on the manager's stream (after any copy-on-write the manager enqueued there) and downloads.
    """

    name = "cuda"
    storage = "device"

    def __init__(self, manager):
        check_backend_available("cuda")
        if manager.storage_kind != "device":
            raise ValueError(f"CudaBackend: the KV manager needs storage='device', has {manager.storage_kind!r}")
        self.manager = manager
        self.stream = manager.stream
        self._kv_pools = manager.kv_pools()
        self._kv_pools_dev = manager.kv_pools_device()
        self.timer: KernelTimer | None = None

    def kv_pools(self) -> np.ndarray:
        return self._kv_pools

    def _timed(self, name: str):
        return self.timer.around(name, self.stream) if self.timer is not None else contextlib.nullcontext()

    def _io_dtype(self, cfg):
        from pagedkv.kernels.write import IODType
        from pagedkv.layout import CacheDType

        return IODType.BF16 if CacheDType(cfg.pool.cache_dtype) == CacheDType.BF16 else IODType.FP16

    def _step_buffers(self, stack, kv_pools, block_table, cu_q_lens, past_lens, position_ids=None):
        """Device copies of the step metadata (closed with ``stack``) and their ``StepPointers``."""
        from pagedkv.cuda import DeviceBuffer
        from pagedkv.kernels.write import StepPointers

        if not np.array_equal(kv_pools, self._kv_pools):
            raise ValueError("kv_pools: the engine input differs from the KV manager's pool descriptors")
        meta = _meta(block_table, cu_q_lens, past_lens, position_ids)
        up = lambda a: stack.enter_context(DeviceBuffer.from_array(a, self.stream))  # noqa: E731
        bt, cu, past = up(meta.block_table), up(meta.cu_q_lens), up(meta.past_lens)
        pos = up(meta.position_ids).ptr if meta.position_ids is not None else 0
        return meta, StepPointers(self._kv_pools_dev.ptr, bt.ptr, cu.ptr, past.ptr, num_seqs=meta.num_seqs,
                                  num_tokens=meta.num_tokens, max_blocks=meta.max_blocks, position_ids=pos)

    def write(self, cfg: WriteConfig, qkv, kv_pools, block_table, cu_q_lens, past_lens, position_ids, bias):
        from pagedkv.cuda import DeviceBuffer
        from pagedkv.kernels.write import qkv_write

        io = self._io_dtype(cfg)
        with contextlib.ExitStack() as stack:
            meta, ptrs = self._step_buffers(stack, kv_pools, block_table, cu_q_lens, past_lens, position_ids)
            width = cfg.num_q_heads * cfg.pool.head_dim
            x = stack.enter_context(DeviceBuffer.from_array(qkv.astype(io.numpy_dtype), self.stream))
            b = stack.enter_context(DeviceBuffer.from_array(bias.astype(io.numpy_dtype), self.stream)) \
                if bias is not None else None
            q_out = stack.enter_context(DeviceBuffer(meta.num_tokens * width * io.numpy_dtype.itemsize))
            status = stack.enter_context(DeviceBuffer.from_array(np.zeros(STATUS_FIELDS, np.int32), self.stream))
            with self._timed("qkv_write"):
                qkv_write(x.ptr, q_out.ptr, status.ptr, ptrs, cfg, io_dtype=io, bias=b.ptr if b else 0,
                          stream=self.stream.handle)
            q = q_out.download((meta.num_tokens, width), io.numpy_dtype, self.stream)
            st = status.download((STATUS_FIELDS,), np.int32, self.stream)
        return q.astype(qkv.dtype), st

    def attention(self, cfg: AttentionConfig, q, kv_pools, block_table, cu_q_lens, past_lens, kv_write_status):
        from pagedkv.cuda import DeviceBuffer
        from pagedkv.kernels import attention as katt

        io = self._io_dtype(cfg)
        with contextlib.ExitStack() as stack:
            meta, ptrs = self._step_buffers(stack, kv_pools, block_table, cu_q_lens, past_lens)
            width = cfg.num_q_heads * cfg.pool.head_dim
            qd = stack.enter_context(DeviceBuffer.from_array(q.astype(io.numpy_dtype), self.stream))
            out = stack.enter_context(DeviceBuffer(meta.num_tokens * width * io.numpy_dtype.itemsize))
            # As the plugin does: bounds from the input dims (max_q_len <= T, kv length <= MB * page size) and
            # the workspace those bounds need, so long sequences take the split-K path as in an engine.
            max_kv_len = meta.max_blocks * cfg.pool.page_size
            ws_bytes = katt.attention_workspace_bytes(meta.num_tokens, meta.num_seqs, cfg.num_q_heads,
                                                      cfg.pool.head_dim, max_kv_len, cfg.pool.page_size)
            ws = stack.enter_context(DeviceBuffer(ws_bytes)) if ws_bytes else None
            with self._timed("attention"):
                katt.paged_attention(qd.ptr, out.ptr, ptrs, cfg, io_dtype=io, max_q_len=max(meta.num_tokens, 1),
                                     max_kv_len=max_kv_len, workspace=ws.ptr if ws else 0, workspace_bytes=ws_bytes,
                                     stream=self.stream.handle)
            result = out.download((meta.num_tokens, width), io.numpy_dtype, self.stream)
        return result.astype(q.dtype)

    def close(self) -> None:
        pass


def make_backend(name: str, manager):
    if name == "reference":
        return ReferenceBackend(manager)
    if name == "cuda":
        return CudaBackend(manager)
    raise ValueError(f"backend: expected one of {BACKENDS}, got {name!r}")
