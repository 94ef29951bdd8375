"""Prefix reuse: full blocks identified by a hash of their token ids chained with the previous block's hash.

``block_hash(parent, tokens)`` is a 128-bit BLAKE2b digest of the parent digest and the block's token ids
(int32, little endian), so equal hashes mean equal whole prefixes (up to a 2^-128 collision, and the cache
also keeps each block's tokens and compares them on a hit, so a collision can never hand out wrong KV).
The chain root is a salt (``b""`` by default; e.g. an adapter id keeps different adapters apart).

A registered block is immutable: only full blocks are registered, sequences never write into full blocks
of a linear cache, and a sequence about to write into a registered block gets a private copy first (or,
when it is the only holder, takes the block out of the cache). A registered block whose last holder leaves
stays in the cache while it sits in the allocator's free list; the allocator hands out the oldest free
blocks first, and handing one out evicts its entry (``forget``).
"""

from __future__ import annotations

import hashlib

import numpy as np


_TOKEN_BYTES = np.dtype("<i4")


def block_hash(parent: bytes, tokens: np.ndarray) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.ascontiguousarray(tokens, dtype=_TOKEN_BYTES))
    return h.digest()


class PrefixCache:
    """hash -> block of one pool group (primary tier) of ``num_blocks`` blocks, with the tokens of each cached
    block, and which blocks are cached as a bool array (``cached_among`` asks it for a step's written pages at
    once)."""

    def __init__(self, num_blocks: int):
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._tokens_of: dict[int, np.ndarray] = {}
        self._is_cached = np.zeros(num_blocks, dtype=bool)  # kept with _hash_of by register and forget

    def __len__(self) -> int:
        return len(self._block_of)

    def lookup(self, digest: bytes, tokens: np.ndarray) -> int | None:
        block = self._block_of.get(digest)
        if block is None or not np.array_equal(self._tokens_of[block], tokens):
            return None
        return block

    def register(self, block: int, digest: bytes, tokens: np.ndarray) -> bool:
        """Cache ``block`` under ``digest`` unless that hash is cached already (the first copy stays)."""
        if digest in self._block_of or block in self._hash_of:
            return False
        self._is_cached[block] = True  # (first: a block outside the pool raises before anything changed)
        self._block_of[digest] = block
        self._hash_of[block] = digest
        self._tokens_of[block] = np.array(tokens, dtype=np.int32, copy=True)
        return True

    def forget(self, block: int) -> bool:
        digest = self._hash_of.pop(block, None)
        if digest is None:
            return False
        del self._block_of[digest]
        del self._tokens_of[block]
        self._is_cached[block] = False
        return True

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def cached_among(self, blocks: np.ndarray) -> list[int]:
        """The cached blocks among ``blocks`` (an int array of valid ids), sorted, each once."""
        hit = self._is_cached[blocks]
        return np.unique(blocks[hit]).tolist() if hit.any() else []

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    def items(self):
        """(hash, block) pairs."""
        return self._block_of.items()

    def cached_blocks(self):
        return self._hash_of.keys()

    def snapshot(self) -> tuple:
        return tuple(sorted(self._hash_of.items()))
