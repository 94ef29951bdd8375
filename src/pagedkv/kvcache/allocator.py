"""Block allocator: reference counts and a free list, O(1) per block.

The free list is a doubly linked list threaded through two int lists (``prev``/``next``, with a sentinel at
index ``num_blocks``), so a block can leave it from the middle in O(1): that is how a free block that still
holds a cached prefix is revived by a prefix hit. Blocks are handed out from the head and returned to the
tail, so the free blocks that were released longest ago are reused (evicted from the prefix cache) first.

A block is free exactly when its reference count is 0. Holders are block-table entries of live sequences;
the validator checks ``refcount == holders`` for every block. ``num_shared`` counts the blocks of two holders
or more (kept where refcounts change): while it is 0, no write needs a copy-on-write, and a batched reserve
skips looking up the refcounts of every page it writes.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from pagedkv.kvcache.errors import BlockRefcountError, KVCacheExhaustedError


class BlockAllocator:
    """Reference-counted blocks ``0 .. num_blocks - 1`` of one pool group and tier."""

    def __init__(self, num_blocks: int, name: str = "pool", tier: str = "primary"):
        if int(num_blocks) < 0:
            raise ValueError(f"num_blocks: must be >= 0, got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self.name, self.tier = name, tier
        n = self.num_blocks
        self._sentinel = n
        self._refcount = [0] * n
        # Initially every block is free, in id order: head -> 0 -> 1 -> ... -> n-1 -> sentinel.
        self._next = list(range(1, n + 1)) + [0 if n else n]
        self._prev = ([n] + list(range(0, n - 1)) + [n - 1]) if n else [0]
        self._num_free = n
        self._num_shared = 0  # blocks with refcount >= 2

    # ---- queries -------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def num_shared(self) -> int:
        """Blocks held more than once (refcount >= 2)."""
        return self._num_shared

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._refcount[block]

    def refcounts_of(self, blocks) -> np.ndarray:
        """int64 reference counts of ``blocks`` (valid ids; a batch lookup for the batched reserve)."""
        refcount = self._refcount
        return np.fromiter((refcount[b] for b in blocks), dtype=np.int64, count=len(blocks))

    def refcounts(self) -> list[int]:
        """A copy of all reference counts (for the validator and snapshots)."""
        return list(self._refcount)

    def free_list(self) -> Iterator[int]:
        """The free blocks from head (next to be handed out) to tail, walking the links."""
        b = self._next[self._sentinel]
        steps = 0
        while b != self._sentinel:
            yield b
            b = self._next[b]
            steps += 1
            if steps > self.num_blocks:  # a cycle: corrupt links; let the validator report it
                raise BlockRefcountError(f"{self.name}: free list has a cycle", b, self._refcount[b])

    def free_list_backwards(self) -> Iterator[int]:
        b = self._prev[self._sentinel]
        steps = 0
        while b != self._sentinel:
            yield b
            b = self._prev[b]
            steps += 1
            if steps > self.num_blocks:
                raise BlockRefcountError(f"{self.name}: free list has a cycle (backwards)", b, self._refcount[b])

    # ---- operations ----------------------------------------------------------------------------------
    def allocate(self, count: int, seq=None, what: str = "") -> list[int]:
        """Take ``count`` free blocks (refcount 1 each). Raises ``KVCacheExhaustedError`` before touching
        anything when fewer are free."""
        if count < 0:
            raise ValueError(f"count: must be >= 0, got {count}")
        if count > self._num_free:
            raise KVCacheExhaustedError(needed=count, free=self._num_free, group=self.name, tier=self.tier,
                                        seq=seq, what=what)
        nxt, prev, refcount, sentinel = self._next, self._prev, self._refcount, self._sentinel
        out = []
        b = nxt[sentinel]
        for _ in range(count):  # the first ``count`` blocks of the list, unlinked at once (not one by one)
            out.append(b)
            refcount[b] = 1
            following = nxt[b]
            nxt[b] = prev[b] = -1
            b = following
        nxt[sentinel], prev[b] = b, sentinel  # b: the first block left free (or the sentinel)
        self._num_free -= count
        return out

    def incref(self, block: int) -> None:
        """One more holder. A free block (refcount 0) leaves the free list: a revived cached block."""
        self._check_id(block)
        rc = self._refcount[block]
        if rc == 0:
            self._unlink(block)
        elif rc == 1:
            self._num_shared += 1
        self._refcount[block] = rc + 1

    def decref(self, block: int) -> bool:
        """One holder less; returns True when the block became free (appended to the tail)."""
        self._check_id(block)
        rc = self._refcount[block]
        if rc <= 0:
            raise BlockRefcountError(f"{self.name} ({self.tier}): block {block} released while free "
                                     f"(refcount {rc}): double free", block, rc)
        self._refcount[block] = rc - 1
        if rc == 2:
            self._num_shared -= 1
        elif rc == 1:
            self._link_tail(block)
            return True
        return False

    # ---- links ---------------------------------------------------------------------------------------
    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"{self.name} ({self.tier}): block id {block} outside [0, {self.num_blocks})")

    def _unlink(self, b: int) -> None:
        p, n = self._prev[b], self._next[b]
        self._next[p] = n
        self._prev[n] = p
        self._prev[b] = self._next[b] = -1
        self._num_free -= 1

    def _link_tail(self, b: int) -> None:
        s = self._sentinel
        last = self._prev[s]
        self._next[last] = b
        self._prev[b] = last
        self._next[b] = s
        self._prev[s] = b
        self._num_free += 1

    def snapshot(self) -> tuple:
        """Everything that defines the allocator's state (tests compare snapshots around failed calls)."""
        return (tuple(self._refcount), tuple(self._next), tuple(self._prev), self._num_free, self._num_shared)
