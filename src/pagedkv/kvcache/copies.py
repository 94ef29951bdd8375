"""Block copies: what the manager moves (``BlockCopy``), how a copy maps onto memcpy calls (``CopyPlan``),
and the host-memory pools that execute the same plans in numpy (``NumpyPools``).

A block is contiguous (the block is the outermost pool dimension), so a whole-block copy is one linear
copy of ``block_bytes``. "The first N tokens of every (layer, K/V, head)" (TensorRT-LLM's
cuKVCacheBlockPartialCopy; N <= 0 means the whole block) is one strided 2-D copy: the token dimension is
contiguous inside rows of ``page_size * stride_token`` elements, so

    rows   = stride_block / (page_size * stride_token)   HND: L*2*KVH rows   NHD: L*2 rows
    pitch  = page_size * stride_token * itemsize
    width  = N * stride_token * itemsize

which is ``cudaMemcpy2DAsync(dst, pitch, src, pitch, width, rows)`` on the device and a reshaped slice in
numpy. The strides come from the layout contract (``KVLayout``), never re-derived here.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedkv.layout import KVLayout
from pagedkv.pool_group import PoolGroup


class Tier(enum.IntEnum):
    PRIMARY = 0    # the pool the kernels read and write (device memory, or numpy in a host model)
    SECONDARY = 1  # pinned host memory: offloaded blocks


@dataclass(frozen=True)
class BlockCopy:
    """Copy the first ``num_tokens`` tokens (<= 0: the whole block) of every (layer, K/V, head) of one
    block to another block of the same pool group, possibly across tiers."""

    group: int
    src_tier: Tier
    src_block: int
    dst_tier: Tier
    dst_block: int
    num_tokens: int = 0

    @property
    def whole(self) -> bool:
        return self.num_tokens <= 0


@dataclass(frozen=True)
class CopyPlan:
    """Byte geometry of one block copy: ``rows`` rows of ``width`` bytes, ``pitch`` bytes apart, starting at
    the block's first byte. A whole block is one row of ``block_bytes``."""

    rows: int
    pitch: int
    width: int

    @property
    def contiguous(self) -> bool:
        return self.rows == 1 or self.width == self.pitch


def copy_plan(layout: KVLayout, itemsize: int, num_tokens: int) -> CopyPlan:
    """The memcpy geometry of copying the first ``num_tokens`` tokens of a block (<= 0: all of them)."""
    block_bytes = layout.stride_block * itemsize
    if num_tokens <= 0 or num_tokens >= layout.page_size:
        if num_tokens > layout.page_size:
            raise ValueError(f"num_tokens: {num_tokens} exceeds page_size={layout.page_size}")
        return CopyPlan(rows=1, pitch=block_bytes, width=block_bytes)
    row_elems = layout.page_size * layout.stride_token
    if layout.stride_block % row_elems:
        raise AssertionError(f"layout: a block ({layout.stride_block} elements) is not whole rows of "
                             f"{row_elems} tokens*stride_token elements")  # contract broken, not user input
    return CopyPlan(rows=layout.stride_block // row_elems, pitch=row_elems * itemsize,
                    width=num_tokens * layout.stride_token * itemsize)


def apply_plan_bytes(dst: np.ndarray, dst_offset: int, src: np.ndarray, src_offset: int, plan: CopyPlan) -> None:
    """memcpy2D semantics on flat uint8 arrays (the numpy twin of the device copy)."""
    extent = plan.rows * plan.pitch  # == block_bytes: the rows tile the block exactly
    d = dst[dst_offset:dst_offset + extent].reshape(plan.rows, plan.pitch)
    s = src[src_offset:src_offset + extent].reshape(plan.rows, plan.pitch)
    d[:, :plan.width] = s[:, :plan.width]


def copy_between_arrays(spec: PoolGroup, dst_pool: np.ndarray, src_pool: np.ndarray, c: BlockCopy) -> None:
    """Execute one ``BlockCopy`` between two C-contiguous pool arrays of ``spec``'s layout."""
    for name, arr in (("source", src_pool), ("destination", dst_pool)):
        if not arr.flags.c_contiguous or arr.dtype.itemsize != spec.itemsize:
            raise ValueError(f"{name} pool: expected a C-contiguous array of {spec.cache_dtype.name} elements")
    plan = copy_plan(spec.layout, spec.itemsize, c.num_tokens)
    apply_plan_bytes(dst_pool.reshape(-1).view(np.uint8), c.dst_block * spec.block_bytes,
                     src_pool.reshape(-1).view(np.uint8), c.src_block * spec.block_bytes, plan)


class NumpyPools:
    """Pools in host memory as numpy arrays of ``layout.pool_shape`` (primary and, optionally, secondary
    tier): a host model whose contents are exact, for the numpy references and the CPU tests. Executes
    ``BlockCopy`` through the same ``CopyPlan`` as the device pools."""

    def __init__(self, groups: Sequence[PoolGroup], num_blocks: Sequence[int], host_blocks: Sequence[int],
                 poison: bool = True):
        self.groups = tuple(groups)
        self.tiers: dict[Tier, list[np.ndarray]] = {Tier.PRIMARY: [], Tier.SECONDARY: []}
        for spec, nb, hb in zip(self.groups, num_blocks, host_blocks):
            for tier, count in ((Tier.PRIMARY, nb), (Tier.SECONDARY, hb)):
                arr = np.empty(spec.pool_shape(count), dtype=spec.cache_dtype.numpy_dtype)
                # 0xFF bytes: NaN for fp16/bf16/fp8-e4m3, -1 for int8; unwritten slots stay recognisable
                arr.view(np.uint8).fill(0xFF if poison else 0)
                self.tiers[tier].append(arr)

    def pool(self, group: int, tier: Tier = Tier.PRIMARY) -> np.ndarray:
        return self.tiers[tier][group]

    def copy(self, c: BlockCopy) -> None:
        copy_between_arrays(self.groups[c.group], self.tiers[c.dst_tier][c.group],
                            self.tiers[c.src_tier][c.group], c)

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        self.tiers = {Tier.PRIMARY: [], Tier.SECONDARY: []}


def apply_copies(groups: Sequence[PoolGroup], copies: Sequence[BlockCopy], primary: Sequence[np.ndarray],
                 secondary: Sequence[np.ndarray] | None = None) -> None:
    """Replay a manager's copy log on host mirrors of the pools (e.g. a numpy pool a reference wrote), so
    that the mirrors stay exactly what the device holds."""
    for c in copies:
        tiers = {Tier.PRIMARY: primary, Tier.SECONDARY: secondary}
        if tiers[c.src_tier] is None or tiers[c.dst_tier] is None:
            raise ValueError(f"apply_copies: {c} involves the secondary tier but no secondary mirrors were given")
        copy_between_arrays(groups[c.group], tiers[c.dst_tier][c.group], tiers[c.src_tier][c.group], c)
