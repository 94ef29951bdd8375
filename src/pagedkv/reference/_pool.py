"""Pool access shared by the write and the read reference: every element address comes from
``KVLayout.locate`` + ``KVLayout.elem_offset``, applied to the pool viewed from its base (as the kernels do)."""

from __future__ import annotations

import numpy as np

from pagedkv.config import PoolConfig
from pagedkv.layout import CacheDType, KVLayout


def pool_rows(pool: np.ndarray, pool_cfg: PoolConfig) -> tuple[np.ndarray, KVLayout, int]:
    """Check ``pool`` against the pool group's config; return (row view [elements / D, D], layout, num_blocks).

    One K or V row (one token, one head) is D contiguous elements starting at ``elem_offset`` (a multiple of D
    in both page layouts), so the pool is addressed as rows of D. The view aliases ``pool`` (writes through it
    mutate the caller's array), hence C-contiguity.
    """
    layout = pool_cfg.layout()
    dtype = CacheDType(pool_cfg.cache_dtype).numpy_dtype
    if not isinstance(pool, np.ndarray):
        raise TypeError(f"pool: expected a numpy array, got {type(pool).__name__}")
    if pool.ndim != 6 or pool.shape != layout.pool_shape(pool.shape[0]):
        raise ValueError(f"pool: expected shape {layout.pool_shape('NB')} ({layout.page_layout.name}), "
                         f"got {pool.shape}")
    if pool.dtype != dtype:
        raise ValueError(f"pool: cache_dtype={CacheDType(pool_cfg.cache_dtype).name} stores {dtype}, "
                         f"got {pool.dtype}")
    if not pool.flags.c_contiguous:
        raise ValueError("pool: must be C-contiguous (addresses are element offsets from its base)")
    return pool.reshape(-1, layout.head_dim), layout, int(pool.shape[0])


def row_index(layout: KVLayout, block, layer: int, kv: int, offset) -> np.ndarray:
    """Row indices [n, KVH] (into ``pool_rows``) of the K (kv=0) or V (kv=1) rows of all KV heads at
    (block[n], offset[n])."""
    heads = np.arange(layout.num_kv_heads)
    elem = layout.elem_offset(np.asarray(block)[:, None], layer, kv, heads[None, :], np.asarray(offset)[:, None])
    return elem // layout.head_dim
