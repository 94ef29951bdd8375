"""KV cache manager: device pools (cuda-python), block allocator, sequences and page tables, fork with
copy-on-write, prefix reuse, sliding windows (released or cyclic), a pinned host tier, step metadata, the
"kv doctor" validator and a page-map picture. ``docs/kv_manager.md`` explains the model.

The bookkeeping runs without a device (``storage="none"``, the host model); the same ``KVCacheManager``
drives real pools with ``storage="device"``. The pool groups it takes are ``pagedkv.pool_group.PoolGroup``
(exported here too, with ``WindowMode``, as part of the manager's API).
"""

from pagedkv.kvcache.allocator import BlockAllocator
from pagedkv.kvcache.copies import BlockCopy, CopyPlan, NumpyPools, Tier, apply_copies, copy_plan
from pagedkv.kvcache.errors import BlockRefcountError, KVCacheError, KVCacheExhaustedError, KVInvariantError
from pagedkv.kvcache.manager import KVCacheManager, SeqBatch
from pagedkv.kvcache.metadata import GroupStep, StepBatch, pool_descriptors
from pagedkv.kvcache.prefix import PrefixCache, block_hash
from pagedkv.kvcache.sizing import blocks_for_budget, budget_from_free_memory
from pagedkv.kvcache.validator import validate_manager, validate_step
from pagedkv.pool_group import PoolGroup, WindowMode


def render_pagemap(manager, path, **kwargs):
    """Render the manager's pools as a page map PNG (see ``pagedkv.kvcache.pagemap``)."""
    from pagedkv.kvcache.pagemap import render_pagemap as _render

    return _render(manager, path, **kwargs)


__all__ = [
    "BlockAllocator", "BlockCopy", "BlockRefcountError", "CopyPlan", "GroupStep", "KVCacheError",
    "KVCacheExhaustedError", "KVCacheManager", "KVInvariantError", "SeqBatch", "NumpyPools", "PoolGroup", "PrefixCache",
    "StepBatch", "Tier", "WindowMode", "apply_copies", "block_hash", "blocks_for_budget", "budget_from_free_memory",
    "copy_plan", "pool_descriptors", "render_pagemap", "validate_manager", "validate_step",
]
