"""Fused QKV preprocess + paged KV write: the ctypes binding of the C API ``pagedkv_qkv_write``.

One launch per layer and step: adds the QKV bias, applies RoPE to Q and K, writes Q to ``q_out`` and K/V into
the paged pool (through the block table, in the pool's dtype), and, after a prefill chunk, zeroes the V rows
past the sequence's end in its last page. ``plugins/include/pagedkv/qkv_write.h`` is the kernel contract,
``pagedkv.reference.write.qkv_write`` the float64 reference it is tested against.

Shapes (T tokens of the step, B sequences, MB block-table width, H query heads, KVH KV heads, D head dim)::

    qkv          [T, (H + 2*KVH) * D]   fp16 | bf16, rows = tokens, columns = [q heads | k heads | v heads]
    bias         [(H + 2*KVH) * D]      same dtype, optional (WriteConfig.has_bias)
    q_out        [T, H * D]             like qkv, or fp8 e4m3 (q / q_scale) with WriteConfig.q_out_fp8
    pool_descs   int64 [num_pools, 4]   row pool_index: (pool address, NB, 0, 0)
    block_table  int32 [B, MB]          -1 where no page
    cu_q_lens    int32 [B + 1]          sequence b owns tokens [cu_q_lens[b], cu_q_lens[b+1])
    past_lens    int32 [B]              tokens cached before this step
    position_ids int32 [T]              explicit RoPE positions (WriteConfig.explicit_positions), optional
    status       int32 [4]              zeroed before the launch; non-zero flags -> pagedkv.step.raise_for_status

Example (device pointers from ``pagedkv.cuda.DeviceBuffer``)::

    from pagedkv.kernels.write import IODType, StepPointers, qkv_write
    qkv_write(qkv.ptr, q_out.ptr, status.ptr,
              StepPointers(pool_descs.ptr, block_table.ptr, cu_q_lens.ptr, past_lens.ptr,
                           num_seqs=B, num_tokens=T, max_blocks=MB),
              cfg, io_dtype=IODType.BF16, stream=stream.handle)

For tests, ``qkv_write_numpy`` takes host arrays, uploads them, runs, downloads and raises on a bad page.
"""

from __future__ import annotations

import ctypes
import enum
import functools
from dataclasses import dataclass

import numpy as np

from pagedkv import _lib
from pagedkv.config import RopeStyle, WriteConfig
from pagedkv.kernels._ctypes_check import check_struct_layout
from pagedkv.layout import CacheDType
from pagedkv.step import POOL_DESC_ADDRESS, POOL_DESC_FIELDS, POOL_DESC_NUM_BLOCKS, STATUS_FIELDS, StepMetadata

__all__ = ["IODType", "QKVWriteArgs", "StepPointers", "build_args", "launch", "qkv_write", "qkv_write_numpy",
           "qkv_write_numpy_unchecked", "rope_angles", "rope_inv_freq"]


class IODType(enum.IntEnum):
    """dtype of qkv, bias and q_out (``pagedkv::IODType``)."""

    FP16 = 0
    BF16 = 1

    @classmethod
    def from_numpy(cls, dtype) -> "IODType":
        import ml_dtypes

        dtype = np.dtype(dtype)
        if dtype == np.float16:
            return cls.FP16
        if dtype == np.dtype(ml_dtypes.bfloat16):
            return cls.BF16
        raise ValueError(f"qkv dtype: expected float16 or bfloat16, got {dtype}")

    @property
    def numpy_dtype(self) -> np.dtype:
        return CacheDType.FP16.numpy_dtype if self == IODType.FP16 else CacheDType.BF16.numpy_dtype


class QKVWriteArgs(ctypes.Structure):
    """Mirror of ``PagedKVQKVWriteArgs`` (plugins/capi/capi_write.h), field for field, in order."""

    _fields_ = [
        ("struct_size", ctypes.c_int32),
        ("num_q_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("io_dtype", ctypes.c_int32),
        ("num_tokens", ctypes.c_int32),
        ("num_seqs", ctypes.c_int32),
        ("max_blocks", ctypes.c_int32),
        ("pool_index", ctypes.c_int32),
        ("num_layers", ctypes.c_int32),
        ("layer_index", ctypes.c_int32),
        ("page_size", ctypes.c_int32),
        ("page_layout", ctypes.c_int32),
        ("ring_sink_tokens", ctypes.c_int32),
        ("cyclic_len", ctypes.c_int32),
        ("cache_dtype", ctypes.c_int32),
        ("k_scale", ctypes.c_float),
        ("v_scale", ctypes.c_float),
        ("rope_style", ctypes.c_int32),
        ("rope_rotary_dim", ctypes.c_int32),
        ("rope_theta", ctypes.c_float),
        ("rope_scaling", ctypes.c_int32),
        ("rope_factor", ctypes.c_float),
        ("rope_low_freq_factor", ctypes.c_float),
        ("rope_high_freq_factor", ctypes.c_float),
        ("rope_original_max_positions", ctypes.c_int32),
        ("q_out_fp8", ctypes.c_int32),
        ("q_scale", ctypes.c_float),
        ("zero_v_tail", ctypes.c_int32),
        ("reserved0", ctypes.c_int32),
        ("qkv", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("position_ids", ctypes.c_void_p),
        ("pool_descs", ctypes.c_void_p),
        ("block_table", ctypes.c_void_p),
        ("cu_q_lens", ctypes.c_void_p),
        ("past_lens", ctypes.c_void_p),
        ("q_out", ctypes.c_void_p),
        ("status", ctypes.c_void_p),
    ]


@functools.lru_cache(maxsize=None)
def _capi() -> ctypes.CDLL:
    """The C API with this module's signatures declared, after checking that the struct layouts agree."""
    lib = _lib.capi()
    lib.pagedkv_qkv_write.argtypes = [ctypes.POINTER(QKVWriteArgs), ctypes.c_void_p]
    lib.pagedkv_qkv_write.restype = ctypes.c_int32
    lib.pagedkv_qkv_write_args_size.argtypes = []
    lib.pagedkv_qkv_write_args_size.restype = ctypes.c_int32
    lib.pagedkv_qkv_write_args_offsets.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int32]
    lib.pagedkv_qkv_write_args_offsets.restype = ctypes.c_int32
    lib.pagedkv_rope_params.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_float,
                                        ctypes.c_int32, ctypes.c_float, ctypes.c_float, ctypes.c_float,
                                        ctypes.c_int32, ctypes.POINTER(ctypes.c_float),
                                        ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_float)]
    lib.pagedkv_rope_params.restype = ctypes.c_int32
    lib.pagedkv_rope_angles.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_int32,
                                        ctypes.POINTER(ctypes.c_int32), ctypes.c_int32,
                                        ctypes.POINTER(ctypes.c_float)]
    lib.pagedkv_rope_angles.restype = ctypes.c_int32
    check_struct_layout(QKVWriteArgs, "PagedKVQKVWriteArgs", __name__,
                        library_offsets=lib.pagedkv_qkv_write_args_offsets,
                        library_size=lib.pagedkv_qkv_write_args_size())
    return lib


@dataclass(frozen=True)
class StepPointers:
    """Device pointers and counts of a step's metadata (see ``pagedkv.step.StepMetadata``)."""

    pool_descs: int  # int64 [num_pools, 4]
    block_table: int  # int32 [B, MB]
    cu_q_lens: int  # int32 [B + 1]
    past_lens: int  # int32 [B]
    num_seqs: int  # B
    num_tokens: int  # T
    max_blocks: int  # MB
    position_ids: int = 0  # int32 [T] or 0


def build_args(cfg: WriteConfig, io_dtype: IODType, *, qkv: int, q_out: int, status: int, meta: StepPointers,
               bias: int = 0) -> QKVWriteArgs:
    """The C struct for one launch: attributes from ``cfg``, pointers as given (0 for absent optional ones)."""
    pool, rope = cfg.pool, cfg.rope
    return QKVWriteArgs(
        struct_size=ctypes.sizeof(QKVWriteArgs),
        num_q_heads=cfg.num_q_heads, num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim,
        io_dtype=int(io_dtype), num_tokens=meta.num_tokens, num_seqs=meta.num_seqs, max_blocks=meta.max_blocks,
        pool_index=pool.pool_index, num_layers=pool.num_layers, layer_index=pool.layer_index,
        page_size=pool.page_size, page_layout=int(pool.page_layout), ring_sink_tokens=pool.ring_sink_tokens,
        cyclic_len=pool.cyclic_len, cache_dtype=int(pool.cache_dtype), k_scale=pool.k_scale, v_scale=pool.v_scale,
        rope_style=int(rope.style), rope_rotary_dim=rope.rotary_dim, rope_theta=rope.theta,
        rope_scaling=int(rope.scaling), rope_factor=rope.factor, rope_low_freq_factor=rope.low_freq_factor,
        rope_high_freq_factor=rope.high_freq_factor, rope_original_max_positions=rope.original_max_positions,
        q_out_fp8=int(cfg.q_out_fp8), q_scale=cfg.q_scale, zero_v_tail=int(cfg.zero_v_tail), reserved0=0,
        qkv=qkv or None, bias=bias or None, position_ids=meta.position_ids or None, pool_descs=meta.pool_descs or None,
        block_table=meta.block_table or None, cu_q_lens=meta.cu_q_lens or None, past_lens=meta.past_lens or None,
        q_out=q_out or None, status=status or None)


def launch(args: QKVWriteArgs, stream: int = 0) -> None:
    """Launches a prepared ``QKVWriteArgs`` on ``stream`` (a ``cudaStream_t`` as int; 0 = legacy default)."""
    _lib.check(_capi().pagedkv_qkv_write(ctypes.byref(args), ctypes.c_void_p(stream or None)), "pagedkv_qkv_write")


def qkv_write(qkv: int, q_out: int, status: int, meta: StepPointers, cfg: WriteConfig, *, io_dtype: IODType,
              bias: int = 0, stream: int = 0) -> None:
    """Launches the fused QKV write on device pointers (asynchronous: nothing is synchronized).

    ``qkv``/``q_out``/``bias`` as in the module docstring, ``status`` an int32[4] the caller zeroed. Raises
    ``pagedkv._lib.CapiError`` naming the field and the value when a parameter is invalid. A bad block-table
    entry is not an exception here: the kernel skips that token's K/V and raises ``status`` (read it back and
    call ``pagedkv.step.raise_for_status``).
    """
    if cfg.has_bias != bool(bias):
        raise ValueError(f"bias: WriteConfig.has_bias={cfg.has_bias} but bias pointer={bias:#x}")
    if cfg.explicit_positions != bool(meta.position_ids):
        raise ValueError(f"position_ids: WriteConfig.explicit_positions={cfg.explicit_positions} but "
                         f"position_ids pointer={meta.position_ids:#x}")
    launch(build_args(cfg, io_dtype, qkv=qkv, q_out=q_out, status=status, meta=meta, bias=bias), stream)


def qkv_write_numpy(qkv: np.ndarray, bias: np.ndarray | None, meta: StepMetadata, pool: np.ndarray,
                    cfg: WriteConfig) -> np.ndarray:
    """Test convenience: runs the kernel on host arrays, called like ``pagedkv.reference.write.qkv_write``.

    ``qkv`` float16 or bfloat16 ``[T, (H + 2*KVH) * D]``; ``bias`` like a row or None; ``meta`` the step
    (``meta.position_ids`` is used iff ``cfg.explicit_positions``); ``pool`` the whole pool of ``cfg.pool``'s
    group, shape ``cfg.pool.layout().pool_shape(NB)``, dtype ``cfg.pool.cache_dtype.numpy_dtype``. Uploads
    everything, launches, synchronizes and copies the pool back into ``pool`` (in place). Returns q_out
    ``[T, H, D]`` in the kernel's output dtype (qkv's, or float8_e4m3fn with ``cfg.q_out_fp8``). Raises
    ``pagedkv.step.KVWriteError`` if the kernel reported a bad page; ``pool`` then already holds what the kernel
    wrote (``qkv_write_numpy_unchecked`` returns the status instead of raising).

    Example::

        pool = np.full(cfg.pool.layout().pool_shape(num_blocks), np.nan, cfg.pool.cache_dtype.numpy_dtype)
        q = qkv_write_numpy(qkv, None, StepMetadata(block_table, cu_q_lens, past_lens), pool, cfg)
    """
    from pagedkv.step import raise_for_status

    q_out, status = qkv_write_numpy_unchecked(qkv, bias, meta, pool, cfg)
    raise_for_status(status, where="qkv_write")
    return q_out


def qkv_write_numpy_unchecked(qkv: np.ndarray, bias: np.ndarray | None, meta: StepMetadata, pool: np.ndarray,
                              cfg: WriteConfig) -> tuple[np.ndarray, np.ndarray]:
    """``qkv_write_numpy`` without the status check: returns ``(q_out, status int32[4])``.

    q_out starts as 0xFF bytes on the device (NaN in fp16, bf16 and e4m3), so a row the kernel did not
    write comes back as NaN.
    """
    from pagedkv import cuda

    io_dtype = IODType.from_numpy(qkv.dtype)
    pc = cfg.pool
    heads, kv_heads, head_dim = cfg.num_q_heads, pc.num_kv_heads, pc.head_dim
    width = (heads + 2 * kv_heads) * head_dim
    if qkv.ndim != 2 or qkv.shape != (meta.num_tokens, width):
        raise ValueError(f"qkv: expected shape ({meta.num_tokens}, {width}), got {qkv.shape}")
    if (bias is not None) != cfg.has_bias:
        raise ValueError(f"bias: WriteConfig.has_bias={cfg.has_bias} but bias is {'given' if bias is not None else None}")
    if bias is not None and (bias.shape != (width,) or bias.dtype != qkv.dtype):
        raise ValueError(f"bias: expected shape ({width},) and dtype {qkv.dtype}, got {bias.shape} {bias.dtype}")
    if (meta.position_ids is not None) != cfg.explicit_positions:
        raise ValueError(f"position_ids: WriteConfig.explicit_positions={cfg.explicit_positions} but "
                         f"meta.position_ids is {'given' if meta.position_ids is not None else None}")
    layout = pc.layout()
    num_blocks = pool.shape[0] if pool.ndim else 0
    if pool.shape != layout.pool_shape(num_blocks) or pool.dtype != pc.cache_dtype.numpy_dtype:
        raise ValueError(f"pool: expected shape {layout.pool_shape(num_blocks)} and dtype "
                         f"{pc.cache_dtype.numpy_dtype}, got {pool.shape} {pool.dtype}")
    q_dtype = CacheDType.FP8_E4M3.numpy_dtype if cfg.q_out_fp8 else qkv.dtype

    bufs: list[cuda.DeviceBuffer] = []

    def upload(array: np.ndarray) -> cuda.DeviceBuffer:
        buf = cuda.DeviceBuffer.from_array(np.ascontiguousarray(array))
        bufs.append(buf)
        return buf

    try:
        pool_buf = upload(pool)
        descs = np.zeros((pc.pool_index + 1, POOL_DESC_FIELDS), dtype=np.int64)
        descs[pc.pool_index, POOL_DESC_ADDRESS] = pool_buf.ptr
        descs[pc.pool_index, POOL_DESC_NUM_BLOCKS] = num_blocks
        qkv_buf, descs_buf = upload(qkv), upload(descs)
        table_buf, cu_buf, past_buf = upload(meta.block_table), upload(meta.cu_q_lens), upload(meta.past_lens)
        bias_buf = upload(bias) if bias is not None else None
        pos_buf = upload(meta.position_ids) if meta.position_ids is not None else None
        status_buf = upload(np.zeros(STATUS_FIELDS, dtype=np.int32))
        q_buf = cuda.DeviceBuffer(meta.num_tokens * heads * head_dim * np.dtype(q_dtype).itemsize)
        bufs.append(q_buf)
        q_buf.fill_bytes(0xFF)
        step = StepPointers(descs_buf.ptr, table_buf.ptr, cu_buf.ptr, past_buf.ptr, num_seqs=meta.num_seqs,
                            num_tokens=meta.num_tokens, max_blocks=meta.max_blocks,
                            position_ids=pos_buf.ptr if pos_buf is not None else 0)
        # The legacy default stream (0): the uploads and the memset above ran there, and a pageable
        # cudaMemcpy or a cudaMemset may return before they finish, so the launch must queue behind them.
        qkv_write(qkv_buf.ptr, q_buf.ptr, status_buf.ptr, step, cfg, io_dtype=io_dtype,
                  bias=bias_buf.ptr if bias_buf is not None else 0, stream=0)
        cuda.synchronize()
        pool[...] = pool_buf.download(pool.shape, pool.dtype)
        q_out = q_buf.download((meta.num_tokens, heads, head_dim), q_dtype)
        status = status_buf.download((STATUS_FIELDS,), np.int32)
    finally:
        for buf in bufs:
            buf.close()
    return q_out, status


# ---- host-side views of the kernel's RoPE machinery (CPU tests; no GPU needed) --------------------------------

def rope_inv_freq(cfg: WriteConfig) -> np.ndarray:
    """``computeRopeParams``'s float32 inverse frequencies ``[R/2]`` for ``cfg`` (empty without RoPE)."""
    rope, head_dim = cfg.rope, cfg.pool.head_dim
    out = (ctypes.c_float * 128)()
    rotary, mscale = ctypes.c_int32(), ctypes.c_float()
    rc = _capi().pagedkv_rope_params(head_dim, int(rope.style), rope.rotary_dim, rope.theta, int(rope.scaling),
                                     rope.factor, rope.low_freq_factor, rope.high_freq_factor,
                                     rope.original_max_positions, out, ctypes.byref(rotary), ctypes.byref(mscale))
    _lib.check(rc, "pagedkv_rope_params")
    if rope.style == RopeStyle.NONE:
        return np.zeros(0, dtype=np.float32)
    return np.frombuffer(out, dtype=np.float32)[: rotary.value // 2].copy()


def rope_angles(inv_freq: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The kernel's angle reduction on the host: float32 ``[n, F]`` in [-pi, pi) for positions ``[n]``."""
    inv_freq = np.ascontiguousarray(inv_freq, dtype=np.float32)
    positions = np.ascontiguousarray(positions, dtype=np.int32)
    out = np.empty((positions.size, inv_freq.size), dtype=np.float32)
    rc = _capi().pagedkv_rope_angles(inv_freq.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), inv_freq.size,
                                     positions.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), positions.size,
                                     out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
    _lib.check(rc, "pagedkv_rope_angles")
    return out
