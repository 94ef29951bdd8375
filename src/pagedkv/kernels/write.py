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
``write_params`` fills the launcher's own ``pagedkv::QKVWriteParams`` (a ctypes mirror built from the library's
description, ``pagedkv.kernels._structs``) and ``launch`` runs it, for callers that keep one per layer.
"""

from __future__ import annotations

import ctypes
import enum
import functools
from dataclasses import dataclass

import numpy as np

from pagedkv import _lib
from pagedkv.config import RopeConfig, RopeStyle, WriteConfig
from pagedkv.kernels import _structs
from pagedkv.layout import CacheDType
from pagedkv.step import POOL_DESC_ADDRESS, POOL_DESC_FIELDS, POOL_DESC_NUM_BLOCKS, STATUS_FIELDS, StepMetadata

__all__ = ["IODType", "StepPointers", "compute_rope_params", "launch", "qkv_write", "qkv_write_numpy",
           "qkv_write_numpy_unchecked", "rope_angles", "rope_config", "rope_inv_freq", "rope_params", "step_metadata",
           "write_params"]


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


@functools.lru_cache(maxsize=None)
def _capi() -> ctypes.CDLL:
    """The C API with this module's signatures declared."""
    f32p, i32 = ctypes.POINTER(ctypes.c_float), ctypes.c_int32
    return _lib.declare(_lib.capi(), {
        "pagedkv_qkv_write": ([ctypes.POINTER(_structs.struct("QKVWriteParams")), ctypes.c_void_p], i32),
        "pagedkv_rope_params": ([ctypes.POINTER(_structs.struct("RopeConfig")), i32,
                                 ctypes.POINTER(_structs.struct("RopeParams"))], i32),
        "pagedkv_rope_angles": ([f32p, i32, ctypes.POINTER(i32), i32, f32p], i32),
        "pagedkv_qkv_write_warps": ([i32, i32, ctypes.c_int64, ctypes.POINTER(i32)], i32),
    })


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


def step_metadata(meta: StepPointers, pool_index: int) -> ctypes.Structure:
    """``pagedkv::StepMetadata`` of a step (device pointers; 0 for absent ones)."""
    m = _structs.struct("StepMetadata")()
    m.poolDescs, m.poolIndex, m.blockTable, m.maxBlocks = meta.pool_descs, pool_index, meta.block_table, meta.max_blocks
    m.cuQLens, m.pastLens, m.numSeqs, m.numTokens = meta.cu_q_lens, meta.past_lens, meta.num_seqs, meta.num_tokens
    return m


def rope_config(rope: RopeConfig) -> ctypes.Structure:
    """``pagedkv::RopeConfig`` of ``rope`` (the plugin's ``rope_*`` attributes)."""
    c = _structs.struct("RopeConfig")()
    c.style, c.rotaryDim, c.theta, c.scaling = int(rope.style), rope.rotary_dim, rope.theta, int(rope.scaling)
    c.factor, c.lowFreqFactor, c.highFreqFactor = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    c.originalMaxPositions = rope.original_max_positions
    c.betaFast, c.betaSlow, c.truncate = rope.beta_fast, rope.beta_slow, int(rope.truncate)
    c.attentionFactor = rope.attention_factor
    if len(rope.short_factors) != len(rope.long_factors):
        raise ValueError(f"rope_short_factors / rope_long_factors: expected the same length, got "
                         f"{len(rope.short_factors)} and {len(rope.long_factors)}")
    if len(rope.short_factors) > len(c.shortFactors):
        raise ValueError(f"rope_short_factors: at most {len(c.shortFactors)} values, got {len(rope.short_factors)}")
    c.numFactors = len(rope.short_factors)
    c.shortFactors[:c.numFactors] = rope.short_factors
    c.longFactors[:c.numFactors] = rope.long_factors
    return c


def compute_rope_params(config: ctypes.Structure, head_dim: int) -> ctypes.Structure:
    """``pagedkv::RopeParams`` of a ``RopeConfig`` struct: the library's ``computeRopeParams``, the table the
    plugin precomputes. Raises ``pagedkv._lib.CapiError`` naming a bad ``rope_*`` field."""
    out = _structs.struct("RopeParams")()
    _lib.check(_capi().pagedkv_rope_params(ctypes.byref(config), head_dim, ctypes.byref(out)), "pagedkv_rope_params")
    return out


def rope_params(cfg: WriteConfig) -> ctypes.Structure:
    """``pagedkv::RopeParams`` of ``cfg.rope`` for ``cfg``'s head dim."""
    return compute_rope_params(rope_config(cfg.rope), cfg.pool.head_dim)


def write_params(cfg: WriteConfig, io_dtype: IODType, *, qkv: int, q_out: int, status: int, meta: StepPointers,
                 bias: int = 0) -> ctypes.Structure:
    """The launcher's ``pagedkv::QKVWriteParams`` for one launch: attributes from ``cfg`` (layout and RoPE table
    built by the library, as the plugin builds them), pointers as given (0 for absent optional ones). Nothing
    else is validated here: the launcher does it and names the field."""
    pool = cfg.pool
    p = _structs.struct("QKVWriteParams")()
    p.numQHeads, p.numKVHeads, p.headDim, p.ioDType = cfg.num_q_heads, pool.num_kv_heads, pool.head_dim, int(io_dtype)
    p.qkv, p.bias, p.positionIds = qkv, bias, meta.position_ids
    p.meta = step_metadata(meta, pool.pool_index)
    p.layout = _structs.kv_layout(pool.layout())
    p.cacheDType, p.layer, p.kScale, p.vScale = int(pool.cache_dtype), pool.layer_index, pool.k_scale, pool.v_scale
    p.rope = rope_params(cfg)
    p.qOut, p.qOutFP8, p.qScale, p.zeroVTail, p.status = q_out, cfg.q_out_fp8, cfg.q_scale, cfg.zero_v_tail, status
    return p


def launch(params: ctypes.Structure, stream: int = 0) -> None:
    """Launches a prepared ``QKVWriteParams`` on ``stream`` (a ``cudaStream_t`` as int; 0 = legacy default)."""
    _lib.check(_capi().pagedkv_qkv_write(ctypes.byref(params), ctypes.c_void_p(stream or None)), "pagedkv_qkv_write")


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
    launch(write_params(cfg, io_dtype, qkv=qkv, q_out=q_out, status=status, meta=meta, bias=bias), stream)


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

def rope_inv_freq(cfg: WriteConfig, long: bool = False) -> np.ndarray:
    """``computeRopeParams``'s float32 inverse frequencies ``[R/2]`` for ``cfg`` (empty without RoPE); ``long``:
    its LongRoPE long table (``longInvFreq``, zeros for other scalings)."""
    params = rope_params(cfg)
    if cfg.rope.style == RopeStyle.NONE:
        return np.zeros(0, dtype=np.float32)
    table = params.longInvFreq if long else params.invFreq
    return np.ctypeslib.as_array(table)[: params.rotaryDim // 2].astype(np.float32)


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


def write_warps(num_tokens: int, passes_per_token: int, resident_warps: int) -> int:
    """The launcher's warp count on the host (``qkvWriteWarps``): how many warps share the ``num_tokens x
    passes_per_token`` (token, pass) pairs when ``resident_warps`` fit the GPU at once. Warp ``w`` then takes pairs
    ``[w * TP // N, (w + 1) * TP // N)``."""
    out = ctypes.c_int32()
    _lib.check(_capi().pagedkv_qkv_write_warps(num_tokens, passes_per_token, resident_warps, ctypes.byref(out)),
               "pagedkv_qkv_write_warps")
    return out.value
