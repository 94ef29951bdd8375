"""Block allocator, pool-group specs and sizing, block-copy plans (CPU)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.kvcache import (BlockAllocator, BlockCopy, BlockRefcountError, KVCacheExhaustedError, NumpyPools,
                             PoolGroup, Tier, WindowMode, apply_copies, blocks_for_budget, copy_plan)
from pagedkv.kvcache.sizing import budget_from_free_memory
from pagedkv.layout import CacheDType, KVLayout, PageLayout


# ---- allocator ---------------------------------------------------------------------------------------
def test_allocator_hands_out_oldest_free_first_and_returns_to_tail():
    a = BlockAllocator(5)
    assert a.allocate(3) == [0, 1, 2]
    assert list(a.free_list()) == [3, 4]
    assert a.decref(1) and a.decref(0)
    assert list(a.free_list()) == [3, 4, 1, 0]
    assert list(a.free_list_backwards()) == [0, 1, 4, 3]
    assert a.allocate(2) == [3, 4]
    assert a.num_free == 2 and a.num_used == 3


def test_allocator_refcounts_and_revival_from_the_middle():
    a = BlockAllocator(4)
    a.allocate(4)
    for b in range(4):
        a.decref(b)
    a.incref(2)  # a free block leaves the free list from the middle (prefix hit on a cached block)
    assert list(a.free_list()) == [0, 1, 3] and a.refcount(2) == 1
    a.incref(2)
    assert not a.decref(2) and a.refcount(2) == 1
    assert a.decref(2) and list(a.free_list()) == [0, 1, 3, 2]


def test_allocator_counts_shared_blocks():
    """``num_shared`` (blocks of refcount >= 2, what lets a batched reserve skip its copy-on-write lookups)
    follows every incref and decref of a random sequence of them."""
    rng = np.random.default_rng(3)
    a = BlockAllocator(9)
    a.allocate(9)
    for _ in range(400):
        b = int(rng.integers(9))
        if a.refcount(b) and rng.random() < 0.5:
            a.decref(b)
        else:
            a.incref(b)
        assert a.num_shared == sum(a.refcount(i) >= 2 for i in range(9))
    assert a.snapshot()[-1] == a.num_shared


def test_allocator_exhaustion_changes_nothing():
    a = BlockAllocator(3, name="g0")
    a.allocate(2)
    before = a.snapshot()
    with pytest.raises(KVCacheExhaustedError, match=r"needs 2 block\(s\) in pool group 'g0'.*only 1 are free") as e:
        a.allocate(2, seq="s")
    assert (e.value.needed, e.value.free, e.value.group, e.value.seq) == (2, 1, "g0", "s")
    assert a.snapshot() == before


def test_allocator_double_free_and_bad_ids():
    a = BlockAllocator(2)
    [b] = a.allocate(1)
    a.decref(b)
    with pytest.raises(BlockRefcountError, match="double free") as e:
        a.decref(b)
    assert e.value.block == b and e.value.refcount == 0
    with pytest.raises(IndexError, match=r"block id 2 outside \[0, 2\)"):
        a.incref(2)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(-1)
    empty = BlockAllocator(0)
    assert list(empty.free_list()) == [] and empty.allocate(0) == []


def test_allocator_operations_are_constant_time_per_block():
    """Allocating/freeing k blocks costs O(k), independent of the pool size (a regression guard against a
    linear scan: 200x the pool, same time within a generous factor)."""
    import time

    def cost(n):
        a = BlockAllocator(n)
        t = time.perf_counter()
        for _ in range(20):
            blocks = a.allocate(500)
            for b in blocks:
                a.decref(b)
        return time.perf_counter() - t

    small, big = min(cost(1000) for _ in range(3)), min(cost(200_000) for _ in range(3))
    assert big < 5 * small, (small, big)


# ---- pool-group specs --------------------------------------------------------------------------------
def test_group_modes_and_sizes():
    lay = KVLayout(4, 8, 16, 128)
    full = PoolGroup("full", lay, CacheDType.BF16)
    assert full.mode == WindowMode.FULL and full.block_bytes == 4 * 2 * 8 * 16 * 128 * 2
    assert PoolGroup("w", lay, window=100).mode == WindowMode.RELEASE
    ring = PoolGroup("c", KVLayout(4, 8, 16, 128, ring_sink_tokens=4, cyclic_len=128), window=100, attention_sinks=4)
    assert ring.mode == WindowMode.CYCLIC and ring.ring_pages == (4 + 12 + 128) // 16
    fp8 = PoolGroup("q", lay, "fp8", k_scales=[0.5, 1, 2, 4], v_scales=[1, 1, 1, 0.25])
    cfg = fp8.pool_config(3, pool_index=2)
    assert (cfg.k_scale, cfg.v_scale, cfg.pool_index, cfg.layer_index) == (4.0, 0.25, 2, 3)
    assert cfg.cache_dtype == CacheDType.FP8_E4M3 and fp8.block_bytes == full.block_bytes // 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(layout=KVLayout(1, 1, 4, 8, cyclic_len=8)), r"window: a cyclic pool group \(cyclic_len=8\) needs"),
    (dict(layout=KVLayout(1, 1, 4, 8, cyclic_len=8), window=9), r"cyclic_len=8 < window=9"),
    (dict(layout=KVLayout(1, 1, 4, 8, ring_sink_tokens=2, cyclic_len=8), window=4), r"attention_sinks=0 must equal"),
    (dict(layout=KVLayout(2, 1, 4, 8), cache_dtype="int8", k_scales=[1.0]), r"k_scales: expected 2 values"),
    (dict(layout=KVLayout(1, 1, 4, 8), cache_dtype="fp8", v_scales=[float("nan")]), r"v_scales\[0\]: must be finite"),
    (dict(layout=KVLayout(1, 1, 4, 8), k_scales=[2.0]), r"only quantized caches"),
    (dict(layout=KVLayout(1, 1, 4, 8), cache_dtype=CacheDType.NVFP4), r"NVFP4"),
    (dict(layout=KVLayout(1, 1, 4, 8), window=-1), r"window: must be >= 0 \(0: full causal\), got -1"),
    (dict(layout=KVLayout(1, 1, 4, 8), attention_sinks=2), r"attention_sinks=2: only meaningful"),
])
def test_group_spec_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoolGroup("g", **kwargs)


def test_blocks_for_budget():
    a = PoolGroup("a", KVLayout(1, 2, 16, 64))                 # 8 KiB blocks
    b = PoolGroup("b", KVLayout(1, 4, 16, 128), CacheDType.FP8_E4M3)  # 16 KiB blocks
    assert a.block_bytes == 8192 and b.block_bytes == 16384
    assert blocks_for_budget([a, b], 10 * 24576 + 100) == [10, 10]
    assert blocks_for_budget([a, b], 2 ** 20, shares=[0.25, 0.75]) == [32, 48]
    counts = blocks_for_budget([a, b], 999_999, [0.5, 0.5])
    assert sum(c * g.block_bytes for c, g in zip(counts, [a, b])) <= 999_999 and counts == [61, 30]
    with pytest.raises(ValueError, match=r"leaves no block for pool group 'b'"):
        blocks_for_budget([a, b], 20000, shares=[0.9, 0.1])
    with pytest.raises(ValueError, match=r"shares: must be >= 0 and sum to 1"):
        blocks_for_budget([a, b], 2 ** 20, shares=[0.5, 0.6])
    with pytest.raises(ValueError, match=r"memory_fraction: expected in \(0, 1\], got 1.5"):
        budget_from_free_memory(1.5, 10)
    assert budget_from_free_memory(0.5, 1001) == 500


# ---- copy plans ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_layout", [PageLayout.HND, PageLayout.NHD])
def test_copy_plan_geometry(page_layout):
    lay = KVLayout(3, 2, 8, 4, page_layout)
    whole = copy_plan(lay, 2, 0)
    assert (whole.rows, whole.width) == (1, lay.stride_block * 2) and whole.contiguous
    assert copy_plan(lay, 2, 8) == whole and copy_plan(lay, 2, -5) == whole
    part = copy_plan(lay, 2, 3)
    rows = 3 * 2 * 2 if page_layout == PageLayout.HND else 3 * 2  # (layer, K/V, head) rows or (layer, K/V)
    assert part.rows == rows and part.pitch * part.rows == lay.stride_block * 2
    assert part.width == 3 * lay.stride_token * 2 and not part.contiguous
    with pytest.raises(ValueError, match="exceeds page_size=8"):
        copy_plan(lay, 2, 9)


@pytest.mark.parametrize("page_layout", [PageLayout.HND, PageLayout.NHD])
@pytest.mark.parametrize("num_tokens", [1, 3, 4, 0, -1])
def test_partial_copy_moves_exactly_the_first_tokens(page_layout, num_tokens):
    """The copy plan executed on bytes equals slicing the 6-D pool: tokens < N of every (layer, K/V, head)
    of the source block, nothing else; the destination keeps its other rows (NaN poison) untouched."""
    P = 4
    spec = PoolGroup("g", KVLayout(2, 3, P, 5, page_layout), CacheDType.BF16)
    pools = NumpyPools([spec], [4], [3])
    rng = np.random.default_rng(num_tokens + 10)
    src = pools.pool(0)
    src[2] = rng.standard_normal(src.shape[1:]).astype(src.dtype)  # the other blocks keep their NaN poison
    host_before = pools.pool(0, Tier.SECONDARY).copy()
    pools.copy(BlockCopy(0, Tier.PRIMARY, 2, Tier.SECONDARY, 1, num_tokens))
    host = pools.pool(0, Tier.SECONDARY)
    n = P if num_tokens <= 0 else num_tokens
    expect = host_before.copy()
    if page_layout == PageLayout.HND:  # [NB, L, 2, KVH, P, D]
        expect[1, :, :, :, :n, :] = src[2, :, :, :, :n, :]
    else:  # [NB, L, 2, P, KVH, D]
        expect[1, :, :, :n, :, :] = src[2, :, :, :n, :, :]
    np.testing.assert_array_equal(host.view(np.uint16), expect.view(np.uint16))
    # round trip back into a poisoned primary block: the first n tokens come back bit-exact
    pools.copy(BlockCopy(0, Tier.SECONDARY, 1, Tier.PRIMARY, 3, num_tokens))
    back = pools.pool(0)[3]
    if page_layout == PageLayout.HND:
        np.testing.assert_array_equal(back[:, :, :, :n].view(np.uint16), src[2][:, :, :, :n].view(np.uint16))
        assert np.all(np.isnan(back[:, :, :, n:].astype(np.float32)))
    else:
        np.testing.assert_array_equal(back[:, :, :n].view(np.uint16), src[2][:, :, :n].view(np.uint16))
        assert np.all(np.isnan(back[:, :, n:].astype(np.float32)))


def test_apply_copies_replays_on_mirrors():
    spec = PoolGroup("g", KVLayout(1, 2, 4, 3), CacheDType.INT8)
    pools = NumpyPools([spec], [3], [2], poison=False)
    rng = np.random.default_rng(0)
    pools.pool(0)[...] = rng.integers(-128, 128, pools.pool(0).shape)
    mirror, host_mirror = [pools.pool(0).copy()], [pools.pool(0, Tier.SECONDARY).copy()]
    log = [BlockCopy(0, Tier.PRIMARY, 0, Tier.PRIMARY, 2, 3), BlockCopy(0, Tier.PRIMARY, 1, Tier.SECONDARY, 0, 0),
           BlockCopy(0, Tier.SECONDARY, 0, Tier.PRIMARY, 0, 2)]
    for c in log:
        pools.copy(c)
    assert not np.array_equal(mirror[0], pools.pool(0))  # the copies did change the pool
    apply_copies([spec], log, mirror, host_mirror)
    np.testing.assert_array_equal(mirror[0], pools.pool(0))
    np.testing.assert_array_equal(host_mirror[0], pools.pool(0, Tier.SECONDARY))
    with pytest.raises(ValueError, match="secondary tier but no secondary mirrors"):
        apply_copies([spec], log, mirror)
