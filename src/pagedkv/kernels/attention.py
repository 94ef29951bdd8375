"""Paged attention on the GPU through the C API (``plugins/capi/capi_attention.h``).

Layers:

* ``paged_attention(q, out, meta, cfg, io_dtype=..., max_q_len=..., stream=...)`` -- device pointers
  (``meta``: ``pagedkv.kernels.write.StepPointers``), asynchronous. ``launch_attention(params, stream)`` takes
  the launcher's own ``pagedkv::AttentionParams`` (a ctypes mirror built from the library's description,
  ``pagedkv.kernels._structs``) filled by ``attention_params``.
* ``paged_attention_numpy(q, meta, pool, cfg)`` -- convenience for tests: numpy in, numpy out, called like
  ``pagedkv.reference.attention.paged_attention``. Uploads with ``pagedkv.cuda.DeviceBuffer``, allocates the
  workspace, runs, downloads.

Shapes (T tokens, B sequences, H query heads, KVH KV heads, D head dim, MB block-table width, NB blocks)::

    q     [T, H * D] (or [T, H, D])  float16 | bfloat16, or float8_e4m3fn with cfg.q_fp8 (x = q * cfg.q_scale)
    pool  cfg.pool.layout().pool_shape(NB), dtype cfg.pool.cache_dtype.numpy_dtype
    out   [T, H, D]                  float16 | bfloat16 (the compute type)

Example::

    out = paged_attention_numpy(q, meta, pool, cfg)   # compare with pagedkv.reference.attention.paged_attention

    # device pointers (pagedkv.cuda.DeviceBuffer), asynchronous on `stream`:
    ws_bytes = attention_workspace_bytes(T, B, H, D, max_kv_len, page_size)
    paged_attention(q.ptr, out.ptr, StepPointers(descs.ptr, table.ptr, cu.ptr, past.ptr, num_seqs=B,
                    num_tokens=T, max_blocks=MB), cfg, io_dtype=IODType.BF16, max_q_len=max_q_len,
                    workspace=ws.ptr, workspace_bytes=ws_bytes, stream=stream.handle)

Also: ``attention_workspace_bytes`` (sizes the workspace from bounds), ``attention_plan`` (the launcher's
scheduling decision for a given device, without a GPU), ``device_plan`` (the decision on the current GPU),
``kernel_shapes`` (threads and shared memory per CTA of the kernels serving a head dim and dtypes, as compiled)
and ``schedule_check`` (host replay of the kernels' work decomposition, for the CPU tests).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import numpy as np

from pagedkv import _lib
from pagedkv.config import AttentionConfig
from pagedkv.kernels import _structs
from pagedkv.kernels.write import IODType, StepPointers, step_metadata
from pagedkv.layout import CacheDType
from pagedkv.step import POOL_DESC_ADDRESS, POOL_DESC_FIELDS, POOL_DESC_NUM_BLOCKS, StepMetadata

__all__ = ["DECODE_WIDTHS", "IODType", "StepPointers", "attention_params", "attention_plan",
           "attention_workspace_bytes", "device_plan", "kernel_shapes", "launch_attention", "paged_attention",
           "paged_attention_numpy", "schedule_check"]


@functools.lru_cache(maxsize=None)
def _capi() -> ctypes.CDLL:
    params, p = ctypes.POINTER(_structs.struct("AttentionParams")), ctypes.POINTER
    i32, i32p = ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)
    return _lib.declare(_lib.capi(), {
        "pagedkv_attention": ([params, ctypes.c_void_p], i32),
        "pagedkv_attention_workspace_bytes": ([i32] * 6, ctypes.c_int64),
        "pagedkv_attention_plan": ([params, i32, i32p, i32, i32, p(_structs.struct("PagedKVAttentionPlanInfo"))],
                                   i32),
        "pagedkv_attention_device_plan": ([params, p(_structs.struct("PagedKVAttentionPlanInfo"))], i32),
        "pagedkv_attention_kernel_shapes": ([i32] * 3 + [p(_structs.struct("PagedKVAttentionKernelShapes"))], i32),
        "pagedkv_attention_schedule_check": ([params, ctypes.c_int64, i32, i32p, i32, i32, i32] + [i32p] * 5, i32),
    })


def attention_params(cfg: AttentionConfig, *, io_dtype: IODType, num_tokens: int, num_seqs: int, max_blocks: int,
                     max_q_len: int, max_kv_len: int, q: int = 0, out: int = 0, pool_descs: int = 0,
                     block_table: int = 0, cu_q_lens: int = 0, past_lens: int = 0, workspace: int = 0,
                     workspace_bytes: int = 0) -> ctypes.Structure:
    """The launcher's ``pagedkv::AttentionParams`` from an AttentionConfig (layout built by the library, as the
    plugin builds it) and device addresses (ints). Nothing else is validated here: the launcher does it and
    names the field."""
    pool = cfg.pool
    a = _structs.struct("AttentionParams")()
    a.numQHeads, a.numKVHeads, a.headDim, a.ioDType = cfg.num_q_heads, pool.num_kv_heads, pool.head_dim, int(io_dtype)
    a.qFP8, a.qScale, a.q = cfg.q_fp8, cfg.q_scale, q
    a.meta = step_metadata(StepPointers(pool_descs, block_table, cu_q_lens, past_lens, num_seqs=num_seqs,
                                        num_tokens=num_tokens, max_blocks=max_blocks), pool.pool_index)
    a.maxQLen, a.maxKVLen = max_q_len, max_kv_len
    a.layout = _structs.kv_layout(pool.layout())
    a.cacheDType, a.layer, a.kScale, a.vScale = int(pool.cache_dtype), pool.layer_index, pool.k_scale, pool.v_scale
    a.window, a.attentionSinks = cfg.window, cfg.attention_sinks
    a.softmaxScale, a.logitSoftcap = cfg.softmax_scale, cfg.logit_softcap
    a.out, a.workspace, a.workspaceBytes = out, workspace, workspace_bytes
    return a


def launch_attention(params: ctypes.Structure, stream: int = 0) -> None:
    """Launch on ``stream`` (an integer cudaStream_t; 0 = legacy default). Never synchronizes.
    Raises ``pagedkv._lib.CapiError`` naming the bad field and value."""
    _lib.check(_capi().pagedkv_attention(ctypes.byref(params), ctypes.c_void_p(int(stream) or None)),
               "pagedkv_attention")


def paged_attention(q: int, out: int, meta: StepPointers, cfg: AttentionConfig, *, io_dtype: IODType,
                    max_q_len: int, max_kv_len: int | None = None, workspace: int = 0, workspace_bytes: int = 0,
                    stream: int = 0) -> None:
    """Attention of a step's queries over the paged cache, on device pointers (asynchronous).

    ``q`` [T, H*D] (io_dtype, or fp8 e4m3 bytes with ``cfg.q_fp8``), ``out`` [T, H*D] io_dtype, ``meta`` the
    step's device metadata. ``max_q_len`` must bound every sequence's new tokens (a sequence above it is not
    computed: its rows come out NaN). ``max_kv_len`` (default: ``meta.max_blocks * page_size``, what the plugin
    knows) and the workspace only decide how much the launcher may split long sequences; without a workspace
    nothing is split. Raises ``pagedkv._lib.CapiError`` naming the field and the value on bad parameters.
    """
    if max_kv_len is None:
        max_kv_len = meta.max_blocks * cfg.pool.page_size
    launch_attention(attention_params(
        cfg, io_dtype=io_dtype, num_tokens=meta.num_tokens, num_seqs=meta.num_seqs, max_blocks=meta.max_blocks,
        max_q_len=max_q_len, max_kv_len=max_kv_len, q=q, out=out, pool_descs=meta.pool_descs,
        block_table=meta.block_table, cu_q_lens=meta.cu_q_lens, past_lens=meta.past_lens, workspace=workspace,
        workspace_bytes=workspace_bytes), stream)


def attention_workspace_bytes(num_tokens: int, num_seqs: int, num_q_heads: int, head_dim: int, max_kv_len: int,
                              page_size: int) -> int:
    """Workspace bytes a launch within these bounds needs (0: none)."""
    n = _capi().pagedkv_attention_workspace_bytes(num_tokens, num_seqs, num_q_heads, head_dim, max_kv_len, page_size)
    if n < 0:
        _lib.check(-1, "pagedkv_attention_workspace_bytes")
    return int(n)


# The decode kernel's CTA widths (warps per CTA), in the order of the C API's per-width arrays
# (attention_schedule.h: kDecodeWidthWarps; kernel_shapes' decode_width_threads reports them and a test checks this
# mirror against it).
DECODE_WIDTHS = (2, 4, 8)


def kernel_shapes(io_dtype: IODType, cache_dtype: CacheDType, head_dim: int) -> dict:
    """Threads and dynamic shared memory per CTA of the decode and multi-token kernels serving these dtypes and
    head dim, as compiled (no GPU needed): ``{"decode_threads", "decode_smem_bytes", "multi_threads",
    "multi_smem_bytes", "decode_width_smem_bytes", "decode_width_threads"}``; the decode kernel's at its default
    width, and at each width of DECODE_WIDTHS in the last two (lists; 0: not compiled for these dtypes and head dim).
    A launch on a GPU whose per-block limit is below every width it could run fails, naming the sizes."""
    info_type = _structs.struct("PagedKVAttentionKernelShapes")
    info = info_type()
    _lib.check(_capi().pagedkv_attention_kernel_shapes(int(io_dtype), int(cache_dtype), head_dim, ctypes.byref(info)),
               "pagedkv_attention_kernel_shapes")
    return _as_dict(info)


def _decode_occupancies(params: ctypes.Structure, decode_ctas_per_sm: int | Sequence[int]) -> ctypes.Array:
    """The C API's per-width decode occupancies: a sequence gives one per DECODE_WIDTHS entry; a single number is
    the occupancy of the instance's default width alone (the others taken as not hosted)."""
    if isinstance(decode_ctas_per_sm, int):
        shapes = kernel_shapes(IODType(params.ioDType), CacheDType(params.cacheDType), params.headDim)
        per_width = [decode_ctas_per_sm if w * 32 == shapes["decode_threads"] else 0 for w in DECODE_WIDTHS]
    else:
        per_width = [int(n) for n in decode_ctas_per_sm]
        if len(per_width) != len(DECODE_WIDTHS):
            raise ValueError(f"decode_ctas_per_sm={list(per_width)}: expected one occupancy per width {DECODE_WIDTHS}")
    return (ctypes.c_int32 * len(DECODE_WIDTHS))(*per_width)


def attention_plan(params: ctypes.Structure, *, sm_count: int = 132, decode_ctas_per_sm: int | Sequence[int] = 2,
                   multi_ctas_per_sm: int = 2, decode_chunks: int = 0) -> dict:
    """The launcher's scheduling decision for ``params`` on a device with ``sm_count`` SMs (no GPU needed).
    ``decode_ctas_per_sm``: the decode kernel's occupancy per width of DECODE_WIDTHS (0: not hosted), or one number
    for the default width alone. ``decode_chunks`` > 0: the decode split forced, as PAGEDKV_DECODE_CHUNKS forces it
    at a launch."""
    info_type = _structs.struct("PagedKVAttentionPlanInfo")
    info = info_type()
    rc = _capi().pagedkv_attention_plan(ctypes.byref(params), sm_count, _decode_occupancies(params, decode_ctas_per_sm),
                                        multi_ctas_per_sm, decode_chunks, ctypes.byref(info))
    _lib.check(rc, "pagedkv_attention_plan")
    return _as_dict(info)


def device_plan(params: ctypes.Structure) -> dict:
    """The plan a launch of ``params`` makes on the current CUDA device (its occupancy queries; launches nothing):
    what attention_plan returns for that device's facts, PAGEDKV_DECODE_WARPS and PAGEDKV_DECODE_CHUNKS included."""
    info = _structs.struct("PagedKVAttentionPlanInfo")()
    _lib.check(_capi().pagedkv_attention_device_plan(ctypes.byref(params), ctypes.byref(info)),
               "pagedkv_attention_device_plan")
    return _as_dict(info)


def _as_dict(info: ctypes.Structure) -> dict:
    """A C API record as a dict of its fields, array fields (grids, per-width values) as lists."""
    values = {name: getattr(info, name) for name, _ in type(info)._fields_}
    return {name: list(v) if isinstance(v, ctypes.Array) else v for name, v in values.items()}


def _host_ptr(a: np.ndarray) -> int:
    return a.ctypes.data if a.size else 0


def schedule_check(cfg: AttentionConfig, meta: StepMetadata, num_blocks: int, *, io_dtype: IODType = IODType.FP16,
                   max_q_len: int | None = None, max_kv_len: int | None = None, sm_count: int = 132,
                   decode_ctas_per_sm: int | Sequence[int] = 2, multi_ctas_per_sm: int = 2, decode_chunks: int = 0,
                   workspace_bytes: int | None = None,
                   max_pos: int | None = None) -> dict[str, np.ndarray]:
    """Host replay of the kernels' work decomposition on ``meta`` (see capi_attention.h). Returns
    ``coverage`` [T, H, max_pos] and ``direct_writes`` / ``partial_writes`` / ``merged_chunks`` / ``poisoned`` [T, H]."""
    T, H = meta.num_tokens, cfg.num_q_heads
    max_q_len = int(meta.q_lens.max(initial=0)) if max_q_len is None else int(max_q_len)
    max_kv_len = int(meta.kv_lens.max(initial=0)) if max_kv_len is None else int(max_kv_len)
    if workspace_bytes is None:
        workspace_bytes = attention_workspace_bytes(T, meta.num_seqs, H, cfg.pool.head_dim, max_kv_len,
                                                    cfg.pool.page_size)
    max_pos = int(max_pos) if max_pos is not None else max(int(meta.kv_lens.max(initial=0)), 1)
    block_table = np.ascontiguousarray(meta.block_table, dtype=np.int32)
    cu, past = meta.cu_q_lens, meta.past_lens
    params = attention_params(cfg, io_dtype=io_dtype, num_tokens=T, num_seqs=meta.num_seqs,
                              max_blocks=meta.max_blocks, max_q_len=max_q_len, max_kv_len=max_kv_len,
                              block_table=_host_ptr(block_table), cu_q_lens=_host_ptr(cu), past_lens=_host_ptr(past),
                              workspace_bytes=workspace_bytes)
    out = {"coverage": np.zeros((T, H, max_pos), np.int32)}
    for name in ("direct_writes", "partial_writes", "merged_chunks", "poisoned"):
        out[name] = np.zeros((T, H), np.int32)
    i32p = ctypes.POINTER(ctypes.c_int32)
    ptr = {k: v.ctypes.data_as(i32p) for k, v in out.items()}
    rc = _capi().pagedkv_attention_schedule_check(
        ctypes.byref(params), int(num_blocks), sm_count, _decode_occupancies(params, decode_ctas_per_sm),
        multi_ctas_per_sm, decode_chunks, max_pos,
        ptr["coverage"], ptr["direct_writes"], ptr["partial_writes"], ptr["merged_chunks"], ptr["poisoned"])
    _lib.check(rc, "pagedkv_attention_schedule_check")
    return out


def paged_attention_numpy(q: np.ndarray, meta: StepMetadata, pool: np.ndarray, cfg: AttentionConfig, *,
                          io_dtype: IODType | None = None, max_q_len: int | None = None,
                          max_kv_len: int | None = None, workspace_bytes: int | None = None,
                          stream=None) -> np.ndarray:
    """Run the kernels on host arrays; returns ``out`` [T, H, D] in the compute dtype.

    ``io_dtype`` defaults to q's dtype (required when q is fp8). ``max_q_len`` / ``max_kv_len`` default to the
    exact maxima (pass looser bounds to mimic the TensorRT plugin, which only knows T and MB * page_size).
    The output buffer is filled with NaN first, so a row no kernel wrote shows up as NaN.
    """
    from pagedkv import cuda

    H, D = cfg.num_q_heads, cfg.pool.head_dim
    T = meta.num_tokens
    q = np.ascontiguousarray(q).reshape(T, H * D)
    if io_dtype is None:
        if cfg.q_fp8:
            raise ValueError("io_dtype: required when q is fp8 (cfg.q_fp8)")
        io_dtype = IODType.from_numpy(q.dtype)
    expected_pool = cfg.pool.layout().pool_shape(pool.shape[0])
    if pool.shape != expected_pool or pool.dtype != cfg.pool.cache_dtype.numpy_dtype:
        raise ValueError(f"pool: expected shape {expected_pool} dtype {cfg.pool.cache_dtype.numpy_dtype}, "
                         f"got {pool.shape} {pool.dtype}")
    if CacheDType(cfg.pool.cache_dtype) in (CacheDType.FP16, CacheDType.BF16) and not cfg.q_fp8 \
            and q.dtype != cfg.pool.cache_dtype.numpy_dtype:
        raise ValueError(f"q: dtype {q.dtype} must match the 16-bit cache dtype {cfg.pool.cache_dtype.numpy_dtype}")
    num_blocks = pool.shape[0]
    if T == 0:
        return np.empty((0, H, D), IODType(io_dtype).numpy_dtype)
    max_q_len = int(meta.q_lens.max()) if max_q_len is None else int(max_q_len)
    max_kv_len = int(meta.kv_lens.max()) if max_kv_len is None else int(max_kv_len)
    if workspace_bytes is None:
        workspace_bytes = attention_workspace_bytes(T, meta.num_seqs, H, D, max_kv_len, cfg.pool.page_size)
    out_dtype = IODType(io_dtype).numpy_dtype

    buffers = []

    def upload(a: np.ndarray) -> int:
        buf = cuda.DeviceBuffer.from_array(np.ascontiguousarray(a))
        buffers.append(buf)
        return buf.ptr

    try:
        pool_ptr = upload(pool)
        descs = np.zeros((cfg.pool.pool_index + 1, POOL_DESC_FIELDS), np.int64)
        descs[cfg.pool.pool_index, POOL_DESC_ADDRESS] = pool_ptr
        descs[cfg.pool.pool_index, POOL_DESC_NUM_BLOCKS] = num_blocks
        out_buf = cuda.DeviceBuffer(T * H * D * out_dtype.itemsize)
        buffers.append(out_buf)
        out_buf.fill_bytes(0xFF)  # NaN in fp16 and bf16
        ws = cuda.DeviceBuffer(workspace_bytes) if workspace_bytes else None
        if ws is not None:
            buffers.append(ws)
        params = attention_params(
            cfg, io_dtype=io_dtype, num_tokens=T, num_seqs=meta.num_seqs, max_blocks=meta.max_blocks,
            max_q_len=max_q_len, max_kv_len=max_kv_len, q=upload(q), out=out_buf.ptr, pool_descs=upload(descs),
            block_table=upload(meta.block_table), cu_q_lens=upload(meta.cu_q_lens), past_lens=upload(meta.past_lens),
            workspace=ws.ptr if ws is not None else 0, workspace_bytes=workspace_bytes)
        # The uploads and the NaN fill ran on the legacy default stream (a pageable cudaMemcpy may return before
        # its DMA lands), which a non-blocking stream does not wait for: finish them before the launch.
        cuda.synchronize()
        if stream is not None:
            launch_attention(params, stream.handle)
            stream.synchronize()
        else:
            with cuda.Stream() as own:
                launch_attention(params, own.handle)
                own.synchronize()
        return out_buf.download((T, H, D), out_dtype)
    finally:
        for buf in buffers:
            buf.close()
