"""Pool sizing: how many blocks of each pool group fit in a memory budget."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from pagedkv.pool_group import PoolGroup


def blocks_for_budget(groups: Sequence[PoolGroup], budget_bytes: int,
                      shares: Sequence[float] | None = None) -> list[int]:
    """Blocks per group that fit in ``budget_bytes``.

    ``shares`` (default: equal block counts for every group) are the fractions of the budget each group
    gets; group g receives ``floor(budget * share_g / block_bytes_g)`` blocks. With the default every group
    gets ``floor(budget / sum(block_bytes))`` blocks. Raises when a group would get no block at all.
    """
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes: must be >= 0, got {budget_bytes}")
    if not groups:
        raise ValueError("groups: at least one pool group is needed")
    block_bytes = [g.block_bytes for g in groups]
    if shares is None:
        counts = [int(budget_bytes // sum(block_bytes))] * len(groups)
    else:
        if len(shares) != len(groups):
            raise ValueError(f"shares: expected {len(groups)} values (one per group), got {len(shares)}")
        if any(not (math.isfinite(s) and s >= 0) for s in shares) or not math.isclose(sum(shares), 1.0):
            raise ValueError(f"shares: must be >= 0 and sum to 1, got {list(shares)}")
        counts = [int(math.floor(budget_bytes * s / b)) for s, b in zip(shares, block_bytes)]
    for g, c in zip(groups, counts):
        if c <= 0:
            raise ValueError(f"budget of {budget_bytes} bytes leaves no block for pool group {g.name!r} "
                             f"(one block is {g.block_bytes} bytes)")
    return counts


def budget_from_free_memory(fraction: float, free_bytes: int) -> int:
    """``fraction`` of ``free_bytes`` (device free memory from cudaMemGetInfo), validated."""
    if not (0.0 < fraction <= 1.0):
        raise ValueError(f"memory_fraction: expected in (0, 1], got {fraction}")
    return int(np.floor(free_bytes * fraction))
