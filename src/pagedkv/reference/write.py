"""The write path in float64: bias + RoPE + quantize + paged K/V write (+ V page-tail zeroing).

The executable spec of ``launchQKVWrite`` (plugins/include/pagedkv/qkv_write.h), in the spirit of
TensorRT-LLM's ``vanilla.py``: per sequence, token i lands at cache position ``past_len + i``, whose
(block, offset) comes from ``KVLayout.locate`` and whose element address from ``KVLayout.elem_offset``.

    T tokens, B sequences, H query heads, KVH KV heads, D head_dim, NB pool blocks
    qkv  [T, (H + 2*KVH) * D]   columns [q heads | k heads | v heads]
    bias [(H + 2*KVH) * D] or None
    pool [NB, L, 2, KVH, P, D] (HND) or [NB, L, 2, P, KVH, D] (NHD), the cache dtype; mutated in place
    returns q_out [T, H, D] float64
"""

from __future__ import annotations

import math

import numpy as np

from pagedkv.config import WriteConfig
from pagedkv.layout import INVALID_BLOCK, CacheDType
from pagedkv.reference._pool import pool_rows, row_index
from pagedkv.reference.quant import dequantize, quantize
from pagedkv.reference.rope import apply_rope
from pagedkv.step import KVWriteError, StepMetadata


class InvalidPageError(KVWriteError):
    """A live token's page is the -1 sentinel, outside the pool, or past the block table's width.
    ``seq``, ``page_in_seq`` and ``entry`` name the first such token (sequence order); nothing was written."""


def _invalid_page_error(seq: int, page: int, entry: int, num_blocks: int, max_blocks: int,
                        pos: int, n_bad: int) -> InvalidPageError:
    if page >= max_blocks:
        reason = f"sequence {seq} needs page {page}, past the block table's width {max_blocks}"
    elif entry == INVALID_BLOCK:
        reason = f"block_table[{seq}][{page}] = {entry} is the invalid-page sentinel"
    else:
        reason = f"block_table[{seq}][{page}] = {entry} is outside the pool [0, {num_blocks})"
    more = f" ({n_bad - 1} more invalid token(s) in this step)" if n_bad > 1 else ""
    return InvalidPageError(f"qkv_write: cache position {pos}: {reason}{more}; nothing was written",
                            seq, page, entry)


def _split_heads(qkv, bias, meta: StepMetadata, cfg: WriteConfig):
    """Validate the activations; return float64 q [T, H, D], k [T, KVH, D], v [T, KVH, D] (bias added)."""
    h, kvh, d = cfg.num_q_heads, cfg.pool.num_kv_heads, cfg.pool.head_dim
    width = (h + 2 * kvh) * d
    qkv = np.asarray(qkv)
    if qkv.shape != (meta.num_tokens, width):
        raise ValueError(f"qkv: expected [T={meta.num_tokens}, (H + 2*KVH) * D = {width}], got {qkv.shape}")
    x = qkv.astype(np.float64)
    if cfg.has_bias != (bias is not None):
        raise ValueError(f"bias: has_bias={int(cfg.has_bias)} but bias is {'missing' if bias is None else 'given'}")
    if bias is not None:
        bias = np.asarray(bias)
        if bias.shape != (width,):
            raise ValueError(f"bias: expected shape ({width},), got {bias.shape}")
        x = x + bias.astype(np.float64)
    x = x.reshape(meta.num_tokens, h + 2 * kvh, d)
    return x[:, :h], x[:, h:h + kvh], x[:, h + kvh:]


def _rope_positions(meta: StepMetadata, cfg: WriteConfig) -> np.ndarray:
    # The plugin has a position_ids input only with explicit_positions; a mismatch would make the reference
    # and the plugin rotate by different positions without either noticing.
    if cfg.explicit_positions and meta.position_ids is None:
        raise ValueError("position_ids: explicit_positions=1 but the step metadata carries no position_ids")
    if not cfg.explicit_positions and meta.position_ids is not None:
        raise ValueError("position_ids: given, but explicit_positions=0 (the plugin would use past_len + i)")
    return meta.rope_positions


def qkv_write(qkv, bias, meta: StepMetadata, pool: np.ndarray, cfg: WriteConfig) -> np.ndarray:
    """Write K (RoPE'd) and V of every token into ``pool`` (in place); return q_out float64 [T, H, D].

    All tokens are located before anything is written: an invalid page for any live token raises
    ``InvalidPageError`` with the pool untouched. ``zero_v_tail`` zeroes, for each sequence whose step has
    more than one token, the V rows of its last page after the last written offset, all KV heads of this
    layer, unless the cache is cyclic and its ring has wrapped (those rows then hold live older tokens).
    """
    meta.validate()
    rows_of_pool, layout, num_blocks = pool_rows(pool, cfg.pool)
    cache_dtype = CacheDType(cfg.pool.cache_dtype)
    layer = cfg.pool.layer_index
    q, k, v = _split_heads(qkv, bias, meta, cfg)
    if cfg.q_out_fp8 and not (math.isfinite(cfg.q_scale) and cfg.q_scale > 0):
        raise ValueError(f"q_scale: q_out_fp8 needs a finite q_scale > 0, got {cfg.q_scale}")
    positions = _rope_positions(meta, cfg)
    kv_lens = meta.kv_lens[meta.token_seq]  # LongRoPE picks its table per sequence by this
    q = apply_rope(q, positions, layout.head_dim, cfg.rope, kv_lens)
    k = apply_rope(k, positions, layout.head_dim, cfg.rope, kv_lens)

    # ---- locate every token first (no partial writes) ------------------------------------------------
    located = []  # per sequence: (token rows, cache positions, blocks, offsets)
    first_bad, n_bad = None, 0
    for seq in range(meta.num_seqs):
        rows = np.arange(meta.cu_q_lens[seq], meta.cu_q_lens[seq + 1])
        cache_pos = int(meta.past_lens[seq]) + np.arange(rows.size)
        block, offset, raw = layout.locate(meta.block_table[seq], cache_pos, num_blocks)
        bad = np.flatnonzero(block == INVALID_BLOCK)
        if bad.size and first_bad is None:
            i = int(bad[0])
            page = int(layout.slot_to_page(layout.token_slot(cache_pos[i]))[0])
            first_bad = (seq, page, int(raw[i]), int(cache_pos[i]))
        n_bad += bad.size
        slots = layout.token_slot(cache_pos)
        if np.unique(slots).size != slots.size:
            # Two tokens of one step on one ring slot: the kernel's threads would race for it.
            raise ValueError(f"cu_q_lens: sequence {seq} writes {rows.size} tokens in one step, more than the "
                             f"cyclic cache's ring holds (cyclic_len={layout.cyclic_len})")
        located.append((rows, cache_pos, block, offset))
    if first_bad is not None:
        seq, page, entry, pos = first_bad
        raise _invalid_page_error(seq, page, entry, num_blocks, meta.max_blocks, pos, n_bad)
    _check_no_shared_slots(located, layout, cfg.zero_v_tail)

    # ---- write ---------------------------------------------------------------------------------------
    k_stored = quantize(k, cache_dtype, cfg.pool.k_scale)
    v_stored = quantize(v, cache_dtype, cfg.pool.v_scale)
    for rows, cache_pos, block, offset in located:
        if rows.size == 0:
            continue
        rows_of_pool[row_index(layout, block, layer, 0, offset)] = k_stored[rows]
        rows_of_pool[row_index(layout, block, layer, 1, offset)] = v_stored[rows]
        if cfg.zero_v_tail and rows.size > 1:
            _zero_v_tail(rows_of_pool, layout, layer, block[-1], int(offset[-1]), kv_len=int(cache_pos[-1]) + 1)

    if cfg.q_out_fp8:
        q = dequantize(quantize(q, CacheDType.FP8_E4M3, cfg.q_scale), CacheDType.FP8_E4M3, cfg.q_scale)
    return q


def _check_no_shared_slots(located, layout, zero_v_tail: bool) -> None:
    """Two sequences of one step on the same (block, offset), or one's V tail on a row another writes: the
    kernel's threads would race there, so the step is ill-formed (the KV manager gave a page to two owners)."""
    owner = {}
    for seq, (_, _, block, offset) in enumerate(located):
        for b, o in zip(block.tolist(), offset.tolist(), strict=True):
            if owner.setdefault((b, o), seq) != seq:
                raise ValueError(f"block_table: sequences {owner[(b, o)]} and {seq} both write block {b} offset {o} "
                                 "in one step")
    if not zero_v_tail:
        return
    for seq, (rows, cache_pos, block, offset) in enumerate(located):
        if rows.size > 1 and not _ring_wrapped(layout, int(cache_pos[-1]) + 1):
            for o in range(int(offset[-1]) + 1, layout.page_size):
                other = owner.get((int(block[-1]), o))
                if other is not None:
                    raise ValueError(f"block_table: sequence {seq}'s last page (block {int(block[-1])}) is written "
                                     f"by sequence {other} too (offset {o}), and zero_v_tail would clear it")


def _ring_wrapped(layout, kv_len: int) -> bool:
    """Whether a cyclic cache has overwritten a ring slot once the sequence holds ``kv_len`` tokens."""
    return layout.cyclic_len > 0 and kv_len > layout.ring_sink_tokens + layout.cyclic_len


def _zero_v_tail(rows_of_pool, layout, layer: int, last_block: int, last_offset: int, kv_len: int) -> None:
    """Zero V rows (last_offset, P) of ``last_block``: the attention kernels load whole pages of V, and a
    stale NaN there survives a zero probability (0 * NaN = NaN)."""
    if _ring_wrapped(layout, kv_len):
        return  # the rows after the newest slot hold the oldest live positions of the ring
    tail = np.arange(last_offset + 1, layout.page_size)
    if tail.size:
        rows_of_pool[row_index(layout, np.full(tail.size, last_block), layer, 1, tail)] = 0
