"""The read path in float64: paged attention straight from the pool, and an independent dense formulation.

The executable spec of ``launchAttention`` (plugins/include/pagedkv/attention.h).

    T tokens, B sequences, H query heads, KVH KV heads (H % KVH == 0), G = H / KVH, D head_dim
    q    [T, H, D] or [T, H * D]; sequence b's queries are rows [cu_q_lens[b], cu_q_lens[b+1])
    out  [T, H, D] float64

Query i of sequence b sits at cache position ``past_lens[b] + i`` and sees cache position p when
``pagedkv.layout.attends(q_pos, p, window, attention_sinks)``; K/V rows come from the pool through
``KVLayout.locate`` and are dequantized with the pool's k/v scales. Only positions some query of the sequence
sees are read: rows past a sequence's length, or outside every query's window, may hold anything (NaN).
"""

from __future__ import annotations

import math

import numpy as np

from pagedkv.config import AttentionConfig
from pagedkv.layout import INVALID_BLOCK, CacheDType, KVLayout, attends
from pagedkv.reference._pool import pool_rows, row_index
from pagedkv.reference.quant import dequantize, quantize
from pagedkv.step import StepMetadata

# Upper bound on the elements of one [queries, KVH, G, keys] logits tile (float64): keeps long prefills
# within a few hundred MB on the builder's CPU runs.
_LOGITS_TILE_ELEMS = 1 << 23
_QUERY_TILE = 128  # small enough that a causal / windowed tile skips most keys it cannot see


def _query_values(q, meta: StepMetadata, cfg: AttentionConfig) -> np.ndarray:
    """float64 [T, H, D]. With ``q_fp8`` the query is what an fp8 e4m3 tensor with ``q_scale`` holds: fp8
    input is dequantized; float input is put on that grid (idempotent for ``qkv_write``'s fp8 q_out)."""
    h, d = cfg.num_q_heads, cfg.pool.head_dim
    q = np.asarray(q)
    if q.ndim == 2 and q.shape == (meta.num_tokens, h * d):
        q = q.reshape(meta.num_tokens, h, d)
    if q.shape != (meta.num_tokens, h, d):
        raise ValueError(f"q: expected [T={meta.num_tokens}, H={h}, D={d}] or [T, H*D={h * d}], got {q.shape}")
    fp8 = CacheDType.FP8_E4M3
    if cfg.q_fp8 and not (math.isfinite(cfg.q_scale) and cfg.q_scale > 0):
        raise ValueError(f"q_scale: q_fp8 needs a finite q_scale > 0, got {cfg.q_scale}")
    if q.dtype == fp8.numpy_dtype:
        if not cfg.q_fp8:
            raise ValueError("q: fp8 e4m3 query but q_fp8=0")
        return dequantize(q, fp8, cfg.q_scale)
    values = q.astype(np.float64)
    return dequantize(quantize(values, fp8, cfg.q_scale), fp8, cfg.q_scale) if cfg.q_fp8 else values


def _gather(rows_of_pool, layout: KVLayout, layer: int, kv: int, block_row, positions, num_blocks: int,
            cache_dtype: CacheDType, scale: float) -> np.ndarray:
    """Dequantized K (kv=0) or V (kv=1) rows [n, KVH, D] of ``positions``; an invalid page reads as zeros
    (TensorRT-LLM vanilla ``_gather_paged_kv``: the read side degrades, only the write side must fail)."""
    block, offset, _ = layout.locate(block_row, positions, num_blocks)
    valid = block != INVALID_BLOCK
    rows = np.zeros((positions.size, layout.num_kv_heads, layout.head_dim))
    stored = rows_of_pool[row_index(layout, block[valid], layer, kv, offset[valid])]
    rows[valid] = dequantize(stored, cache_dtype, scale)
    return rows


def _check_resident(layout: KVLayout, seq: int, read_pos: np.ndarray, kv_len: int, cfg: AttentionConfig) -> None:
    """A cyclic cache keeps position p >= ring_sink_tokens only until p + cyclic_len is written. Reading an
    overwritten slot would silently return a newer token, so a window larger than the ring is an error."""
    if not layout.cyclic_len:
        return
    in_ring = read_pos[read_pos >= layout.ring_sink_tokens]
    gone = in_ring[in_ring + layout.cyclic_len < kv_len]
    if gone.size:
        raise ValueError(
            f"window: sequence {seq} attends cache position {int(gone[0])} (window={cfg.window}, attention_sinks="
            f"{cfg.attention_sinks}), which the cyclic cache (ring_sink_tokens={layout.ring_sink_tokens}, cyclic_len="
            f"{layout.cyclic_len}) overwrote before kv length {kv_len}; the ring must hold window + q_len - 1 "
            "positions")


def _query_tiles(n: int, keys: int, heads: int):
    """Row ranges of query tiles: at most _QUERY_TILE rows and _LOGITS_TILE_ELEMS logits each."""
    tile = max(1, min(_QUERY_TILE, _LOGITS_TILE_ELEMS // max(1, heads * keys)))
    return [(start, min(n, start + tile)) for start in range(0, n, tile)]


def _positions_seen(q_pos: np.ndarray, kv_len: int, cfg: AttentionConfig) -> np.ndarray:
    """Cache positions [0, kv_len) that at least one query sees (tile by tile: no [q_len, kv_len] matrix)."""
    seen = np.zeros(kv_len, dtype=bool)
    kv_pos = np.arange(kv_len)
    for start, stop in _query_tiles(q_pos.size, kv_len, 1):
        seen |= attends(q_pos[start:stop, None], kv_pos[None, :], cfg.window, cfg.attention_sinks).any(axis=0)
    return np.flatnonzero(seen)


def _softmax_attend(q, q_pos, k, v, kv_pos, cfg: AttentionConfig) -> np.ndarray:
    """q [n, H, D] at q_pos [n]; k/v [m, KVH, D] at kv_pos [m] -> [n, H, D]. Query head h reads KV head h // G."""
    n, h, d = q.shape
    kvh = k.shape[1]
    group = h // kvh
    scale, cap = cfg.resolved_softmax_scale, cfg.logit_softcap
    # Batched over KV heads so the products are BLAS matmuls: [KVH, rows * G, D] @ [KVH, D, keys].
    k_t = k.transpose(1, 2, 0)  # [KVH, D, m]
    v_h = v.transpose(1, 0, 2)  # [KVH, m, D]
    out = np.empty((n, h, d))
    for start, stop in _query_tiles(n, k.shape[0], h):
        rows = stop - start
        visible = attends(q_pos[start:stop, None], kv_pos[None, :], cfg.window, cfg.attention_sinks)
        cols = np.flatnonzero(visible.any(axis=0))  # keys this tile sees: causal / window skipping
        mask = visible[:, cols]
        q_h = q[start:stop].reshape(rows, kvh, group, d).transpose(1, 0, 2, 3).reshape(kvh, rows * group, d)
        logits = (q_h @ k_t[:, :, cols]).reshape(kvh, rows, group, cols.size) * scale
        if cap > 0:
            logits = cap * np.tanh(logits / cap)
        logits = np.where(mask[None, :, None, :], logits, -np.inf)
        prob = np.exp(logits - logits.max(axis=-1, keepdims=True))
        prob /= prob.sum(axis=-1, keepdims=True)
        o = prob.reshape(kvh, rows * group, cols.size) @ v_h[:, cols]  # [KVH, rows * G, D]
        out[start:stop] = o.reshape(kvh, rows, group, d).transpose(1, 0, 2, 3).reshape(rows, h, d)
    return out


def paged_attention(q, meta: StepMetadata, pool: np.ndarray, cfg: AttentionConfig) -> np.ndarray:
    """Attention of the step's queries over each sequence's cache, read in place from ``pool``.

    softmax scale ``cfg.resolved_softmax_scale``; ``logit_softcap > 0``: logits = cap * tanh(logits / cap).
    A sequence's kv length is ``past_len + q_len`` (this step's tokens are already written).
    """
    meta.validate()
    rows_of_pool, layout, num_blocks = pool_rows(pool, cfg.pool)
    q = _query_values(q, meta, cfg)
    cache_dtype = CacheDType(cfg.pool.cache_dtype)
    out = np.zeros_like(q)
    for seq in range(meta.num_seqs):
        rows = np.arange(meta.cu_q_lens[seq], meta.cu_q_lens[seq + 1])
        if rows.size == 0:
            continue
        kv_len = int(meta.past_lens[seq]) + rows.size
        q_pos = int(meta.past_lens[seq]) + np.arange(rows.size)
        read_pos = _positions_seen(q_pos, kv_len, cfg)  # positions no query sees are never read
        _check_resident(layout, seq, read_pos, kv_len, cfg)
        gather = dict(layout=layout, layer=cfg.pool.layer_index, block_row=meta.block_table[seq],
                      positions=read_pos, num_blocks=num_blocks, cache_dtype=cache_dtype)
        k = _gather(rows_of_pool, kv=0, scale=cfg.pool.k_scale, **gather)
        v = _gather(rows_of_pool, kv=1, scale=cfg.pool.v_scale, **gather)
        out[rows] = _softmax_attend(q[rows], q_pos, k, v, read_pos, cfg)
    return out


def dense_attention(q, k, v, q_pos, kv_pos, *, window: int = 0, attention_sinks: int = 0, softmax_scale: float,
                    logit_softcap: float = 0.0) -> np.ndarray:
    """Dense attention with an explicit mask matrix, independent of the paged path (for tests).

    q [Sq, H, D], k/v [Skv, KVH, D], q_pos [Sq], kv_pos [Skv] (cache positions). Query i sees key j when
    kv_pos[j] <= q_pos[i] and, with window > 0, q_pos[i] - kv_pos[j] < window or kv_pos[j] < attention_sinks.
    Every k/v row takes part in the products (masked ones with probability 0). Returns float64 [Sq, H, D].
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    q_pos = np.asarray(q_pos, dtype=np.int64)
    kv_pos = np.asarray(kv_pos, dtype=np.int64)
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"q/k/v: expected [Sq, H, D] and two [Skv, KVH, D], got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads {q.shape[1]} must be a multiple of kv heads {k.shape[1]}")
    if q_pos.shape != (q.shape[0],) or kv_pos.shape != (k.shape[0],):
        raise ValueError(f"q_pos/kv_pos: expected ({q.shape[0]},) and ({k.shape[0]},), got {q_pos.shape}, "
                         f"{kv_pos.shape}")
    delta = q_pos[:, None] - kv_pos[None, :]  # [Sq, Skv]
    mask = delta >= 0
    if window > 0:
        mask &= (delta < window) | (kv_pos[None, :] < attention_sinks)
    if not mask.any(axis=1).all():
        i = int(np.argmin(mask.any(axis=1)))
        raise ValueError(f"dense_attention: query {i} at position {q_pos[i]} sees no key")
    group = q.shape[1] // k.shape[1]
    k_per_q = np.repeat(k, group, axis=1)  # [Skv, H, D]: q head h reads kv head h // group
    v_per_q = np.repeat(v, group, axis=1)
    scores = np.einsum("ihd,jhd->hij", q, k_per_q) * softmax_scale
    if logit_softcap > 0:
        scores = logit_softcap * np.tanh(scores / logit_softcap)
    scores = np.where(mask[None], scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=2, keepdims=True))
    weights /= weights.sum(axis=2, keepdims=True)
    return np.einsum("hij,jhd->ihd", weights, v_per_q)
