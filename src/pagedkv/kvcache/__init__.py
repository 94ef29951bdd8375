"""KV cache manager: device pools (cuda-python), block allocator, sequences and page tables, fork with
copy-on-write, prefix reuse, sliding windows (released or cyclic), a pinned host tier, step metadata, the
"kv doctor" validator and a page-map picture. ``docs/kv_manager.md`` explains the model.

The bookkeeping runs without a device (``storage="none"``, the host model); the same ``KVCacheManager``
drives real pools with ``storage="device"``.
"""

from pagedkv.kvcache.allocator import BlockAllocator
from pagedkv.kvcache.copies import BlockCopy, CopyPlan, NumpyPools, Tier, apply_copies, copy_plan
from pagedkv.kvcache.errors import BlockRefcountError, KVCacheError, KVCacheExhaustedError, KVInvariantError
from pagedkv.kvcache.groups import PoolGroupSpec, WindowMode, blocks_for_budget, budget_from_free_memory
from pagedkv.kvcache.manager import KVCacheManager
from pagedkv.kvcache.metadata import GroupStep, StepBatch, pool_descriptors
from pagedkv.kvcache.prefix import PrefixCache, block_hash
from pagedkv.kvcache.validator import validate_manager, validate_step


def render_pagemap(manager, path, **kwargs):
    """Render the manager's pools as a page map PNG (see ``pagedkv.kvcache.pagemap``)."""
    from pagedkv.kvcache.pagemap import render_pagemap as _render

    return _render(manager, path, **kwargs)


__all__ = [
    "BlockAllocator", "BlockCopy", "BlockRefcountError", "CopyPlan", "GroupStep", "KVCacheError",
    "KVCacheExhaustedError", "KVCacheManager", "KVInvariantError", "NumpyPools", "PoolGroupSpec", "PrefixCache",
    "StepBatch", "Tier", "WindowMode", "apply_copies", "block_hash", "blocks_for_budget", "budget_from_free_memory",
    "copy_plan", "pool_descriptors", "render_pagemap", "validate_manager", "validate_step",
]
