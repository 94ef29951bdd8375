"""Device memory, streams and copies through cuda-python (``cuda.bindings.runtime``), never torch.

Everything the runtime allocates on the device (KV pools, step-metadata buffers, kernel I/O in tests)
goes through ``DeviceBuffer`` so that ownership and release are explicit (context manager / ``close``).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np


class CudaError(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def _rt():
    from cuda.bindings import runtime

    return runtime


def check(result, what: str = "CUDA call"):
    """Unpack a cuda-python result tuple, raising ``CudaError`` on failure."""
    rt = _rt()
    if isinstance(result, tuple):
        err, *rest = result
    else:
        err, rest = result, []
    if err != rt.cudaError_t.cudaSuccess:
        _, name = rt.cudaGetErrorName(err)
        _, desc = rt.cudaGetErrorString(err)
        raise CudaError(f"{what}: {name.decode() if isinstance(name, bytes) else name}: "
                        f"{desc.decode() if isinstance(desc, bytes) else desc}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def why_no_gpu() -> str | None:
    """None when a CUDA device is usable, else a one-line reason (for skips and ``pagedkv doctor``)."""
    try:
        rt = _rt()
    except Exception as exc:  # pragma: no cover - cuda-python is a dependency
        return f"cuda-python not importable: {exc}"
    try:
        err, n = rt.cudaGetDeviceCount()
    except Exception as exc:
        return f"CUDA runtime unusable: {exc}"
    if err != rt.cudaError_t.cudaSuccess:
        _, name = rt.cudaGetErrorName(err)
        return f"no CUDA device: cudaGetDeviceCount -> {name.decode() if isinstance(name, bytes) else name}"
    if n == 0:
        return "no CUDA device: cudaGetDeviceCount -> 0"
    return None


def device_properties(device: int = 0):
    """``cudaDeviceProp`` of ``device`` (name, major, minor, multiProcessorCount, totalGlobalMem, ...)."""
    return check(_rt().cudaGetDeviceProperties(device), "cudaGetDeviceProperties")


def compute_capability(device: int = 0) -> str:
    """"9.0" for an H200."""
    props = device_properties(device)
    return f"{props.major}.{props.minor}"


def mem_get_info() -> tuple[int, int]:
    """(free, total) bytes of the current device."""
    free, total = check(_rt().cudaMemGetInfo(), "cudaMemGetInfo")
    return int(free), int(total)


def synchronize() -> None:
    check(_rt().cudaDeviceSynchronize(), "cudaDeviceSynchronize")


class Stream:
    """A CUDA stream (non-blocking); ``handle`` is the integer ``cudaStream_t`` for the C API."""

    def __init__(self):
        rt = _rt()
        self._stream = check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreate")

    @property
    def handle(self) -> int:
        return int(self._stream)

    @property
    def raw(self):
        return self._stream

    def synchronize(self) -> None:
        check(_rt().cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")

    def close(self) -> None:
        if self._stream is not None:
            check(_rt().cudaStreamDestroy(self._stream), "cudaStreamDestroy")
            self._stream = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_live_device_bytes = 0  # bytes held by open DeviceBuffers of this process (leak checks)


def live_device_bytes() -> int:
    """Device bytes currently held by this process's open ``DeviceBuffer``s. Unlike ``cudaMemGetInfo`` it is
    exact and private to the process (other processes on the same GPU don't move it)."""
    return _live_device_bytes


class _OwnedMemory:
    """Memory at ``ptr`` (an int; 0 before allocation and once released) that this object owns: ``close()`` or
    the context manager releases it, exactly once; the collector does it as a last resort. Subclasses allocate
    in ``__init__`` and free ``self.ptr`` in ``_release``."""

    ptr = 0  # also what __del__ sees when __init__ raised before allocating

    def _release(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self.ptr:
            self._release()
            self.ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):  # last resort; deterministic release is close()/with
        try:
            self.close()
        except Exception:
            pass


class DeviceBuffer(_OwnedMemory):
    """``nbytes`` of device memory from ``cudaMalloc``; freed by ``close()`` or the context manager."""

    def __init__(self, nbytes: int):
        global _live_device_bytes
        if nbytes < 0:
            raise ValueError(f"nbytes: must be >= 0, got {nbytes}")
        self.nbytes = int(nbytes)
        self.ptr = int(check(_rt().cudaMalloc(max(self.nbytes, 1)), f"cudaMalloc({self.nbytes})"))
        _live_device_bytes += self.nbytes

    @classmethod
    def from_array(cls, array: np.ndarray, stream: Stream | None = None) -> "DeviceBuffer":
        array = np.ascontiguousarray(array)
        buf = cls(array.nbytes)
        buf.upload(array, stream)
        if stream is not None:
            stream.synchronize()  # the source may be a temporary
        return buf

    def upload(self, array: np.ndarray, stream: Stream | None = None, offset: int = 0) -> None:
        array = np.ascontiguousarray(array)
        if offset + array.nbytes > self.nbytes:
            raise ValueError(f"upload: {array.nbytes} bytes at offset {offset} exceed the buffer's {self.nbytes}")
        rt = _rt()
        kind = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        if stream is None:
            check(rt.cudaMemcpy(self.ptr + offset, array.ctypes.data, array.nbytes, kind), "cudaMemcpy H2D")
            # From pageable memory cudaMemcpy may return before the DMA lands, and work on a non-blocking
            # stream does not wait for the legacy stream: without a stream, "synchronous" means complete.
            synchronize()
        else:
            check(rt.cudaMemcpyAsync(self.ptr + offset, array.ctypes.data, array.nbytes, kind, stream.raw),
                  "cudaMemcpyAsync H2D")

    def download(self, shape, dtype, stream: Stream | None = None, offset: int = 0) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        if offset + out.nbytes > self.nbytes:
            raise ValueError(f"download: {out.nbytes} bytes at offset {offset} exceed the buffer's {self.nbytes}")
        rt = _rt()
        kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        if stream is None:
            check(rt.cudaMemcpy(out.ctypes.data, self.ptr + offset, out.nbytes, kind), "cudaMemcpy D2H")
        else:
            check(rt.cudaMemcpyAsync(out.ctypes.data, self.ptr + offset, out.nbytes, kind, stream.raw),
                  "cudaMemcpyAsync D2H")
            stream.synchronize()
        return out

    def fill_bytes(self, value: int, stream: Stream | None = None) -> None:
        rt = _rt()
        if stream is None:
            check(rt.cudaMemset(self.ptr, value, self.nbytes), "cudaMemset")
            synchronize()  # cudaMemset on device memory is asynchronous to the host
        else:
            check(rt.cudaMemsetAsync(self.ptr, value, self.nbytes, stream.raw), "cudaMemsetAsync")

    def _release(self) -> None:
        global _live_device_bytes
        check(_rt().cudaFree(self.ptr), "cudaFree")
        _live_device_bytes -= self.nbytes


class PinnedBuffer(_OwnedMemory):
    """``nbytes`` of page-locked host memory (cudaHostAlloc); ``close()`` / context manager frees it.
    ``view()`` arrays alias the buffer and must not be used after ``close()``."""

    def __init__(self, nbytes: int):
        if nbytes < 0:
            raise ValueError(f"nbytes: must be >= 0, got {nbytes}")
        rt = _rt()
        self.nbytes = int(nbytes)
        self.ptr = int(check(rt.cudaHostAlloc(max(self.nbytes, 1), rt.cudaHostAllocDefault),
                                  f"cudaHostAlloc({self.nbytes})"))

    def view(self, dtype=np.uint8, shape=None, offset: int = 0) -> np.ndarray:
        dtype = np.dtype(dtype)
        count = (self.nbytes - offset) // dtype.itemsize if shape is None else int(np.prod(shape))
        if offset < 0 or offset + count * dtype.itemsize > self.nbytes:
            raise ValueError(f"view: {count} x {dtype} at offset {offset} exceed the buffer's {self.nbytes} bytes")
        raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(self.ptr + offset)
        arr = np.frombuffer(raw, dtype=dtype, count=count)
        return arr if shape is None else arr.reshape(shape)

    def _release(self) -> None:
        check(_rt().cudaFreeHost(self.ptr), "cudaFreeHost")


class Event:
    """A CUDA event: without timing (the default), to know when an async copy out of a staging buffer has
    finished; with ``timing=True``, to measure device time between two events (``elapsed_ms``)."""

    def __init__(self, timing: bool = False):
        rt = _rt()
        flags = rt.cudaEventDefault if timing else rt.cudaEventDisableTiming
        self._event = check(rt.cudaEventCreateWithFlags(flags), "cudaEventCreate")
        self.recorded = False

    def elapsed_ms(self, end: "Event") -> float:
        """Device milliseconds from this event to ``end`` (both recorded with ``timing=True``); waits for ``end``."""
        end.synchronize()
        return float(check(_rt().cudaEventElapsedTime(self._event, end._event), "cudaEventElapsedTime"))

    def record(self, stream: Stream) -> None:
        check(_rt().cudaEventRecord(self._event, stream.raw), "cudaEventRecord")
        self.recorded = True

    def synchronize(self) -> None:
        if self.recorded:
            check(_rt().cudaEventSynchronize(self._event), "cudaEventSynchronize")

    def close(self) -> None:
        if self._event is not None:
            check(_rt().cudaEventDestroy(self._event), "cudaEventDestroy")
            self._event = None
