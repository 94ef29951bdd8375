"""The C++ runtime's host side (``libpagedkv_runtime.so``, ``plugins/runtime``) through ctypes: the engine and its
scheduler over a caller-driven host executor, the SplitMix64 draws, the block-copy geometry.

``NativeEngine`` is the C++ ``Engine`` (plugins/include/pagedkv/runtime/engine.h) with the device's part of a step
left to the caller: ``begin_step()`` schedules the next step and returns its engine inputs by their
``pagedkv.engine_io`` names (what an executor would upload), the caller computes the sampled tokens, and
``end_step(tokens)`` commits them. ``tests/test_runtime_native.py`` runs one request trace through it and through
the Python ``Engine`` and compares every step: the schedule, the engine inputs byte for byte, the KV manager's
block tables and free lists, the outputs and stops.

    eng = NativeEngine([group], num_blocks=64, vocab=32000, config=SchedulerConfig(max_num_seqs=8))
    eng.add_request(1, [5, 6, 7], SamplingParams(max_new_tokens=4))
    while (step := eng.begin_step()) is not None:
        eng.end_step(my_tokens(step.feed))         # int32 [R]: one token per logits row
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from pagedkv import _lib
from pagedkv import engine_io as io
from pagedkv.kernels._structs import struct_mirrors
from pagedkv.kvcache.native import NativeKVManager, _check, _ptr, _runtime as _kv_runtime, group_descs
from pagedkv.pool_group import PoolGroup
from pagedkv.runtime.request import ContextLengthError, FinishReason, RequestState
from pagedkv.runtime.sampling import SamplingParams
from pagedkv.runtime.scheduler import PREEMPTION_MODES, SchedulerConfig
from pagedkv.trt_library import TensorRTUnavailable

_i32, _i64, _u64 = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64
_STRUCTS = {"ModelInfo": "pagedkv_rt_model_info", "EngineConfig": "pagedkv_rt_engine_config",
            "SamplingParams": "pagedkv_rt_sampling_params", "StepView": "pagedkv_rt_step_view",
            "RequestInfo": "pagedkv_rt_request_info", "Stats": "pagedkv_rt_stats"}
_STATES = {0: RequestState.WAITING, 1: RequestState.RUNNING, 2: RequestState.SWAPPED, 3: RequestState.FINISHED}
_REASONS = {0: None, 1: FinishReason.STOP, 2: FinishReason.LENGTH, 3: FinishReason.ABORT}


@functools.lru_cache(maxsize=None)
def _lib_rt() -> ctypes.CDLL:
    lib = _kv_runtime()  # (the same library, its pagedkv_kv_* signatures declared)
    T = lib.rt = struct_mirrors(lib.pagedkv_rt_struct_layouts, _STRUCTS)
    h, p = ctypes.c_void_p, ctypes.POINTER
    return _lib.declare(lib, {
        "pagedkv_rt_uniforms": ([p(_u64), p(_u64), _i64, p(ctypes.c_double), p(ctypes.c_float)], _i32),
        "pagedkv_rt_derive_seeds": ([_u64, p(_u64), _i64, p(_u64)], _i32),
        "pagedkv_rt_copy_plan": ([p(lib.structs.GroupDesc), _i32, p(_i64), p(_i64), p(_i64)], _i32),
        "pagedkv_rt_engine_create": ([p(lib.structs.GroupDesc), _i32, _i32, p(T.ModelInfo), p(T.EngineConfig), p(h)],
                                     _i32),
        "pagedkv_rt_engine_destroy": ([h], None),
        "pagedkv_rt_engine_kv": ([h, p(h)], _i32),
        "pagedkv_rt_engine_add_request": ([h, _i64, p(_i32), _i32, p(T.SamplingParams)], _i32),
        "pagedkv_rt_engine_abort": ([h, _i64, p(_i32)], _i32),
        "pagedkv_rt_engine_begin_step": ([h, p(_i32), p(T.StepView)], _i32),
        "pagedkv_rt_engine_end_step": ([h, p(_i32), p(ctypes.c_float), p(_i32), p(ctypes.c_float), _i32], _i32),
        "pagedkv_rt_engine_cancel_step": ([h], _i32),
        "pagedkv_rt_engine_stats": ([h, p(T.Stats)], _i32),
        "pagedkv_rt_engine_request": ([h, _i64, p(T.RequestInfo), p(_i32), _i32], _i32),
        "pagedkv_rt_engine_request_logprobs": ([h, _i64, p(ctypes.c_float), p(_i32), p(ctypes.c_float)], _i32),
        "pagedkv_rt_engine_finished": ([h, p(_i64), _i32, p(_i32)], _i32),
        "pagedkv_rt_engine_release": ([h, _i64], _i32),
        "pagedkv_rt_load_tensorrt": ([ctypes.c_char_p, _i32], _i32),
        "pagedkv_rt_check_plugin_library": ([ctypes.c_char_p], _i32),
        "pagedkv_rt_check_engine_io": ([_i32, p(ctypes.c_char_p), p(_i32), p(_i32), p(_i32), p(_i64), _i32,
                                        p(T.ModelInfo), p(_i32)], _i32),
        "pagedkv_rt_blocks_for_budget": ([p(lib.structs.GroupDesc), _i32, _i64, p(ctypes.c_double), _i32, p(_i64)],
                                         _i32),
    })


class PluginLibraryError(RuntimeError):
    """The plugin library is missing or not ours (C++ ``PluginLibraryError``)."""


class EngineMismatchError(ValueError):
    """An engine's I/O differs from the engine-I/O contract, or it was built for another GPU / TensorRT."""


_RAISES = {7: ContextLengthError, 9: TensorRTUnavailable, 10: PluginLibraryError, 11: EngineMismatchError}


def _call(rc: int) -> None:
    """``_check`` plus the runtime's own statuses (kv_capi.h: PAGEDKV_KV_CONTEXT_LENGTH and up)."""
    if rc in _RAISES:
        raise _RAISES[rc](_kv_runtime().pagedkv_kv_last_error().contents.message.decode())
    _check(rc)


# ---- sampling draws and copy geometry -----------------------------------------------------------------------
def uniforms(seeds, counters) -> tuple[np.ndarray, np.ndarray]:
    """C++'s draws: float64 u [R] and the float32 ``u`` column of ``sampling_params`` (``sampling.h``)."""
    s = np.ascontiguousarray(seeds, dtype=np.uint64)
    c = np.ascontiguousarray(counters, dtype=np.uint64)
    u, col = np.zeros(s.size, np.float64), np.zeros(s.size, np.float32)
    _call(_lib_rt().pagedkv_rt_uniforms(_ptr(s, _u64), _ptr(c, _u64), s.size, _ptr(u, ctypes.c_double),
                                        _ptr(col, ctypes.c_float)))
    return u, col


def derive_seeds(base: int, indices) -> np.ndarray:
    idx = np.ascontiguousarray(indices, dtype=np.uint64)
    out = np.zeros(idx.size, np.uint64)
    _call(_lib_rt().pagedkv_rt_derive_seeds(base, _ptr(idx, _u64), idx.size, _ptr(out, _u64)))
    return out


def copy_plan(group: PoolGroup, num_tokens: int) -> tuple[int, int, int]:
    """C++'s (rows, pitch, width) of copying ``num_tokens`` tokens of one block (``copy_plan.h``)."""
    desc = group_descs([group], [1], [0])
    rows, pitch, width = _i64(), _i64(), _i64()
    _call(_lib_rt().pagedkv_rt_copy_plan(desc, num_tokens, ctypes.byref(rows), ctypes.byref(pitch),
                                         ctypes.byref(width)))
    return rows.value, pitch.value, width.value


# ---- deployment checks (no GPU needed) --------------------------------------------------------------------
_TENSOR_TYPES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, "bfloat16": 2, np.dtype(np.int32): 3,
                 np.dtype(np.int64): 4}
MAX_RANK = 8  # PAGEDKV_RT_MAX_RANK


def load_tensorrt() -> str:
    """What the C++ runtime finds: "TensorRT 10.14.1 (libnvinfer.so.10)"; raises TensorRTUnavailable (one line)."""
    buf = ctypes.create_string_buffer(256)
    _call(_lib_rt().pagedkv_rt_load_tensorrt(buf, len(buf)))
    return buf.value.decode()


def check_plugin_library(path: str) -> None:
    """Raises PluginLibraryError unless ``path`` provides the two pagedkv IPluginV3 creators."""
    _call(_lib_rt().pagedkv_rt_check_plugin_library(str(path).encode()))


def check_engine_io(tensors, num_pool_groups: int = -1) -> tuple[dict, int]:
    """The C++ check of an engine's I/O: ``tensors`` are (name, is_input, dtype, dims) with dtype a numpy dtype or
    "bfloat16" (anything else: a type outside the contract) and dims < 0 dynamic. Returns (the model info as a
    dict, pool groups); raises EngineMismatchError naming every difference."""
    n = len(tensors)
    names = (ctypes.c_char_p * max(n, 1))(*[t[0].encode() for t in tensors])
    is_input = np.array([int(t[1]) for t in tensors], np.int32)
    types = np.array([_TENSOR_TYPES.get(t[2] if t[2] == "bfloat16" else np.dtype(t[2]), 5) for t in tensors],
                     np.int32)
    ranks = np.array([len(t[3]) for t in tensors], np.int32)
    dims = np.zeros((max(n, 1), MAX_RANK), np.int64)
    for i, t in enumerate(tensors):
        dims[i, :len(t[3])] = t[3]
    model, groups = _lib_rt().rt.ModelInfo(), _i32()
    _call(_lib_rt().pagedkv_rt_check_engine_io(n, names, _ptr(is_input), _ptr(types), _ptr(ranks), _ptr(dims, _i64),
                                               num_pool_groups, ctypes.byref(model), ctypes.byref(groups)))
    return {f[0]: int(getattr(model, f[0])) for f in model._fields_}, groups.value


def blocks_for_budget(groups: list[PoolGroup], budget_bytes: int, shares=None) -> list[int]:
    """C++'s ``blocksForBudget`` (the twin of ``pagedkv.kvcache.sizing.blocks_for_budget``)."""
    desc = group_descs(groups, [1] * len(groups), [0] * len(groups))
    split = None if shares is None else np.ascontiguousarray(shares, np.float64)
    out = np.zeros(len(groups), np.int64)
    _call(_lib_rt().pagedkv_rt_blocks_for_budget(desc, len(groups), budget_bytes,
                                                 None if split is None else _ptr(split, ctypes.c_double),
                                                 -1 if split is None else split.size, _ptr(out, _i64)))
    return out.tolist()


# ---- the engine -----------------------------------------------------------------------------------------
@dataclass
class NativeStep:
    """A step begun by ``NativeEngine.begin_step``: the scheduled requests (decodes first) with their new
    tokens, and the engine inputs by ``engine_io`` name (copies, shaped as an engine takes them)."""

    request_ids: list[int]
    counts: list[int]
    num_decodes: int
    decode_only: bool
    feed: dict[str, np.ndarray]


def _array(address: int, count: int, dtype) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=dtype)
    ctype = np.ctypeslib.as_ctypes_type(np.dtype(dtype))
    return np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctype)), shape=(count,)).copy()


class NativeEngine(_lib.NativeHandle):
    """The C++ engine over ``groups`` (``PoolGroup``) with ``num_blocks`` / ``host_blocks`` per group (or one
    count for all), for a model of ``vocab`` tokens (``num_top_logprobs``, ``explicit_positions`` and a static
    block-table width ``max_blocks`` as its engine has them). ``config``, ``max_model_len``, ``eos_token_ids``
    and ``seed`` are the Python ``Engine``'s. ``close()`` or ``with`` frees it (and closes ``kv``)."""

    _kv: NativeKVManager | None = None  # the view ``kv`` hands out, once asked for

    def __init__(self, groups, num_blocks, *, vocab: int, host_blocks=0, enable_prefix_reuse: bool = True,
                 num_top_logprobs: int = 0, explicit_positions: bool = False, max_blocks: int | None = None,
                 config: SchedulerConfig | None = None, max_model_len: int | None = None, eos_token_ids=(),
                 seed: int = 0):
        from pagedkv.kvcache.manager import _per_group

        self.groups = tuple(groups)
        G = len(self.groups)
        self._kv_args = (self.groups, _per_group(num_blocks, G, "num_blocks"), _per_group(host_blocks, G, "host_blocks"),
                         bool(enable_prefix_reuse))
        self._lib = lib = _lib_rt()
        cfg = config or SchedulerConfig()
        model = lib.rt.ModelInfo(vocab, num_top_logprobs, int(explicit_positions), max_blocks or 0, 0)
        self._eos = np.ascontiguousarray(sorted(set(int(t) for t in eos_token_ids)), dtype=np.int32)
        c = lib.rt.EngineConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.chunk_size,
                                PREEMPTION_MODES.index(cfg.preemption), cfg.watermark, max_model_len or 0,
                                self._eos.size, self._eos.ctypes.data, seed)
        self._h = ctypes.c_void_p()
        descs = group_descs(*self._kv_args[:3])
        _call(lib.pagedkv_rt_engine_create(descs, G, int(bool(enable_prefix_reuse)), ctypes.byref(model), ctypes.byref(c),
                                           ctypes.byref(self._h)))
        self.num_top_logprobs = num_top_logprobs

    def _release(self) -> None:
        if self._kv is not None:  # (its handle points into the engine)
            self._kv.close()
            self._kv = None
        self._lib.pagedkv_rt_engine_destroy(self._h)

    @property
    def kv(self) -> NativeKVManager:
        """The engine's KV manager (the pagedkv_kv_* queries; valid while the engine lives)."""
        if self._kv is None:
            handle = ctypes.c_void_p()
            _call(self._lib.pagedkv_rt_engine_kv(self._h, ctypes.byref(handle)))
            self._kv = NativeKVManager.borrowed(handle, *self._kv_args)
        return self._kv

    # ---- requests -----------------------------------------------------------------------------------------
    def add_request(self, request_id: int, prompt_ids, params: SamplingParams | None = None) -> None:
        """Queue a request (``ValueError`` / ``ContextLengthError`` as the Python engine raises them)."""
        params = params or SamplingParams()
        if params.stop:
            raise ValueError(f"request {request_id!r}: stop: stop strings need a tokenizer; the C++ runtime has none "
                             "(use stop_token_ids)")
        prompt = np.ascontiguousarray(np.asarray(prompt_ids).ravel(), dtype=np.int32)
        stop = np.ascontiguousarray(params.stop_token_ids, dtype=np.int32)
        p = self._lib.rt.SamplingParams(
            params.max_new_tokens or 0, params.top_k, params.temperature, params.top_p, params.min_p,
            params.repetition_penalty, params.presence_penalty, params.frequency_penalty, int(params.seed is not None),
            -1 if params.logprobs is None else params.logprobs, params.seed or 0, int(params.ignore_eos), stop.size,
            stop.ctypes.data if stop.size else None)
        _call(self._lib.pagedkv_rt_engine_add_request(self._h, request_id, _ptr(prompt), prompt.size, ctypes.byref(p)))

    def abort(self, request_id: int) -> bool:
        found = _i32()
        _call(self._lib.pagedkv_rt_engine_abort(self._h, request_id, ctypes.byref(found)))
        return bool(found.value)

    def request(self, request_id: int) -> SimpleNamespace:
        """An unfinished or finished (not yet released) request: state, finish_reason, output, logprobs, ..."""
        info = self._lib.rt.RequestInfo()
        _call(self._lib.pagedkv_rt_engine_request(self._h, request_id, ctypes.byref(info), None, 0))
        out = np.zeros(info.num_output, np.int32)
        _call(self._lib.pagedkv_rt_engine_request(self._h, request_id, ctypes.byref(info), _ptr(out), out.size))
        logprobs = np.zeros(info.num_output, np.float32)
        _call(self._lib.pagedkv_rt_engine_request_logprobs(self._h, request_id, _ptr(logprobs, ctypes.c_float), None,
                                                           None))
        return SimpleNamespace(id=request_id, state=_STATES[info.state], finish_reason=_REASONS[info.finish_reason],
                               num_computed=info.num_computed, output=out.tolist(), logprobs=logprobs,
                               num_preemptions=info.num_preemptions, max_tokens=info.max_tokens, seed=info.seed,
                               arrival=info.arrival)

    def top_logprobs(self, request_id: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """int32 / float32 [num_output, k]: the best alternatives of each output token (k = its params' logprobs)."""
        n = len(self.request(request_id).output)
        tokens, lps = np.zeros((n, k), np.int32), np.zeros((n, k), np.float32)
        _call(self._lib.pagedkv_rt_engine_request_logprobs(self._h, request_id, None, _ptr(tokens),
                                                           _ptr(lps, ctypes.c_float)))
        return tokens, lps

    def finished(self) -> list[int]:
        """Ids of the requests finished (or aborted) since the last call."""
        count = _i32()
        _call(self._lib.pagedkv_rt_engine_finished(self._h, None, 0, ctypes.byref(count)))
        ids = np.zeros(count.value, np.int64)
        _call(self._lib.pagedkv_rt_engine_finished(self._h, _ptr(ids, _i64), ids.size, ctypes.byref(count)))
        return ids.tolist()

    def release(self, request_id: int) -> None:
        _call(self._lib.pagedkv_rt_engine_release(self._h, request_id))

    def stats(self) -> SimpleNamespace:
        s = self._lib.rt.Stats()
        _call(self._lib.pagedkv_rt_engine_stats(self._h, ctypes.byref(s)))
        return SimpleNamespace(**{name: getattr(s, name) for name, _ in s._fields_})

    # ---- steps --------------------------------------------------------------------------------------------
    def begin_step(self) -> NativeStep | None:
        """Schedule the next step and write its inputs; None when there is nothing to run."""
        scheduled, v = _i32(), self._lib.rt.StepView()
        _call(self._lib.pagedkv_rt_engine_begin_step(self._h, ctypes.byref(scheduled), ctypes.byref(v)))
        if not scheduled.value:
            return None
        B, T, R, W = v.num_seqs, v.num_tokens, v.num_rows, v.penalty_width
        widths = _array(v.table_width, v.num_groups, np.int32)
        tables = ctypes.cast(v.block_tables, ctypes.POINTER(ctypes.c_void_p))
        feed = {io.INPUT_IDS: _array(v.input_ids, T, np.int64).reshape(1, T),
                io.CU_Q_LENS: _array(v.cu_q_lens, B + 1, np.int32), io.PAST_LENS: _array(v.past_lens, B, np.int32)}
        for g in range(v.num_groups):
            feed[io.block_table_name(g)] = _array(tables[g], B * int(widths[g]), np.int32).reshape(B, int(widths[g]))
        if v.position_ids:
            feed[io.POSITION_IDS] = _array(v.position_ids, T, np.int32)
        feed[io.LOGITS_ROWS] = _array(v.logits_rows, R, np.int32)
        feed[io.SAMPLING_PARAMS] = _array(v.sampling_params, R * io.SAMPLING_FIELDS, np.float32).reshape(R, -1)
        feed[io.PENALTY_TOKENS] = _array(v.penalty_tokens, R * W, np.int32).reshape(R, W)
        feed[io.PENALTY_COUNTS] = _array(v.penalty_counts, R * W, np.float32).reshape(R, W)
        return NativeStep(_array(v.request_ids, B, np.int64).tolist(), _array(v.counts, B, np.int32).tolist(),
                          v.num_decodes, bool(v.decode_only), feed)

    def end_step(self, tokens, logprobs=None, top_tokens=None, top_logprobs=None) -> None:
        """Commit the step begun last with its sampled rows (int32 [R]; float32 [R]; [R, num_top_logprobs])."""
        t = np.ascontiguousarray(tokens, dtype=np.int32)
        lp = None if logprobs is None else np.ascontiguousarray(logprobs, dtype=np.float32)
        tt = None if top_tokens is None else np.ascontiguousarray(top_tokens, dtype=np.int32)
        tl = None if top_logprobs is None else np.ascontiguousarray(top_logprobs, dtype=np.float32)
        k = 0 if tt is None else (tt.shape[1] if tt.ndim == 2 else 0)
        _call(self._lib.pagedkv_rt_engine_end_step(
            self._h, _ptr(t), None if lp is None else _ptr(lp, ctypes.c_float), None if tt is None else _ptr(tt),
            None if tl is None else _ptr(tl, ctypes.c_float), k))

    def cancel_step(self) -> None:
        _call(self._lib.pagedkv_rt_engine_cancel_step(self._h))
