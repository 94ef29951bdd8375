"""The C++ KV manager (``libpagedkv_runtime.so``, ``plugins/runtime``) through ctypes.

``NativeKVManager`` has the bookkeeping API of ``KVCacheManager`` with ``storage="none"`` (the host model):
the same operations, the same block ids, the same ``StepBatch`` arrays, the same exceptions with the same
messages. ``tests/test_kvcache_native.py`` runs both managers on one random trace and compares them after
every operation; ``docs/runtime-cpp.md`` describes the C++ side. Sequence ids are Python ints (int64).

    mgr = NativeKVManager([spec], num_blocks=1024, enable_prefix_reuse=True)
    mgr.add_sequence(7, prompt)
    mgr.reserve(7, 16)
    step = mgr.build_step([(7, 16)])     # a pagedkv.kvcache.StepBatch
    mgr.commit(7, 16, prompt[:16])
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterable, Sequence

import numpy as np

from pagedkv import _lib
from pagedkv.kernels._structs import struct_mirrors
from pagedkv.kvcache.copies import BlockCopy, Tier
from pagedkv.kvcache.errors import BlockRefcountError, KVCacheError, KVCacheExhaustedError, KVInvariantError
from pagedkv.pool_group import PoolGroup
from pagedkv.kvcache.manager import _per_group, split_step_entries
from pagedkv.kvcache.metadata import GroupStep, StepBatch
from pagedkv.step import POOL_DESC_FIELDS, StepMetadata

_i32, _i64, _str = ctypes.c_int32, ctypes.c_int64, ctypes.c_char_p
_i32p, _i64p = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int64)

# pagedkv_kv_status (plugins/include/pagedkv/runtime/kv_capi.h)
OK, EXHAUSTED, INVALID_ARGUMENT, UNKNOWN_SEQUENCE, REFCOUNT, INVARIANT, INTERNAL = range(7)


# The C API's structs (plugins/include/pagedkv/runtime/kv_capi.h), as ctypes mirrors built from the library's own
# description of them (pagedkv_kv_struct_layouts; pagedkv.kernels._structs checks every offset), never by hand.
_STRUCTS = {"KVError": "pagedkv_kv_error", "GroupDesc": "pagedkv_kv_group_desc", "GroupStats": "pagedkv_kv_group_stats",
            "SeqInfo": "pagedkv_kv_seq_info", "Copy": "pagedkv_kv_block_copy", "StepShape": "pagedkv_kv_step_shape",
            "StepBuffers": "pagedkv_kv_step_buffers", "GroupStepBuffers": "pagedkv_kv_group_step_buffers"}


@functools.lru_cache(maxsize=None)
def _runtime() -> ctypes.CDLL:
    lib = _lib.runtime()
    T = lib.structs = struct_mirrors(lib.pagedkv_kv_struct_layouts, _STRUCTS)
    h, seq = ctypes.c_void_p, _i64
    return _lib.declare(lib, {
        "pagedkv_kv_last_error": ([], ctypes.POINTER(T.KVError)),
        "pagedkv_kv_create": ([ctypes.POINTER(T.GroupDesc), _i32, _i32, ctypes.POINTER(h)], _i32),
        "pagedkv_kv_destroy": ([h], None),
        "pagedkv_kv_add_sequence": ([h, seq, _i32p, _i32, ctypes.c_char_p, ctypes.c_size_t, _i32p], _i32),
        "pagedkv_kv_reserve": ([h, seq, _i32], _i32),
        "pagedkv_kv_unreserve": ([h, seq], _i32),
        "pagedkv_kv_commit": ([h, seq, _i32, _i32p, _i64], _i32),
        "pagedkv_kv_free": ([h, seq], _i32),
        "pagedkv_kv_fork": ([h, seq, seq], _i32),
        "pagedkv_kv_swap_out": ([h, seq], _i32),
        "pagedkv_kv_swap_in": ([h, seq], _i32),
        "pagedkv_kv_reserve_many": ([h, _i64p, _i32p, _i32, _i32p], _i32),
        "pagedkv_kv_reserve_all": ([h, _i64p, _i32p, _i32], _i32),
        "pagedkv_kv_commit_many": ([h, _i64p, _i32p, _i32p, _i32, _i32p], _i32),
        "pagedkv_kv_contains": ([h, seq], _i32),
        "pagedkv_kv_sequences": ([h, _i64p, _i32, _i32p], _i32),
        "pagedkv_kv_sequence_info": ([h, seq, ctypes.POINTER(T.SeqInfo)], _i32),
        "pagedkv_kv_block_list": ([h, seq, _i32, _i32p, _i32, _i32p], _i32),
        "pagedkv_kv_stats": ([h, _i32, ctypes.POINTER(T.GroupStats)], _i32),
        "pagedkv_kv_free_list": ([h, _i32, _i32, _i32p, _i32, _i32p], _i32),
        "pagedkv_kv_cached_blocks": ([h, _i32, _i32p, _i32, _i32p], _i32),
        "pagedkv_kv_drain_copies": ([h, ctypes.POINTER(T.Copy), _i64, _i64p], _i32),
        "pagedkv_kv_plan_step": ([h, _i64p, _i32p, _i32, ctypes.POINTER(T.StepShape), _i32p, _i32p], _i32),
        "pagedkv_kv_write_step": ([h, ctypes.POINTER(T.StepBuffers), ctypes.POINTER(T.GroupStepBuffers)], _i32),
        "pagedkv_kv_pool_descriptors": ([h, ctypes.POINTER(ctypes.c_uint64), _i64p], _i32),
        "pagedkv_kv_validate": ([h], _i32),
    })


def group_descs(groups: Sequence[PoolGroup], num_blocks: Sequence[int], host_blocks: Sequence[int]):
    """The C API's pagedkv_kv_group_desc array of ``groups`` (names kept alive by the array's ``_names``)."""
    T = _runtime().structs
    names = [g.name.encode() for g in groups]
    descs = (T.GroupDesc * len(names))(*[
        T.GroupDesc(name, g.layout.num_layers, g.layout.num_kv_heads, g.layout.page_size, g.layout.head_dim,
                    int(g.layout.page_layout), g.layout.ring_sink_tokens, g.layout.cyclic_len, int(g.cache_dtype),
                    g.window, g.attention_sinks, nb, hb)
        for name, g, nb, hb in zip(names, groups, num_blocks, host_blocks)])
    descs._names = names
    return descs


def _text(raw: bytes | None) -> str:
    return raw.decode() if raw else ""


def _check(rc: int) -> None:
    """Raise the Python manager's exception for a failed C API call."""
    if rc == OK:
        return
    err = _runtime().pagedkv_kv_last_error().contents
    message, seq = _text(err.message), (int(err.seq) if err.has_seq else None)
    if rc == EXHAUSTED:
        raise KVCacheExhaustedError(needed=int(err.needed), free=int(err.free), group=_text(err.group),
                                    tier="primary" if err.tier == 0 else "secondary", seq=seq, what=_text(err.what))
    if rc == INVALID_ARGUMENT:
        raise ValueError(message)
    if rc == UNKNOWN_SEQUENCE:
        raise KeyError(message)
    if rc == REFCOUNT:
        raise BlockRefcountError(message, int(err.block), int(err.refcount))
    if rc == INVARIANT:
        raise KVInvariantError(_text(err.check), _text(err.detail), seq=seq, group=_text(err.group) or None,
                               page=int(err.page) if err.has_page else None,
                               block=int(err.block) if err.has_block else None, expected=_text(err.expected),
                               found=_text(err.found))
    raise KVCacheError(f"C++ KV manager: {message}")


def _ptr(array: np.ndarray, ctype=_i32):
    return array.ctypes.data_as(ctypes.POINTER(ctype))


def _int32_tokens(tokens, message: str) -> np.ndarray:
    """Token ids as int32 (the C++ manager's type); ``ValueError(message)`` for ids outside int32."""
    ids = np.asarray(tokens, dtype=np.int64).ravel()
    if ids.size and (ids.min() < -2 ** 31 or ids.max() >= 2 ** 31):
        raise ValueError(message)
    return np.ascontiguousarray(ids, dtype=np.int32)


class NativeKVManager(_lib.NativeHandle):
    """The C++ KV manager for ``groups`` (``PoolGroup``), ``num_blocks`` / ``host_blocks`` per group (or
    one count for all). Bookkeeping only: ``drain_copies()`` gives the block copies a device backend runs.
    ``close()`` or ``with`` frees it."""

    def __init__(self, groups: Sequence[PoolGroup], num_blocks, *, host_blocks=0,
                 enable_prefix_reuse: bool = False):
        self.groups: tuple[PoolGroup, ...] = tuple(groups)
        if not self.groups:
            raise ValueError("groups: at least one pool group is needed")
        G = len(self.groups)
        self.num_blocks = _per_group(num_blocks, G, "num_blocks")
        self.host_blocks = _per_group(host_blocks, G, "host_blocks")
        self._lib = _runtime()
        self._h = ctypes.c_void_p()
        _check(self._lib.pagedkv_kv_create(group_descs(self.groups, self.num_blocks, self.host_blocks), G,
                                           int(bool(enable_prefix_reuse)), ctypes.byref(self._h)))
        self.prefix_reuse = bool(enable_prefix_reuse)

    @classmethod
    def borrowed(cls, handle: ctypes.c_void_p, groups, num_blocks: list[int], host_blocks: list[int],
                 enable_prefix_reuse: bool) -> "NativeKVManager":
        """A manager another C++ object owns (``pagedkv_rt_engine_kv``): close() frees the handle only."""
        mgr = cls.__new__(cls)
        mgr.groups, mgr.num_blocks, mgr.host_blocks = tuple(groups), list(num_blocks), list(host_blocks)
        mgr._lib, mgr._h, mgr.prefix_reuse = _runtime(), handle, bool(enable_prefix_reuse)
        return mgr

    def _release(self) -> None:
        self._lib.pagedkv_kv_destroy(self._h)

    # ---- sequences -----------------------------------------------------------------------------------
    def add_sequence(self, seq_id: int, prompt_tokens=None, *, salt: bytes = b"") -> int:
        prompt = np.zeros(0, dtype=np.int32)
        if prompt_tokens is not None and seq_id not in self:  # (an existing id: the C++ side says so)
            prompt = _int32_tokens(prompt_tokens, "prompt_tokens: token ids must fit int32")
        reused = _i32()
        _check(self._lib.pagedkv_kv_add_sequence(self._h, seq_id, _ptr(prompt), prompt.size, bytes(salt), len(salt),
                                                 ctypes.byref(reused)))
        return reused.value

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        _check(self._lib.pagedkv_kv_reserve(self._h, seq_id, int(num_tokens)))

    def unreserve(self, seq_id: int) -> None:
        _check(self._lib.pagedkv_kv_unreserve(self._h, seq_id))

    def commit(self, seq_id: int, num_tokens: int, token_ids=None) -> None:
        if token_ids is None:
            _check(self._lib.pagedkv_kv_commit(self._h, seq_id, int(num_tokens), None, -1))
            return
        # (the Python manager checks the range after the reservation and the count; here it comes first)
        ids = _int32_tokens(token_ids, f"commit: token_ids of sequence {seq_id!r} must fit int32")
        _check(self._lib.pagedkv_kv_commit(self._h, seq_id, int(num_tokens), _ptr(ids), ids.size))

    def free(self, seq_id: int) -> None:
        _check(self._lib.pagedkv_kv_free(self._h, seq_id))

    def fork(self, src_id: int, dst_id: int) -> None:
        _check(self._lib.pagedkv_kv_fork(self._h, src_id, dst_id))

    def swap_out(self, seq_id: int) -> None:
        _check(self._lib.pagedkv_kv_swap_out(self._h, seq_id))

    def swap_in(self, seq_id: int) -> None:
        _check(self._lib.pagedkv_kv_swap_in(self._h, seq_id))

    def reserve_many(self, seq_ids: Sequence[int], counts: Sequence[int]) -> None:
        """``reserve`` for each sequence in order, in one call (stops at the first failure, which raises)."""
        ids, n = np.ascontiguousarray(seq_ids, dtype=np.int64), np.ascontiguousarray(counts, dtype=np.int32)
        _check(self._lib.pagedkv_kv_reserve_many(self._h, _ptr(ids, _i64), _ptr(n), ids.size, None))

    def reserve_all(self, seq_ids: Sequence[int], counts: Sequence[int]) -> None:
        """``KVCacheManager.reserve_many``: every sequence or none (``KVManager::reserveMany``)."""
        ids, n = np.ascontiguousarray(seq_ids, dtype=np.int64), np.ascontiguousarray(counts, dtype=np.int32)
        _check(self._lib.pagedkv_kv_reserve_all(self._h, _ptr(ids, _i64), _ptr(n), ids.size))

    def commit_many(self, seq_ids: Sequence[int], counts: Sequence[int], token_ids=None) -> None:
        """``commit`` for each sequence in order; ``token_ids``: all sequences' ids back to back, or None."""
        ids, n = np.ascontiguousarray(seq_ids, dtype=np.int64), np.ascontiguousarray(counts, dtype=np.int32)
        toks = None if token_ids is None else _int32_tokens(token_ids, "commit_many: token ids must fit int32")
        if toks is not None and toks.size != int(n.sum()):
            raise ValueError(f"commit_many: token_ids has {toks.size} entries for {int(n.sum())} tokens")
        _check(self._lib.pagedkv_kv_commit_many(self._h, _ptr(ids, _i64), _ptr(n), None if toks is None else _ptr(toks),
                                                ids.size, None))

    # ---- queries -------------------------------------------------------------------------------------
    def __contains__(self, seq_id) -> bool:
        return isinstance(seq_id, int) and bool(self._lib.pagedkv_kv_contains(self._h, seq_id))

    @property
    def sequences(self) -> list[int]:
        count = _i32()
        _check(self._lib.pagedkv_kv_sequences(self._h, None, 0, ctypes.byref(count)))
        out = np.zeros(count.value, dtype=np.int64)
        _check(self._lib.pagedkv_kv_sequences(self._h, _ptr(out, _i64), out.size, ctypes.byref(count)))
        return out.tolist()

    def _info(self, seq_id: int):
        info = _runtime().structs.SeqInfo()
        _check(self._lib.pagedkv_kv_sequence_info(self._h, seq_id, ctypes.byref(info)))
        return info

    def length(self, seq_id: int) -> int:
        return self._info(seq_id).length

    def reserved(self, seq_id: int) -> int:
        return self._info(seq_id).reserved

    def prefill_remaining(self, seq_id: int) -> int:
        return self._info(seq_id).prefill_remaining

    def is_swapped(self, seq_id: int) -> bool:
        return bool(self._info(seq_id).swapped)

    def _list(self, fn, *args) -> np.ndarray:
        count = _i32()
        _check(fn(self._h, *args, None, 0, ctypes.byref(count)))
        out = np.zeros(count.value, dtype=np.int32)
        _check(fn(self._h, *args, _ptr(out), out.size, ctypes.byref(count)))
        return out

    def block_row(self, seq_id: int, group: int = 0) -> np.ndarray:
        """The sequence's block list in ``group`` (-1 where released or swapped out)."""
        return self._list(self._lib.pagedkv_kv_block_list, seq_id, group)

    def num_pages(self, seq_id: int, group: int = 0) -> int:
        return int(self.block_row(seq_id, group).size)

    def stats(self, group: int = 0):
        out = _runtime().structs.GroupStats()
        _check(self._lib.pagedkv_kv_stats(self._h, group, ctypes.byref(out)))
        return out

    def num_free(self, group: int = 0) -> int:
        return self.stats(group).num_free

    def free_list(self, group: int = 0, tier: Tier = Tier.PRIMARY) -> list[int]:
        """Free blocks from the head (handed out next) to the tail."""
        return self._list(self._lib.pagedkv_kv_free_list, group, int(tier)).tolist()

    def cached_blocks(self, group: int = 0) -> list[int]:
        """Blocks registered in the prefix cache (held or free), ascending."""
        return self._list(self._lib.pagedkv_kv_cached_blocks, group).tolist()

    def drain_copies(self) -> list[BlockCopy]:
        """The block copies recorded since the last drain, oldest first."""
        count = _i64()
        _check(self._lib.pagedkv_kv_drain_copies(self._h, None, 0, ctypes.byref(count)))
        out = (self._lib.structs.Copy * count.value)()
        _check(self._lib.pagedkv_kv_drain_copies(self._h, out, count.value, ctypes.byref(count)))
        return [BlockCopy(c.group, Tier(c.src_tier), c.src_block, Tier(c.dst_tier), c.dst_block, c.num_tokens)
                for c in out]

    # ---- step metadata -------------------------------------------------------------------------------
    def build_step(self, entries: Iterable, position_ids=None) -> StepBatch:
        """As ``KVCacheManager.build_step``: sequence ids (their whole reservation) or ``(seq_id, n)`` pairs."""
        ids, counts = split_step_entries(entries)
        seq = np.asarray(ids, dtype=np.int64).reshape(-1)
        num_new = np.asarray(counts, dtype=np.int32).reshape(-1)
        G, T = len(self.groups), self._lib.structs
        shape, mb, nnz = T.StepShape(), np.zeros(G, dtype=np.int32), np.zeros(G, dtype=np.int32)
        _check(self._lib.pagedkv_kv_plan_step(self._h, _ptr(seq, _i64), _ptr(num_new), seq.size, ctypes.byref(shape),
                                              _ptr(mb), _ptr(nnz)))
        B, num_tokens = shape.num_seqs, shape.num_tokens
        shared = {name: np.empty(n, dtype=np.int32) for name, n in
                  (("cu_q_lens", B + 1), ("past_lens", B), ("q_lens", B), ("kv_lens", B), ("token_seq", num_tokens),
                   ("positions", num_tokens))}
        per_group = [{"block_table": np.empty((B, int(mb[g])), dtype=np.int32), "num_pages": np.empty(B, np.int32),
                      "last_page_lens": np.empty(B, np.int32), "kv_indptr": np.empty(B + 1, np.int32),
                      "kv_indices": np.empty(int(nnz[g]), np.int32)} for g in range(G)]
        buffers = T.StepBuffers(*[shared[name].ctypes.data for name, _ in T.StepBuffers._fields_])
        group_buffers = (T.GroupStepBuffers * G)(*[T.GroupStepBuffers(*[arrays[name].ctypes.data
                                                                        for name, _ in T.GroupStepBuffers._fields_])
                                                   for arrays in per_group])
        _check(self._lib.pagedkv_kv_write_step(self._h, ctypes.byref(buffers), group_buffers))
        if position_ids is not None:
            position_ids = np.ascontiguousarray(position_ids, dtype=np.int32)
        groups = []
        for g, (spec, arrays) in enumerate(zip(self.groups, per_group)):
            meta = StepMetadata(block_table=arrays["block_table"], cu_q_lens=shared["cu_q_lens"],
                                past_lens=shared["past_lens"], position_ids=position_ids)
            groups.append(GroupStep(spec.name, g, meta, arrays["num_pages"], arrays["last_page_lens"],
                                    arrays["kv_indptr"], arrays["kv_indices"]))
        return StepBatch(seq_ids=tuple(ids), cu_q_lens=shared["cu_q_lens"], past_lens=shared["past_lens"],
                         q_lens=shared["q_lens"], kv_lens=shared["kv_lens"], token_seq=shared["token_seq"],
                         positions=shared["positions"], position_ids=position_ids, groups=tuple(groups),
                         max_q_len=shape.max_q_len, max_kv_len=shape.max_kv_len)

    def pool_descriptors(self, addresses: Sequence[int]) -> np.ndarray:
        """The ``kv_pools`` engine input for pools at ``addresses``: INT64 [G, POOL_DESC_FIELDS]."""
        if len(addresses) != len(self.groups):
            raise ValueError(f"kv_pools: {len(addresses)} addresses for {len(self.groups)} pools")
        addr = np.asarray(addresses, dtype=np.uint64)
        out = np.zeros((len(self.groups), POOL_DESC_FIELDS), dtype=np.int64)
        _check(self._lib.pagedkv_kv_pool_descriptors(self._h, _ptr(addr, ctypes.c_uint64), _ptr(out, _i64)))
        return out

    # ---- the kv doctor -------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check every invariant; raises ``KVInvariantError`` naming the first violation."""
        _check(self._lib.pagedkv_kv_validate(self._h))
