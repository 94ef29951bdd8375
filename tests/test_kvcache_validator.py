"""The kv doctor finds each kind of corruption and names it precisely (check, sequence, block, expected,
found). Each case breaks one invariant of an otherwise healthy manager by hand."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.kvcache import KVCacheManager, KVInvariantError, PoolGroup
from pagedkv.layout import INVALID_BLOCK, KVLayout

FULL = PoolGroup("full", KVLayout(1, 1, 4, 2))
WIN = PoolGroup("win", KVLayout(1, 1, 4, 2), window=5)
RING = PoolGroup("ring", KVLayout(1, 1, 4, 2, cyclic_len=8), window=6)


def healthy(groups=(FULL,), host_blocks=2, prefix=False):
    mgr = KVCacheManager(list(groups), 12, host_blocks=host_blocks, enable_prefix_reuse=prefix)
    mgr.add_sequence("a", list(range(1, 11)))
    for _ in range(5):
        mgr.reserve("a", 2)
        mgr.commit("a", 2)  # 10 tokens, 3 pages
    mgr.fork("a", "b")
    mgr.add_sequence("c")
    mgr.reserve("c", 3)
    mgr.validate()
    return mgr


def doctor(mgr) -> KVInvariantError:
    with pytest.raises(KVInvariantError) as e:
        mgr.validate()
    return e.value


def test_refcount_not_equal_to_holders():
    mgr = healthy()
    b = int(mgr.block_row("a")[0])
    mgr.allocators[0]._refcount[b] = 3
    err = doctor(mgr)
    assert (err.check, err.block, err.expected, err.found, err.seq) == ("refcount-holders", b, 2, 3, "a")
    assert "kv doctor: refcount-holders" in str(err) and f"block={b}" in str(err)


def test_shared_block_count_is_checked():
    mgr = healthy()  # b shares a's pages: 3 blocks of refcount 2
    assert mgr.allocators[0].num_shared == 3
    mgr.allocators[0]._num_shared = 0  # stale: a batched reserve would skip a copy-on-write
    err = doctor(mgr)
    assert (err.check, err.expected, err.found) == ("refcount-holders", 3, 0) and "num_shared" in err.detail


@pytest.mark.parametrize("flip", ["cached", "free"])
def test_prefix_cached_flags_are_checked(flip):
    """The by-block flags a batched reserve reads to find cached pages it writes must match the maps."""
    mgr = healthy(prefix=True)
    cache = mgr.prefix[0]
    cached = sorted(cache.cached_blocks())
    assert cached and cache.cached_among(np.arange(12)) == cached
    b = cached[0] if flip == "cached" else min(set(range(12)) - set(cached))
    cache._is_cached[b] = not cache._is_cached[b]  # stale: reserve_many would miss (or invent) an uncache
    err = doctor(mgr)
    assert (err.check, err.block, err.expected, err.found) == ("prefix-cache", b, flip == "cached", flip != "cached")


def test_invalid_page_inside_the_live_range():
    mgr = healthy()
    row = mgr._seqs["b"].row
    b = int(mgr._tables[0][row, 1])
    mgr._tables[0][row, 1] = INVALID_BLOCK
    mgr.allocators[0]._refcount[b] -= 1
    err = doctor(mgr)
    assert (err.check, err.seq, err.page, err.found) == ("page-in-live-range", "b", 1, INVALID_BLOCK)


def test_block_list_longer_than_the_length_needs():
    mgr = healthy()
    mgr._npages[0][mgr._seqs["a"].row] = 4
    err = doctor(mgr)
    assert (err.check, err.seq, err.expected, err.found) == ("row-extent", "a", 3, 4)


def test_length_formula_against_the_held_pages():
    mgr = healthy()
    row = mgr._seqs["a"].row
    mgr._length[row] = 13  # 13 tokens need 4 pages; bump the page count so only the formula can tell
    mgr._npages[0][row] = 4
    err = doctor(mgr)  # 3 held pages + last_page_len(13) = 1 give (3 - 1) * 4 + 1 = 9 tokens, not 13
    assert (err.check, err.seq, err.expected, err.found) == ("length-formula", "a", 13, 9)


def test_free_block_still_held():
    mgr = healthy()
    [free] = mgr.allocators[0].allocate(1)  # taken from the free list without a holder ...
    mgr.allocators[0]._refcount[free] = 0   # ... and marked free: it is in neither state
    err = doctor(mgr)
    assert err.check == "free-list" and err.block == free and err.expected == "in free list"


def test_free_list_cycle_and_duplicates():
    mgr = healthy()
    alloc = mgr.allocators[0]
    head = alloc._next[alloc._sentinel]
    alloc._next[head] = head  # a self loop
    err = doctor(mgr)
    assert err.check == "free-list" and "corrupt" in err.detail


def test_shared_write_is_caught():
    mgr = healthy()
    mgr.reserve("a", 1)  # a's last page is shared with b: reserve copies it ...
    row = mgr._seqs["a"].row
    mgr._tables[0][row, 2] = mgr._tables[0][mgr._seqs["b"].row, 2]  # ... undo the copy by hand
    err = doctor(mgr)
    # refcounts no longer match holders either; the doctor reports what it checks first
    assert err.check in ("refcount-holders", "free-list")
    mgr.allocators[0]._refcount[int(mgr._tables[0][row, 2])] += 1
    old = [b for b in range(12) if mgr.allocators[0]._refcount[b] == 1 and b not in
           np.concatenate([mgr._tables[0][st.row, :mgr._npages[0][st.row]] for st in mgr._seqs.values()])]
    for b in old:  # the orphaned copy: give it back so only the shared write remains
        mgr.allocators[0].decref(b)
    err = doctor(mgr)
    assert (err.check, err.seq, err.page, err.expected, err.found) == ("shared-write", "a", 2, 1, 2)


def test_cached_block_written_is_caught():
    mgr = healthy(prefix=True)
    b = int(mgr.block_row("c")[0])  # c has reserved slots in its page 0
    mgr.prefix[0].register(b, b"\x01" * 16, np.zeros(4, dtype=np.int32))
    err = doctor(mgr)
    assert (err.check, err.seq, err.block, err.found) == ("shared-write", "c", b, "cached")


def test_release_window_page_not_released():
    mgr = healthy(groups=(FULL, WIN))
    row = mgr._seqs["a"].row
    assert mgr._tables[1][row, 0] == INVALID_BLOCK  # 10 tokens, window 5: page 0 (0..3) left the window
    [b] = mgr.allocators[1].allocate(1)
    mgr._tables[1][row, 0] = b
    err = doctor(mgr)
    assert (err.check, err.seq, err.group, err.page, err.found) == ("page-in-live-range", "a", "win", 0, b)


def test_cyclic_reservation_too_long_for_the_ring():
    mgr = healthy(groups=(FULL, RING))
    mgr._reserved[mgr._seqs["c"].row] = 4  # window 6 + 4 - 1 = 9 > cyclic_len 8 (and page counts agree)
    err = doctor(mgr)
    assert (err.check, err.seq, err.expected, err.found) == ("cyclic-range", "c", 9, 8)


def test_stale_row():
    mgr = healthy()
    mgr.free("c")
    mgr._tables[0][mgr._free_rows[-1], 5] = 1
    err = doctor(mgr)
    assert err.check == "stale-row" and err.found == mgr._free_rows[-1]


def test_swapped_sequence_invariants():
    mgr = healthy(host_blocks=4)
    mgr.swap_out("b")
    mgr.validate()
    st = mgr._seqs["b"]
    st.swapped[0] = st.swapped[0][:-1]  # lose the host copy of the last page
    err = doctor(mgr)
    assert err.check == "swapped" and err.expected == [0, 1, 2] and err.found == [0, 1]


def test_step_validation():
    mgr = healthy()
    step = mgr.build_step(["c"])
    mgr.validate_step(step)
    step.groups[0].meta.block_table[0, 0] = INVALID_BLOCK
    with pytest.raises(KVInvariantError, match="table-vs-indices"):
        mgr.validate_step(step)
    step.groups[0].kv_indices[0] = INVALID_BLOCK  # both agree now: the token itself has no page
    with pytest.raises(KVInvariantError) as e:
        mgr.validate_step(step)
    assert (e.value.check, e.value.seq, e.value.page, e.value.found) == ("token-without-page", "c", 0, -1)
    step = mgr.build_step(["c"])
    step.groups[0].kv_indptr[1] = 5
    with pytest.raises(KVInvariantError, match="indptr-monotone"):
        mgr.validate_step(step)
