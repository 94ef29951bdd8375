"""The "kv doctor": checks the manager's invariants and a step's metadata, reporting the first violation as
a ``KVInvariantError`` (check, sequence, group, page, block, expected, found).

Manager invariants, in the order they are checked:

1. ``free-list``: each allocator's free list is a well-formed doubly linked list without repeats, of
   ``num_free`` blocks, and holds exactly the blocks whose refcount is 0 (free list disjoint from held).
2. Per sequence and group:
   ``row-extent`` / ``length-formula``: the block list has ``pages_needed(length + reserved)`` entries,
   nothing past them, and the length formula ``length_from_pages`` of the held pages gives back the slots
   the length uses; ``block-range``: entries are -1 or in ``[0, num_blocks)``; ``page-in-live-range``: no
   -1 inside the live range (and released pages are -1, nothing else); ``cyclic-range``: a ring never holds
   more than its pages and a reservation fits the ring (``cyclic_len >= window + reserved - 1``);
   ``shared-write``: every page the reserved slots land in is private (refcount 1) and not a cached prefix
   block, i.e. no block is written by two live sequences; ``swapped``: a swapped-out sequence holds no
   device block and one host block per live page.
3. ``refcount-holders``: every block's refcount equals the number of block-list entries holding it (both
   tiers), and the allocator's ``num_shared`` counts the blocks of refcount >= 2.
4. ``prefix-cache``: hash <-> block maps are inverse, registered blocks are in range and full, and the
   by-block cached flags mark exactly the registered blocks.
5. ``stale-row``: table rows that no sequence owns are all -1.

Step invariants (``validate_step``): ``indptr-monotone``, ``pages-vs-kv-len``, ``length-formula``,
``table-vs-indices``, ``token-without-page`` (every new token has a valid page via ``KVLayout.locate``).
"""

from __future__ import annotations

import numpy as np

from pagedkv.kvcache.errors import KVInvariantError
from pagedkv.kvcache.sequences import released_page_range, written_pages
from pagedkv.layout import INVALID_BLOCK, last_page_len, length_from_pages
from pagedkv.pool_group import WindowMode


def _fail(check, detail, **kw):
    raise KVInvariantError(check, detail, **kw)


def _check_allocator(alloc, group: str) -> None:
    tier = alloc.tier
    try:
        forward = list(alloc.free_list())
        backward = list(alloc.free_list_backwards())
    except Exception as exc:  # a cycle in the links
        _fail("free-list", f"{tier} free list links are corrupt ({exc})", group=group)
    free_count = np.bincount(np.asarray(forward, dtype=np.int64), minlength=alloc.num_blocks)
    if np.any(free_count > 1):
        b = int(np.argmax(free_count > 1))
        _fail("free-list", f"{tier} block appears twice in the free list", group=group, block=b,
              expected=1, found=int(free_count[b]))
    if len(forward) != alloc.num_free:
        _fail("free-list", f"{tier} free-list length differs from the free count", group=group,
              expected=alloc.num_free, found=len(forward))
    if backward != forward[::-1]:
        _fail("free-list", f"{tier} free list differs walked backwards", group=group,
              expected=forward[::-1], found=backward)
    refcounts = np.asarray(alloc.refcounts(), dtype=np.int64)
    if np.any(refcounts < 0):
        b = int(np.argmax(refcounts < 0))
        _fail("free-list", f"{tier} negative refcount", group=group, block=b, expected=">= 0", found=int(refcounts[b]))
    mismatch = (refcounts == 0) != (free_count == 1)
    if mismatch.any():
        b = int(np.argmax(mismatch))
        rc = int(refcounts[b])
        _fail("free-list", f"{tier} block is {'free' if rc == 0 else 'held'} but "
              f"{'missing from' if rc == 0 else 'present in'} the free list", group=group, block=b,
              expected="in free list" if rc == 0 else "not in free list", found=f"refcount {rc}")


def _check_shared_count(alloc, refcounts: np.ndarray, group: str) -> None:
    shared = int(np.count_nonzero(refcounts >= 2))
    if alloc.num_shared != shared:
        _fail("refcount-holders", f"{alloc.tier} allocator's num_shared differs from its blocks of refcount >= 2",
              group=group, expected=shared, found=alloc.num_shared)


def _holder_of(mgr, g: int, block: int):
    """Some sequence whose block list holds ``block`` (for error messages)."""
    for seq_id, st in mgr._seqs.items():
        if block in mgr._tables[g][st.row, :mgr._npages[g][st.row]]:
            return seq_id
    return None


def validate_manager(mgr) -> None:
    G = len(mgr.groups)
    for g in range(G):
        _check_allocator(mgr.allocators[g], mgr.groups[g].name)
        _check_allocator(mgr.host_allocators[g], mgr.groups[g].name)

    seq_ids = list(mgr._seqs)
    states = [mgr._seqs[s] for s in seq_ids]
    rows = np.array([st.row for st in states], dtype=np.int64)
    if len(set(rows.tolist())) != rows.size:
        _, first = np.unique(rows, return_index=True)
        i = int(np.setdiff1d(np.arange(rows.size), first)[0])
        _fail("stale-row", "two sequences share a table row", seq=seq_ids[i], expected="unique row", found=int(rows[i]))
    lengths, reserved = mgr._length[rows].astype(np.int64), mgr._reserved[rows].astype(np.int64)
    bad = (lengths < 0) | (reserved < 0)
    if bad.any():
        i = int(np.argmax(bad))
        _fail("length-formula", "negative length or reservation", seq=seq_ids[i], expected=">= 0",
              found=(int(lengths[i]), int(reserved[i])))
    swapped = np.array([st.swapped is not None for st in states], dtype=bool)
    bad = swapped & (reserved != 0)
    if bad.any():
        i = int(np.argmax(bad))
        _fail("swapped", "a swapped-out sequence holds a reservation", seq=seq_ids[i], expected=0,
              found=int(reserved[i]))
    rows_in_use = set(rows.tolist())

    for g, spec in enumerate(mgr.groups):
        held = _check_group_rows(mgr, g, spec, seq_ids, rows, lengths, reserved, swapped)
        host_held = []
        if swapped.any():
            for i in np.flatnonzero(swapped):
                host_held += _check_swapped(mgr, g, spec, seq_ids[i], states[i], int(lengths[i]), int(rows[i]))
        holders = np.bincount(held, minlength=mgr.num_blocks[g])
        rc = np.asarray(mgr.allocators[g].refcounts(), dtype=np.int64)
        bad = rc != holders
        if bad.any():
            b = int(np.argmax(bad))
            _fail("refcount-holders", "primary refcount differs from the number of block-list entries holding it",
                  seq=_holder_of(mgr, g, b), group=spec.name, block=b, expected=int(holders[b]), found=int(rc[b]))
        _check_shared_count(mgr.allocators[g], rc, spec.name)
        host_holders = np.bincount(np.asarray(host_held, dtype=np.int64), minlength=mgr.host_blocks[g])
        rc = np.asarray(mgr.host_allocators[g].refcounts(), dtype=np.int64)
        bad = rc != host_holders
        if bad.any():
            b = int(np.argmax(bad))
            _fail("refcount-holders", "secondary refcount differs from the number of swapped pages holding it",
                  group=spec.name, block=b, expected=int(host_holders[b]), found=int(rc[b]))
        _check_shared_count(mgr.host_allocators[g], rc, spec.name)
        if mgr.prefix is not None:
            _check_prefix(mgr, g, spec)
        free_rows = np.ones(mgr._tables[g].shape[0], dtype=bool)
        free_rows[list(rows_in_use)] = False
        stale = np.flatnonzero(np.any(mgr._tables[g][free_rows] != INVALID_BLOCK, axis=1))
        if stale.size:
            _fail("stale-row", "a table row no sequence owns holds block ids", group=spec.name,
                  expected=INVALID_BLOCK, found=int(np.flatnonzero(free_rows)[stale[0]]))


def _check_group_rows(mgr, g, spec, seq_ids, rows, lengths, reserved, swapped) -> np.ndarray:
    """Checks of every sequence's block list in group ``g``, vectorised over sequences (sequence order
    decides which violation is "first"). Returns the block ids held (with repeats)."""
    lay = spec.layout
    nb = mgr.num_blocks[g]
    S = rows.size
    table = mgr._tables[g][rows]  # [S, cols]
    n = mgr._npages[g][rows].astype(np.int64)
    expect = lay.pages_needed(lengths + reserved).astype(np.int64) if S else n
    bad = n != expect
    if bad.any():
        i = int(np.argmax(bad))
        _fail("row-extent", "block-list entries differ from pages_needed(length + reserved)", seq=seq_ids[i],
              group=spec.name, expected=int(expect[i]), found=int(n[i]))
    cols = np.arange(table.shape[1])[None, :]
    inside = cols < n[:, None]
    tail = ~inside & (table != INVALID_BLOCK)
    if tail.any():
        i, j = np.argwhere(tail)[0]
        _fail("row-extent", "block ids past the sequence's pages", seq=seq_ids[i], group=spec.name, page=int(j),
              expected=INVALID_BLOCK, found=int(table[i, j]))
    out = inside & ((table < INVALID_BLOCK) | (table >= nb))
    if out.any():
        i, j = np.argwhere(out)[0]
        _fail("block-range", f"entry outside [-1, {nb})", seq=seq_ids[i], group=spec.name, page=int(j),
              expected=f"[-1, {nb})", found=int(table[i, j]))
    if spec.mode == WindowMode.CYCLIC:
        bad = n > spec.ring_pages
        if bad.any():
            i = int(np.argmax(bad))
            _fail("cyclic-range", "a ring sequence holds more pages than sinks + bubble + ring", seq=seq_ids[i],
                  group=spec.name, expected=spec.ring_pages, found=int(n[i]))
        bad = (reserved > 0) & (lay.cyclic_len < spec.window + reserved - 1)
        if bad.any():
            i = int(np.argmax(bad))
            _fail("cyclic-range", "reservation does not fit the ring (cyclic_len >= window + reserved - 1)",
                  seq=seq_ids[i], group=spec.name, expected=int(spec.window + reserved[i] - 1), found=lay.cyclic_len)
    # pages a future query may read must hold a block; RELEASE pages out of the window must be -1
    if spec.mode == WindowMode.RELEASE:
        lo_hi = np.array([released_page_range(spec, int(L)) for L in lengths], dtype=np.int64).reshape(S, 2)
        released = (cols >= lo_hi[:, :1]) & (cols < lo_hi[:, 1:])
    else:
        released = np.zeros_like(inside)
    must = inside & ~released
    valid = table != INVALID_BLOCK
    # the length formula on what the table actually holds: its extent must give back the slots used
    extent = np.where(valid.any(axis=1), table.shape[1] - np.argmax(valid[:, ::-1], axis=1), 0)
    slots = lay.slots_used(lengths + reserved)
    found = length_from_pages(extent, last_page_len(slots, lay.page_size), lay.page_size)
    bad = (found != slots) & ~swapped
    if bad.any():
        i = int(np.argmax(bad))
        _fail("length-formula", "length_from_pages(held pages, last_page_len) differs from the slots the "
              "length uses", seq=seq_ids[i], group=spec.name, expected=int(slots[i]), found=int(found[i]))
    hole = must & ~valid
    hole[swapped] = False
    if hole.any():
        i, j = np.argwhere(hole)[0]
        _fail("page-in-live-range", "invalid page inside the live range", seq=seq_ids[i], group=spec.name,
              page=int(j), expected="a block", found=INVALID_BLOCK)
    kept = released & valid
    if kept.any():
        i, j = np.argwhere(kept)[0]
        _fail("page-in-live-range", "page outside the window was not released", seq=seq_ids[i], group=spec.name,
              page=int(j), block=int(table[i, j]), expected=INVALID_BLOCK, found=int(table[i, j]))
    # no block written by two live sequences: the pages reserved slots land in are private and uncached
    for i in np.flatnonzero(reserved > 0) if reserved.any() else ():
        for j in written_pages(spec, int(lengths[i]), int(reserved[i])):
            b = int(table[i, j])
            rc = mgr.allocators[g].refcount(b)
            if rc != 1:
                _fail("shared-write", "reserved slots land in a block other holders read", seq=seq_ids[i],
                      group=spec.name, page=int(j), block=b, expected=1, found=rc)
            if mgr.prefix is not None and mgr.prefix[g].is_cached(b):
                _fail("shared-write", "reserved slots land in a cached prefix block", seq=seq_ids[i],
                      group=spec.name, page=int(j), block=b, expected="not cached", found="cached")
    return table[valid].astype(np.int64)


def _check_swapped(mgr, g, spec, seq_id, st, L, row) -> list[int]:
    """A swapped-out sequence holds no device block and one host block per live page."""
    n = int(mgr._npages[g][row])
    entries = mgr._tables[g][row, :n]
    device = np.flatnonzero(entries != INVALID_BLOCK)
    if device.size:
        _fail("swapped", "a swapped-out sequence still holds a device block", seq=seq_id, group=spec.name,
              page=int(device[0]), expected=INVALID_BLOCK, found=int(entries[device[0]]))
    lo, hi = released_page_range(spec, L)
    live = [j for j in range(n) if not lo <= j < hi]
    swapped_pages = [j for j, _, _ in st.swapped[g]]
    if swapped_pages != live:
        _fail("swapped", "host copies do not cover exactly the live pages", seq=seq_id, group=spec.name,
              expected=live, found=swapped_pages)
    hosts = [h for _, h, _ in st.swapped[g]]
    for h in hosts:
        if not 0 <= h < mgr.host_blocks[g]:
            _fail("block-range", "host block outside the secondary tier", seq=seq_id, group=spec.name,
                  block=h, expected=f"[0, {mgr.host_blocks[g]})", found=h)
    return hosts


def _check_prefix(mgr, g, spec) -> None:
    cache = mgr.prefix[g]
    nb = mgr.num_blocks[g]
    count = 0
    for digest, b in cache.items():
        count += 1
        if not 0 <= b < nb:
            _fail("prefix-cache", "cached block id out of range", group=spec.name, block=b, expected=f"[0, {nb})",
                  found=b)
        if cache.hash_of(b) != digest:
            _fail("prefix-cache", "hash -> block and block -> hash maps disagree", group=spec.name, block=b,
                  expected=digest.hex(), found=(cache.hash_of(b) or b"").hex())
        if len(cache._tokens_of[b]) != spec.page_size:
            _fail("prefix-cache", "a cached block is not full", group=spec.name, block=b,
                  expected=spec.page_size, found=len(cache._tokens_of[b]))
    if count != len(list(cache.cached_blocks())):
        _fail("prefix-cache", "hash and block maps differ in size", group=spec.name,
              expected=count, found=len(list(cache.cached_blocks())))
    flagged = np.flatnonzero(cache._is_cached).tolist()
    if flagged != sorted(cache.cached_blocks()):
        b = min(set(flagged) ^ set(cache.cached_blocks()))
        _fail("prefix-cache", "the by-block cached flags differ from the block -> hash map", group=spec.name,
              block=b, expected=cache.is_cached(b), found=b in flagged)


def validate_step(step, num_blocks, layouts) -> None:
    """Check one ``StepBatch`` against the layout contract, given each group's pool size and layout
    (``KVCacheManager.validate_step`` passes its own)."""
    B, T = step.num_seqs, step.num_tokens
    cu = step.cu_q_lens
    if cu.shape != (B + 1,) or (B and cu[0] != 0) or np.any(np.diff(cu) < 0):
        _fail("indptr-monotone", "cu_q_lens must start at 0 and be non-decreasing", expected="monotone",
              found=cu.tolist())
    if not np.array_equal(step.kv_lens, step.past_lens + step.q_lens):
        _fail("pages-vs-kv-len", "kv_lens != past_lens + q_lens", expected=(step.past_lens + step.q_lens).tolist(),
              found=step.kv_lens.tolist())
    expect_seq = np.repeat(np.arange(B), np.diff(cu))
    if not np.array_equal(step.token_seq, expect_seq):
        _fail("table-vs-indices", "token_seq disagrees with cu_q_lens", expected=expect_seq.tolist(),
              found=step.token_seq.tolist())
    expect_pos = step.past_lens[expect_seq] + np.arange(T) - cu[expect_seq]
    if not np.array_equal(step.positions, expect_pos):
        _fail("table-vs-indices", "positions != past_len + index in the sequence", expected=expect_pos.tolist(),
              found=step.positions.tolist())
    for g, gs in enumerate(step.groups):
        lay = layouts[g]
        ptr = gs.kv_indptr
        if ptr.shape != (B + 1,) or ptr[0] != 0 or np.any(np.diff(ptr) < 0) or ptr[-1] != gs.kv_indices.size:
            _fail("indptr-monotone", "kv_indptr must start at 0, be non-decreasing and end at len(kv_indices)",
                  group=gs.name, expected=f"0..{gs.kv_indices.size}", found=ptr.tolist())
        pages = np.diff(ptr)
        expect = lay.pages_needed(step.kv_lens)
        bad = np.flatnonzero(pages != expect)
        if bad.size:
            b = int(bad[0])
            _fail("pages-vs-kv-len", "pages != pages_needed(kv_len)", seq=step.seq_ids[b], group=gs.name,
                  expected=int(expect[b]), found=int(pages[b]))
        slots = lay.slots_used(step.kv_lens)
        length = length_from_pages(pages, gs.last_page_lens, lay.page_size)
        bad = np.flatnonzero((length != slots) | (gs.last_page_lens < 1) | (gs.last_page_lens > lay.page_size))
        if bad.size:
            b = int(bad[0])
            _fail("length-formula", "length_from_pages(pages, last_page_len) != slots_used(kv_len)",
                  seq=step.seq_ids[b], group=gs.name, expected=int(slots[b]), found=int(length[b]))
        table = gs.meta.block_table
        for b in range(B):
            row = table[b]
            seg = gs.kv_indices[ptr[b]:ptr[b + 1]]
            if not np.array_equal(row[:pages[b]], seg) or np.any(row[pages[b]:] != INVALID_BLOCK):
                _fail("table-vs-indices", "block-table row differs from its kv_indices segment (+ -1 padding)",
                      seq=step.seq_ids[b], group=gs.name, expected=seg.tolist(), found=row.tolist())
        if T:
            nbk = num_blocks[g]
            for b in range(B):
                pos = step.positions[cu[b]:cu[b + 1]]
                block, _, raw = lay.locate(table[b], pos, nbk)
                bad = block == INVALID_BLOCK
                if bad.any():
                    i = int(np.argmax(bad))
                    page, _ = lay.slot_to_page(lay.token_slot(pos[i]))
                    _fail("token-without-page", f"new token at position {int(pos[i])} has no valid page",
                          seq=step.seq_ids[b], group=gs.name, page=int(page), expected=f"[0, {nbk})",
                          found=int(raw[i]))
