"""The KV cache manager: sequences, block tables, refcounts, fork / copy-on-write, prefix reuse, windows,
offload to a pinned host tier, and step metadata.

The bookkeeping (block ids, tables, refcounts, hashes) is separate from memory: ``storage="none"`` runs the
host model (bookkeeping only, every block copy still recorded in ``copy_log``), ``"numpy"`` adds exact host
pools (for the references and the CPU tests), ``"device"`` drives real cuda-python pools with the same
class. Each copy the bookkeeping decides (copy-on-write, offload, reload) is recorded as a ``BlockCopy`` and
executed by the storage, on the manager's stream for device pools.

Typical step::

    mgr = KVCacheManager([spec], num_blocks=1024, storage="device")
    mgr.add_sequence("a", prompt_tokens=prompt)   # may reuse cached prefix blocks; returns tokens reused
    mgr.reserve("a", 512)                          # room for a 512-token prefill chunk (allocates, COW)
    step = mgr.build_step(["a"])                   # StepBatch: block tables, cu_q_lens, past_lens, ...
    ... run the engine on step ...
    mgr.commit("a", 512)                           # the chunk's KV is now in the cache

Batched (a scheduler's step: the same operations for many sequences, planned with numpy)::

    mgr.reserve_many(ids, counts)                  # all-or-nothing over every sequence and group
    step = mgr.build_step_many(ids, counts)
    mgr.commit_many(ids, counts, tokens_of=...)    # token ids fetched only for pages that become full

Ordering: device copies are enqueued on ``mgr.stream`` when the bookkeeping decides them; run the kernels
of the step on the same stream (or wait for it), so that a copy-on-write lands before the write it protects.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np

from pagedkv.kvcache.allocator import BlockAllocator
from pagedkv.kvcache.copies import BlockCopy, NumpyPools, Tier
from pagedkv.kvcache.errors import KVCacheExhaustedError
from pagedkv.kvcache.metadata import StepBatch, build_step_arrays, pool_descriptors
from pagedkv.kvcache.prefix import PrefixCache, block_hash
from pagedkv.kvcache.sequences import (SequenceState, check_cyclic_step, committed_tokens_in_page, pages_needed,
                                       released_page_range, written_pages)
from pagedkv.kvcache.sizing import blocks_for_budget, budget_from_free_memory
from pagedkv.layout import INVALID_BLOCK
from pagedkv.pool_group import PoolGroup, WindowMode

STORAGE_KINDS = ("none", "numpy", "device")
_NO_ROWS = np.zeros(0, dtype=np.int64)  # no sequence of a batch (shared, so read-only)
_NO_ROWS.flags.writeable = False


class SeqBatch:
    """Live sequences checked once for the batched calls of one step (``KVCacheManager.seq_batch``): their ids
    and table rows. It stays usable while no sequence leaves the manager or the device (free, swap_out);
    after that the batched calls refuse it."""

    __slots__ = ("ids", "rows", "epoch")

    def __init__(self, ids: tuple, rows: np.ndarray, epoch: int):
        self.ids, self.rows, self.epoch = ids, rows, epoch

    def __len__(self) -> int:
        return len(self.ids)


def _per_group(value, n: int, name: str) -> list[int]:
    if isinstance(value, (int, np.integer)):
        values = [int(value)] * n
    else:
        values = [int(v) for v in value]
        if len(values) != n:
            raise ValueError(f"{name}: expected one value per pool group ({n}), got {len(values)}")
    for i, v in enumerate(values):
        if v < 0:
            raise ValueError(f"{name}[{i}]: must be >= 0, got {v}")
    return values


def _batch_counts(num_tokens, rows: np.ndarray):
    """A batched call's token counts: an int (one count for all, broadcast by numpy without a [B] array) or
    int64 [B]."""
    if isinstance(num_tokens, (int, np.integer)):
        return int(num_tokens)
    n = np.asarray(num_tokens, dtype=np.int64)
    if n.ndim == 0:
        return int(n)
    return n if n.shape == rows.shape else np.broadcast_to(n, rows.shape)


def split_step_entries(entries: Iterable) -> tuple[list, list[int]]:
    """``build_step``'s entries as (sequence ids, new-token counts); -1: the sequence's whole reservation."""
    ids, counts = [], []
    for e in entries:
        if isinstance(e, tuple):
            ids.append(e[0])
            counts.append(int(e[1]))
        else:
            ids.append(e)
            counts.append(-1)
    return ids, counts


class KVCacheManager:
    """Pools, block tables and step metadata for a set of pool groups.

    Args:
        groups: the pool groups (``PoolGroup``), names unique. Row g of ``kv_pools`` is group g.
        num_blocks: primary-tier blocks, one count for all groups or one per group.
        host_blocks: secondary-tier (pinned host) blocks for offloading, 0 for none.
        storage: "none" (host model), "numpy" (host pools) or "device" (cuda-python pools).
        enable_prefix_reuse: register full blocks by token hash and reuse them for new sequences. Needs every
            group to be FULL (windowed groups release or overwrite blocks, so their prefixes cannot be kept).
        debug_validate: run the validator after every operation (default: env ``PAGEDKV_KV_DEBUG=1``).
        stream: ``pagedkv.cuda.Stream`` for device copies and uploads (created when None and storage="device").
        poison: fill new pools with 0xFF bytes (NaN for float caches) so unwritten slots are recognisable.
    """

    def __init__(self, groups: Sequence[PoolGroup], num_blocks, *, host_blocks=0, storage: str = "none",
                 enable_prefix_reuse: bool = False, debug_validate: bool | None = None, stream=None,
                 poison: bool = True):
        self.groups: tuple[PoolGroup, ...] = tuple(groups)
        if not self.groups:
            raise ValueError("groups: at least one pool group is needed")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"groups: names must be unique, got {names}")
        if storage not in STORAGE_KINDS:
            raise ValueError(f"storage: expected one of {STORAGE_KINDS}, got {storage!r}")
        G = len(self.groups)
        self.num_blocks = _per_group(num_blocks, G, "num_blocks")
        self.host_blocks = _per_group(host_blocks, G, "host_blocks")
        for g, nb in zip(self.groups, self.num_blocks):
            if nb >= 2 ** 31 - 1:
                raise ValueError(f"num_blocks: {nb} for group {g.name!r} does not fit the int32 block table")
        if enable_prefix_reuse:
            windowed = [g.name for g in self.groups if g.mode != WindowMode.FULL]
            if windowed:
                raise ValueError(f"enable_prefix_reuse: pool group(s) {windowed} have an attention window; their "
                                 "blocks leave the cache, so a prefix cannot be reused in every group")
        self.prefix_reuse = bool(enable_prefix_reuse)
        self._cyclic = any(g.mode == WindowMode.CYCLIC for g in self.groups)  # (reserve_many goes one by one)
        self.debug_validate = (os.environ.get("PAGEDKV_KV_DEBUG", "") not in ("", "0")
                               if debug_validate is None else bool(debug_validate))

        self.allocators = [BlockAllocator(nb, g.name, "primary") for g, nb in zip(self.groups, self.num_blocks)]
        self.host_allocators = [BlockAllocator(hb, g.name, "secondary")
                                for g, hb in zip(self.groups, self.host_blocks)]
        self.prefix = [PrefixCache(nb) for nb in self.num_blocks] if self.prefix_reuse else None
        self.copy_log: list[BlockCopy] = []

        # Block tables: one int32 array per group, a row per sequence slot, -1 past each sequence's pages.
        self._row_cap = 16
        self._tables = [np.full((self._row_cap, 16), INVALID_BLOCK, dtype=np.int32) for _ in self.groups]
        self._npages = [np.zeros(self._row_cap, dtype=np.int32) for _ in self.groups]
        self._length = np.zeros(self._row_cap, dtype=np.int32)
        self._reserved = np.zeros(self._row_cap, dtype=np.int32)
        self._free_rows = list(range(self._row_cap - 1, -1, -1))
        self._seqs: dict[object, SequenceState] = {}
        self._num_swapped = 0
        self._epoch = 0  # moves when a sequence leaves (free) or goes to the host tier: SeqBatch rows go stale
        self._last_batch: SeqBatch | None = None

        self.storage_kind = storage
        self.stream = stream
        self._owns_stream = False
        self.storage = None
        self._uploader = None
        self._kv_pools_device = None
        if storage == "numpy":
            self.storage = NumpyPools(self.groups, self.num_blocks, self.host_blocks, poison=poison)
        elif storage == "device":
            from pagedkv import cuda
            from pagedkv.kvcache.pool import DevicePools

            if self.stream is None:
                self.stream = cuda.Stream()
                self._owns_stream = True
            try:
                self.storage = DevicePools(self.groups, self.num_blocks, self.host_blocks, self.stream, poison=poison)
            except BaseException:
                self.close()
                raise

    @classmethod
    def from_memory_budget(cls, groups: Sequence[PoolGroup], memory_fraction: float = 0.9, *,
                           shares: Sequence[float] | None = None, **kwargs) -> "KVCacheManager":
        """Device pools sized to ``memory_fraction`` of the device's free memory (cudaMemGetInfo)."""
        from pagedkv import cuda

        free, _ = cuda.mem_get_info()
        budget = budget_from_free_memory(memory_fraction, free)
        kwargs.setdefault("storage", "device")
        return cls(groups, blocks_for_budget(groups, budget, shares), **kwargs)

    # ---- lifetime ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release device/pinned memory, upload buffers and the owned stream (idempotent)."""
        if self._uploader is not None:
            self._uploader.close()
            self._uploader = None
        if self._kv_pools_device is not None:
            self._kv_pools_device.close()
            self._kv_pools_device = None
        if self.storage is not None:
            self.storage.close()
            self.storage = None
        if self._owns_stream and self.stream is not None:
            self.stream.close()
            self.stream = None
            self._owns_stream = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- queries -------------------------------------------------------------------------------------
    @property
    def sequences(self) -> list:
        return list(self._seqs)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def state(self, seq_id) -> SequenceState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} is not in the KV manager") from None

    def length(self, seq_id) -> int:
        """Committed tokens (the next step's past length)."""
        return int(self._length[self.state(seq_id).row])

    def reserved(self, seq_id) -> int:
        return int(self._reserved[self.state(seq_id).row])

    def prefill_remaining(self, seq_id) -> int:
        """Prompt tokens not yet in the cache (chunked prefill: the next chunk starts at ``length``)."""
        st = self.state(seq_id)
        return max(0, st.prompt_len - int(self._length[st.row]))

    def num_pages(self, seq_id, group: int = 0) -> int:
        return int(self._npages[group][self.state(seq_id).row])

    def block_row(self, seq_id, group: int = 0) -> np.ndarray:
        """A copy of the sequence's block list in ``group`` (-1 where released or swapped out)."""
        st = self.state(seq_id)
        return self._tables[group][st.row, :self._npages[group][st.row]].copy()

    def num_free(self, group: int = 0) -> int:
        return self.allocators[group].num_free

    def is_swapped(self, seq_id) -> bool:
        return self.state(seq_id).swapped is not None

    def drain_copies(self) -> list[BlockCopy]:
        """The block copies recorded since the last drain (replay them on host mirrors: ``apply_copies``)."""
        out, self.copy_log = self.copy_log, []
        return out

    def pool(self, group: int = 0, tier: Tier = Tier.PRIMARY) -> np.ndarray:
        """The numpy pool of a group (storage="numpy")."""
        if self.storage_kind != "numpy":
            raise RuntimeError(f"pool(): only numpy storage exposes pool arrays (storage={self.storage_kind!r})")
        return self.storage.pool(group, tier)

    # ---- sequences -----------------------------------------------------------------------------------
    def add_sequence(self, seq_id, prompt_tokens=None, *, salt: bytes = b"") -> int:
        """Start a sequence. With prefix reuse, cached full blocks matching the prompt's first tokens are
        shared (never all of the prompt: its last token is always computed). Returns the number of reused
        tokens, which is the sequence's committed length and the next chunk's past length."""
        if seq_id in self._seqs:
            raise ValueError(f"add_sequence: sequence {seq_id!r} exists already")
        if prompt_tokens is not None:  # checked before a table row is taken: a refused prompt leaks no row
            prompt = np.asarray(prompt_tokens, dtype=np.int64).ravel()
            if prompt.size and (prompt.min() < -2 ** 31 or prompt.max() >= 2 ** 31):
                raise ValueError("prompt_tokens: token ids must fit int32")
        row = self._take_row()
        st = SequenceState(seq_id, row, len(self.groups), salt=bytes(salt))
        if prompt_tokens is not None:
            st.append_tokens(prompt.astype(np.int32))
            st.prompt_len = int(prompt.size)
        self._seqs[seq_id] = st
        reused = self._adopt_prefix(st) if self.prefix_reuse else 0
        self._length[row] = reused
        self._reserved[row] = 0
        self._debug_check()
        return reused

    def _adopt_prefix(self, st: SequenceState) -> int:
        tokens = st.known_tokens()
        matches = []
        for g, spec in enumerate(self.groups):
            P = spec.page_size
            parent, blocks, hashes = st.salt, [], []
            for j in range(len(tokens) // P):
                toks = tokens[j * P:(j + 1) * P]
                digest = block_hash(parent, toks)
                block = self.prefix[g].lookup(digest, toks)
                if block is None:
                    break
                blocks.append(block)
                hashes.append(digest)
                parent = digest
            matches.append((blocks, hashes))
        reused = min(len(blocks) * spec.page_size for (blocks, _), spec in zip(matches, self.groups))
        reused = min(reused, max(0, len(tokens) - 1))
        if reused == 0:
            return 0
        for g, ((blocks, hashes), spec) in enumerate(zip(matches, self.groups)):
            k = pages_needed(spec, reused)
            self._ensure_cols(g, k)
            for b in blocks[:k]:
                self.allocators[g].incref(b)  # revives a free cached block
            self._tables[g][st.row, :k] = blocks[:k]
            self._npages[g][st.row] = k
            st.hashes[g] = hashes[:reused // spec.page_size]
        return reused

    def reserve(self, seq_id, num_tokens: int) -> None:
        """Make room for ``num_tokens`` new tokens after the committed length: allocate the pages they need
        and give the sequence a private copy of any shared page they land in (copy-on-write). Idempotent for
        an existing, large enough reservation. All-or-nothing: ``KVCacheExhaustedError`` (or a cyclic-window
        ``ValueError``) changes nothing."""
        st = self._live(seq_id, "reserve")
        if num_tokens < 0:
            raise ValueError(f"reserve: num_tokens must be >= 0, got {num_tokens} (sequence {seq_id!r})")
        row = st.row
        L = int(self._length[row])
        R = max(int(self._reserved[row]), int(num_tokens))
        if L + R >= 2 ** 31:
            raise ValueError(f"reserve: length {L} + {R} new tokens overflows int32 positions (sequence {seq_id!r})")
        plans = []
        for g, spec in enumerate(self.groups):  # plan everything, then check, then act
            cyclic = spec.mode == WindowMode.CYCLIC
            if cyclic:
                check_cyclic_step(spec, R, seq_id)
            cur = int(self._npages[g][row])
            need = pages_needed(spec, L + R)
            table_row = self._tables[g][row]
            cow, uncache = [], []
            # Pages already held that the new tokens land in. Linear: only page L // P can hold committed
            # tokens (later held pages are this sequence's earlier reservation, private); a ring: any.
            held_written = (written_pages(spec, L, R).tolist() if cyclic
                            else [L // spec.page_size] if R and L // spec.page_size < cur else [])
            for j in held_written:
                if j >= cur:
                    continue
                b = int(table_row[j])
                assert b >= 0, f"internal: written page {j} of {seq_id!r} has no block"
                if self.allocators[g].refcount(b) > 1:
                    cow.append((j, b, committed_tokens_in_page(spec, j, L)))
                elif self.prefix is not None and self.prefix[g].is_cached(b):
                    uncache.append(b)  # sole holder: leave the cache and write in place
            plans.append((cur, need, cow, uncache))
        for g, (cur, need, cow, _) in enumerate(plans):
            count = max(0, need - cur) + len(cow)
            if count > self.allocators[g].num_free:
                raise KVCacheExhaustedError(needed=count, free=self.allocators[g].num_free,
                                            group=self.groups[g].name, seq=seq_id,
                                            what=f"reserve {R} token(s) after {L}: {max(0, need - cur)} new "
                                                 f"page(s), {len(cow)} copy-on-write")
        for g, (cur, need, cow, uncache) in enumerate(plans):
            spec = self.groups[g]
            blocks = self._allocate(g, max(0, need - cur) + len(cow), seq_id)
            self._ensure_cols(g, need)  # (may reallocate the table: take the row view afterwards)
            table_row = self._tables[g][row]
            for (j, old, keep), new in zip(cow, blocks):
                if keep > 0:
                    self._copy(BlockCopy(g, Tier.PRIMARY, old, Tier.PRIMARY, new,
                                         keep if keep < spec.page_size else 0))
                table_row[j] = new
                self.allocators[g].decref(old)
            for b in uncache:
                self.prefix[g].forget(b)
            if need > cur:
                table_row[cur:need] = blocks[len(cow):]
                self._npages[g][row] = need
        self._reserved[row] = R
        self._debug_check()

    def unreserve(self, seq_id) -> None:
        """Drop the reservation: pages beyond the committed length go back to the pool."""
        st = self._live(seq_id, "unreserve")
        row = st.row
        L = int(self._length[row])
        for g, spec in enumerate(self.groups):
            keep = pages_needed(spec, L)
            self._drop_pages(g, row, keep, int(self._npages[g][row]))
            self._npages[g][row] = keep
        self._reserved[row] = 0
        self._debug_check()

    def commit(self, seq_id, num_tokens: int, token_ids=None) -> None:
        """The step wrote ``num_tokens`` reserved tokens: they become part of the cache. ``token_ids`` (the
        step's input tokens for this sequence) extend the known tokens for prefix hashing; prompt tokens are
        known already. RELEASE groups then release the pages that left the window; full blocks are
        registered for prefix reuse."""
        st = self._live(seq_id, "commit")
        row = st.row
        L, R = int(self._length[row]), int(self._reserved[row])
        if not 0 <= num_tokens <= R:
            raise ValueError(f"commit: sequence {seq_id!r} has {R} reserved slot(s), cannot commit {num_tokens}")
        if token_ids is not None:
            ids = np.asarray(token_ids, dtype=np.int64).ravel()
            if ids.size != num_tokens:
                raise ValueError(f"commit: token_ids has {ids.size} entries for {num_tokens} tokens "
                                 f"(sequence {seq_id!r})")
            if ids.size and (ids.min() < -2 ** 31 or ids.max() >= 2 ** 31):  # (astype would wrap them)
                raise ValueError(f"commit: token_ids of sequence {seq_id!r} must fit int32")
            known = st.tokens_known
            overlap = max(0, min(known, L + num_tokens) - L)
            if overlap and not np.array_equal(st.tokens[L:L + overlap], ids[:overlap]):
                raise ValueError(f"commit: token_ids of sequence {seq_id!r} differ from its known tokens at "
                                 f"positions [{L}, {L + overlap})")
            if known >= L and not st.token_gap:
                st.append_tokens(ids[overlap:].astype(np.int32))
        new_len = L + num_tokens
        if st.tokens_known < new_len:
            st.token_gap = True
        self._length[row] = new_len
        self._reserved[row] = R - num_tokens
        for g, spec in enumerate(self.groups):
            if spec.mode == WindowMode.RELEASE:
                self._release_window(st, g, new_len)
            if self.prefix is not None:
                self._register_full_pages(st, g, new_len)
        self._debug_check()

    def free(self, seq_id) -> None:
        """End a sequence: its blocks lose a holder (a cached prefix block stays reusable while free)."""
        st = self.state(seq_id)
        row = st.row
        if st.swapped is not None:
            for g, entries in enumerate(st.swapped):
                for _, host_block, _ in reversed(entries):
                    self.host_allocators[g].decref(host_block)
        for g in range(len(self.groups)):
            # Last pages first: they reach the free list's front and are evicted before the prefix pages.
            self._drop_pages(g, row, 0, int(self._npages[g][row]), reverse=True)
            self._npages[g][row] = 0
        self._length[row] = 0
        self._reserved[row] = 0
        del self._seqs[seq_id]
        self._free_rows.append(row)
        self._num_swapped -= st.swapped is not None
        self._epoch += 1
        self._debug_check()

    def fork(self, src_id, dst_id) -> None:
        """A new sequence sharing all of ``src_id``'s blocks (refcounts); whichever writes first into a shared
        partial page gets a private copy (copy-on-write at ``reserve``)."""
        src = self._live(src_id, "fork")
        if dst_id in self._seqs:
            raise ValueError(f"fork: sequence {dst_id!r} exists already")
        if self._reserved[src.row]:
            raise ValueError(f"fork: sequence {src_id!r} has {int(self._reserved[src.row])} reserved slot(s); commit "
                             "or unreserve before forking (reserved slots are private by definition)")
        row = self._take_row()
        child = SequenceState(dst_id, row, len(self.groups), prompt_len=src.prompt_len, salt=src.salt,
                              tokens=src.tokens.copy(), tokens_known=src.tokens_known, token_gap=src.token_gap,
                              hashes=[list(h) for h in src.hashes], released_hi=list(src.released_hi))
        for g in range(len(self.groups)):
            n = int(self._npages[g][src.row])
            self._ensure_cols(g, n)
            entries = self._tables[g][src.row, :n]
            for b in entries:
                if b >= 0:
                    self.allocators[g].incref(int(b))
            self._tables[g][row, :n] = entries
            self._npages[g][row] = n
        self._length[row] = self._length[src.row]
        self._reserved[row] = 0
        self._seqs[dst_id] = child
        self._debug_check()

    # ---- secondary tier ------------------------------------------------------------------------------
    def swap_out(self, seq_id) -> None:
        """Offload the sequence's blocks to the pinned host tier and free them on the device (preemption).
        Partial pages copy only their committed tokens. All-or-nothing on host-tier exhaustion."""
        st = self._live(seq_id, "swap_out")
        row = st.row
        if self._reserved[row]:
            raise ValueError(f"swap_out: sequence {seq_id!r} has reserved slots; commit or unreserve first")
        L = int(self._length[row])
        held = []
        for g in range(len(self.groups)):
            n = int(self._npages[g][row])
            held.append([(j, int(b)) for j, b in enumerate(self._tables[g][row, :n]) if b >= 0])
        for g, pages in enumerate(held):
            if len(pages) > self.host_allocators[g].num_free:
                raise KVCacheExhaustedError(needed=len(pages), free=self.host_allocators[g].num_free,
                                            group=self.groups[g].name, tier="secondary", seq=seq_id, what="swap_out")
        swapped = []
        for g, pages in enumerate(held):
            spec = self.groups[g]
            host = self.host_allocators[g].allocate(len(pages), seq_id, "swap_out")
            entries = []
            for (j, b), h in zip(pages, host):
                keep = committed_tokens_in_page(spec, j, L)
                self._copy(BlockCopy(g, Tier.PRIMARY, b, Tier.SECONDARY, h, keep if keep < spec.page_size else 0))
                entries.append((j, h, keep))
            for j, b in reversed(pages):
                self._tables[g][row, j] = INVALID_BLOCK
                self.allocators[g].decref(b)
            swapped.append(entries)
        st.swapped = swapped
        self._num_swapped += 1
        self._epoch += 1
        self._debug_check()

    def swap_in(self, seq_id) -> None:
        """Reload a swapped-out sequence into fresh device blocks. All-or-nothing on device exhaustion."""
        st = self.state(seq_id)
        if st.swapped is None:
            raise ValueError(f"swap_in: sequence {seq_id!r} is not swapped out")
        for g, entries in enumerate(st.swapped):
            if len(entries) > self.allocators[g].num_free:
                raise KVCacheExhaustedError(needed=len(entries), free=self.allocators[g].num_free,
                                            group=self.groups[g].name, seq=seq_id, what="swap_in")
        for g, entries in enumerate(st.swapped):
            spec = self.groups[g]
            blocks = self._allocate(g, len(entries), seq_id)
            for (j, h, keep), b in zip(entries, blocks):
                self._copy(BlockCopy(g, Tier.SECONDARY, h, Tier.PRIMARY, b, keep if keep < spec.page_size else 0))
                self._tables[g][st.row, j] = b
                self.host_allocators[g].decref(h)
        st.swapped = None
        self._num_swapped -= 1
        self._debug_check()

    # ---- many sequences at once ----------------------------------------------------------------------
    def seq_batch(self, seq_ids, what: str = "seq_batch") -> SeqBatch:
        """Check that ``seq_ids`` are distinct live (not swapped-out) sequences and take their table rows, once
        for the batched calls of a step; errors name the sequence."""
        if isinstance(seq_ids, SeqBatch):
            if seq_ids.epoch != self._epoch:
                raise ValueError(f"{what}: the SeqBatch is stale (a sequence was freed or swapped out since)")
            return seq_ids
        ids = tuple(seq_ids)
        last = self._last_batch
        if last is not None and last.epoch == self._epoch and last.ids == ids:  # a scheduler's steady state
            return last
        seqs = self._seqs
        try:
            rows = np.fromiter([seqs[s].row for s in ids], dtype=np.int64, count=len(ids))
        except KeyError as exc:
            raise KeyError(f"{what}: sequence {exc.args[0]!r} is not in the KV manager") from None
        if self._num_swapped:
            for s in ids:
                if seqs[s].swapped is not None:
                    raise ValueError(f"{what}: sequence {s!r} is swapped out; swap_in first")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{what}: a sequence appears twice: {list(ids)}")
        self._last_batch = SeqBatch(ids, rows, self._epoch)
        return self._last_batch

    def reserve_many(self, seq_ids: Sequence | SeqBatch, num_tokens) -> None:
        """``reserve(seq, n)`` for every sequence (``num_tokens``: one count or one per sequence), planned
        together with numpy and **all-or-nothing**: when any group lacks blocks for all of them,
        ``KVCacheExhaustedError`` and nothing changed. The result is that of sequential ``reserve`` calls in
        the same order, copy-on-write included (a page several of them share: all but the last copy it, the
        last one too when a holder outside the batch remains). With a cyclic (ring) group the check counts
        every written page as a possible copy (so it may refuse a batch that would just fit) and the
        sequences are then reserved one by one."""
        batch = self.seq_batch(seq_ids, "reserve_many")
        ids, rows = batch.ids, batch.rows
        n = _batch_counts(num_tokens, rows)
        if rows.size and (n < 0 if isinstance(n, int) else n.min() < 0):
            each = np.broadcast_to(n, rows.shape)
            i = int(np.argmax(each < 0))
            raise ValueError(f"reserve_many: num_tokens must be >= 0, got {int(each[i])} (sequence {ids[i]!r})")
        L = self._length[rows].astype(np.int64)
        R = np.maximum(self._reserved[rows].astype(np.int64), n)
        end = L + R
        if rows.size and int(end.max()) >= 2 ** 31:
            i = int(np.argmax(end >= 2 ** 31))
            raise ValueError(f"reserve_many: length {int(L[i])} + {int(R[i])} new tokens overflows int32 positions "
                             f"(sequence {ids[i]!r})")
        plans = []
        for g, spec in enumerate(self.groups):  # plan, check every group, then act (as reserve does)
            cur = self._npages[g][rows]
            grow = np.maximum(spec.layout.pages_needed(end) - cur, 0)  # new pages of each sequence
            new_pages = int(grow.sum())
            if spec.mode == WindowMode.CYCLIC:
                for i in range(rows.size):
                    check_cyclic_step(spec, int(R[i]), ids[i])
                written = sum(int(np.sum(written_pages(spec, int(L[i]), int(R[i])) < cur[i])) for i in range(rows.size))
                plans.append(None)
                count = new_pages + written
            else:
                page = L // spec.page_size  # the only held page new tokens can land in (a linear cache)
                if self.allocators[g].num_shared or self.prefix is not None:
                    held = np.flatnonzero((R > 0) & (page < cur))
                    cow, uncache = self._plan_copies(g, rows[held], page[held])
                    cow = held[cow]
                else:  # no block has two holders, none is cached: no page to copy or to take out of the cache
                    cow, uncache = _NO_ROWS, []
                plans.append((cur, page, cow, uncache, grow, new_pages))
                count = new_pages + cow.size
            if count > self.allocators[g].num_free:
                raise KVCacheExhaustedError(needed=count, free=self.allocators[g].num_free, group=spec.name,
                                            what=f"reserve_many of {len(ids)} sequences: {new_pages} new "
                                                 f"page(s), {count - new_pages} copy-on-write")
        if self._cyclic:
            for seq_id, count in zip(ids, np.broadcast_to(n, rows.shape).tolist()):
                self.reserve(seq_id, count)
            return
        for g, (cur, page, cow, uncache, grow, new_pages) in enumerate(plans):
            if new_pages or cow.size:
                self._reserve_blocks(g, rows, L, cur, page, cow, grow, new_pages, ids)
            for b in uncache:
                self.prefix[g].forget(b)
        self._reserved[rows] = R
        self._debug_check()

    def _reserve_blocks(self, g: int, rows: np.ndarray, L: np.ndarray, cur: np.ndarray, page: np.ndarray,
                        cow: np.ndarray, grow: np.ndarray, new_pages: int, ids: tuple) -> None:
        """``reserve_many``'s blocks of group ``g``: ``grow[i]`` new pages after ``cur[i]`` and a copy of page
        ``page[i]`` for the sequences at ``cow``, taken from the pool in sequence order."""
        spec = self.groups[g]
        blocks = self._allocate(g, new_pages + cow.size, ids[0])
        got = np.flatnonzero(grow)
        at, first = rows[got], cur[got]
        need = first + grow[got]
        self._ensure_cols(g, int(need.max()) if got.size else 0)  # (may reallocate: index the table after)
        table, npages = self._tables[g], self._npages[g]
        if not cow.size and new_pages == got.size:  # decode: one new page each
            table[at, first] = np.asarray(blocks, dtype=np.int32)
        else:  # in sequence order: its copy-on-write block first, then its new pages (as reserve does)
            is_cow = np.zeros(rows.size, dtype=bool)
            is_cow[cow] = True
            k = 0
            for i in np.flatnonzero(grow + is_cow).tolist():
                row = int(rows[i])
                if is_cow[i]:
                    j, old, new = int(page[i]), int(table[row, page[i]]), blocks[k]
                    keep = committed_tokens_in_page(spec, j, int(L[i]))
                    if keep > 0:
                        self._copy(BlockCopy(g, Tier.PRIMARY, old, Tier.PRIMARY, new,
                                             keep if keep < spec.page_size else 0))
                    table[row, j] = new
                    self.allocators[g].decref(old)
                    k += 1
                if grow[i]:
                    table[row, int(cur[i]):int(cur[i] + grow[i])] = blocks[k:k + int(grow[i])]
                    k += int(grow[i])
        npages[at] = need

    def _plan_copies(self, g: int, rows: np.ndarray, pages: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """Which of the held pages ``(rows[i], pages[i])`` (in sequence order) a sequential reserve would copy
        (bool mask) and which blocks it would take out of the prefix cache. A block written by k of them with
        refcount c: the first k - 1 copy it, the last one copies when c > k, else writes in place (and
        uncaches it)."""
        blocks = self._tables[g][rows, pages].astype(np.int64)
        cow = np.zeros(blocks.size, dtype=bool)
        alloc = self.allocators[g]
        if alloc.num_shared and blocks.size:  # (no block of two holders: none is copied, none written twice)
            refcount = alloc.refcounts_of(blocks.tolist())
            if int(refcount.max()) > 1:
                ordered = np.sort(blocks)
                if not np.any(ordered[1:] == ordered[:-1]):  # no page written twice in the batch: copy what is shared
                    cow = refcount > 1
                else:
                    _, inverse, k = np.unique(blocks, return_inverse=True, return_counts=True)
                    order = np.argsort(inverse, kind="stable")  # occurrences grouped by block, in sequence order
                    rank = np.empty(blocks.size, dtype=np.int64)
                    rank[order] = np.arange(blocks.size) - np.repeat(np.cumsum(k) - k, k)
                    mult = k[inverse]
                    cow = (rank < mult - 1) | (refcount > mult)
        uncache = self.prefix[g].cached_among(blocks[~cow]) if self.prefix is not None else []
        return cow, uncache

    def commit_many(self, seq_ids: Sequence | SeqBatch, num_tokens, tokens_of=None) -> None:
        """``commit(seq, n)`` for every sequence. Token ids are only needed to hash pages for prefix reuse, so
        instead of each step's ids, ``tokens_of(i, start, end)`` (i: position in ``seq_ids``) is asked for
        sequence i's token ids at positions [start, end), and only when one of its pages became full; sequences
        committed this way may know fewer token ids than their length until then. Without ``tokens_of`` the tokens are unknown,
        as with ``commit(seq, n)`` (no later page of theirs is registered for prefix reuse)."""
        batch = self.seq_batch(seq_ids, "commit_many")
        ids, rows = batch.ids, batch.rows
        n = _batch_counts(num_tokens, rows)
        L = self._length[rows].astype(np.int64)
        R = self._reserved[rows].astype(np.int64)
        bad = np.less(n, 0) | (n > R)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"commit_many: sequence {ids[i]!r} has {int(R[i])} reserved slot(s), cannot commit "
                             f"{int(np.broadcast_to(n, rows.shape)[i])}")
        new_len = L + n
        self._length[rows] = new_len
        self._reserved[rows] = R - n
        for g, spec in enumerate(self.groups):
            P = spec.page_size
            if spec.mode == WindowMode.RELEASE:  # only a commit across a page boundary can release a page
                edge = np.maximum(new_len - spec.window + 1, 0) // P > np.maximum(L - spec.window + 1, 0) // P
                for i in np.flatnonzero(edge).tolist():
                    self._release_window(self._seqs[ids[i]], g, int(new_len[i]))
            if self.prefix is not None:
                for i in np.flatnonzero(new_len // P > L // P).tolist():
                    st = self._seqs[ids[i]]
                    end = int(new_len[i])
                    if tokens_of is not None and not st.token_gap and st.tokens_known < end:
                        known = np.asarray(tokens_of(i, st.tokens_known, end), dtype=np.int32)
                        if known.size != end - st.tokens_known:
                            raise ValueError(f"commit_many: tokens_of({i}, {st.tokens_known}, {end}) gives "
                                             f"{known.size} token ids for sequence {ids[i]!r}")
                        st.append_tokens(known)
                    self._register_full_pages(st, g, end)
        if tokens_of is None and self.prefix is not None:  # (unknown tokens only matter for prefix reuse)
            for i in np.flatnonzero(np.broadcast_to(n, rows.shape)).tolist():
                st = self._seqs[ids[i]]
                if st.tokens_known < int(new_len[i]):
                    st.token_gap = True
        self._debug_check()

    def build_step_many(self, seq_ids: Sequence | SeqBatch, num_tokens, position_ids=None,
                        page_indices: bool = True) -> StepBatch:
        """``build_step`` of ``(seq, n)`` pairs given as two sequences (``num_tokens``: one count or one per
        sequence), without per-entry parsing; ``page_indices=False``: without the FlashInfer-style page arrays
        (``build_step_arrays``), which engines do not read (kept under ``debug_validate``, which checks them)."""
        batch = self.seq_batch(seq_ids, "build_step")
        q = _batch_counts(num_tokens, batch.rows)
        if not isinstance(q, int):
            q = q.astype(np.int32)  # (a copy: the step's q_lens are its own)
        return self._build(batch.ids, batch.rows, q, position_ids, page_indices or self.debug_validate)

    # ---- step metadata -------------------------------------------------------------------------------
    def build_step(self, entries: Iterable, position_ids=None) -> StepBatch:
        """Metadata of one step. ``entries``: sequence ids (their whole reservation is the step's new tokens)
        or ``(seq_id, num_new_tokens)`` pairs, in the order of the step's tokens (a tuple entry is always
        read as a pair). Any mix of prefill chunks and decode tokens. Each sequence must have reserved its new
        tokens."""
        ids, counts = split_step_entries(entries)
        try:
            states = [self._seqs[s] for s in ids]
        except KeyError as exc:
            raise KeyError(f"build_step: sequence {exc.args[0]!r} is not in the KV manager") from None
        if any(st.swapped is not None for st in states):
            bad = next(st.seq_id for st in states if st.swapped is not None)
            raise ValueError(f"build_step: sequence {bad!r} is swapped out; swap_in first")
        if len(set(ids)) != len(ids):
            raise ValueError(f"build_step: a sequence appears twice in the step: {ids}")
        rows = np.fromiter((st.row for st in states), dtype=np.int64, count=len(states))
        return self._build(tuple(ids), rows, np.asarray(counts, dtype=np.int32), position_ids)

    def _build(self, ids: tuple, rows: np.ndarray, q, position_ids, page_indices: bool = True) -> StepBatch:
        """The step of sequences at ``rows`` with ``q`` new tokens each (int32 [B], or an int for all of them;
        -1: the whole reservation)."""
        past = self._length[rows]
        reserved = self._reserved[rows]
        if isinstance(q, int):
            if q < 0:
                q = reserved.copy()
        else:
            whole = q < 0
            if whole.any():
                q = np.where(whole, reserved, q)
        bad = np.less_equal(q, 0) | (q > reserved)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"build_step: sequence {ids[i]!r} has {int(reserved[i])} reserved slot(s) for "
                             f"{int(np.broadcast_to(q, rows.shape)[i])} new token(s); reserve() the step's tokens "
                             "first (and at least 1)")
        step = build_step_arrays(self.groups, self._tables, self._npages, rows, past, q, ids, position_ids,
                                 page_indices)
        if self.debug_validate:
            self.validate_step(step)
        return step

    def kv_pools(self) -> np.ndarray:
        """The ``kv_pools`` engine input: INT64 [num_groups, POOL_DESC_FIELDS] (device address, num_blocks)."""
        if self.storage_kind != "device" or self.storage is None:
            raise RuntimeError(f"kv_pools: needs device pools (storage='device'); this manager has "
                               f"storage={self.storage_kind!r}, whose addresses a device cannot use")
        return pool_descriptors([self.storage.address(g) for g in range(len(self.groups))], self.num_blocks)

    def kv_pools_device(self):
        """``kv_pools`` uploaded once to a device buffer (addresses never change)."""
        if self._kv_pools_device is None:
            from pagedkv.cuda import DeviceBuffer

            self._kv_pools_device = DeviceBuffer.from_array(self.kv_pools(), self.stream)
        return self._kv_pools_device

    def upload_step(self, step: StepBatch):
        """Copy a step's arrays to device buffers through pinned staging memory, asynchronously on
        ``self.stream``. The result stays valid until two more steps have been uploaded."""
        if self.storage_kind != "device":
            raise RuntimeError(f"upload_step: needs storage='device', this manager has {self.storage_kind!r}")
        if self._uploader is None:
            from pagedkv.kvcache.upload import StepUploader

            self._uploader = StepUploader(self.stream)
        return self._uploader.upload(step)

    # ---- validation ----------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check every invariant; raises ``KVInvariantError`` naming the first violation."""
        from pagedkv.kvcache.validator import validate_manager

        validate_manager(self)

    def validate_step(self, step: StepBatch) -> None:
        """Check a step's arrays against the layout contract (``KVInvariantError`` on the first violation)."""
        from pagedkv.kvcache.validator import validate_step

        validate_step(step, self.num_blocks, [g.layout for g in self.groups])

    def _debug_check(self) -> None:
        if self.debug_validate:
            self.validate()

    # ---- internals -----------------------------------------------------------------------------------
    def _live(self, seq_id, what: str) -> SequenceState:
        st = self.state(seq_id)
        if st.swapped is not None:
            raise ValueError(f"{what}: sequence {seq_id!r} is swapped out; swap_in first")
        return st

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self._row_cap
            self._row_cap *= 2
            for g in range(len(self.groups)):
                grown = np.full((self._row_cap, self._tables[g].shape[1]), INVALID_BLOCK, dtype=np.int32)
                grown[:old] = self._tables[g]
                self._tables[g] = grown
                self._npages[g] = np.concatenate([self._npages[g], np.zeros(old, dtype=np.int32)])
            self._length = np.concatenate([self._length, np.zeros(old, dtype=np.int32)])
            self._reserved = np.concatenate([self._reserved, np.zeros(old, dtype=np.int32)])
            self._free_rows = list(range(self._row_cap - 1, old - 1, -1))
        return self._free_rows.pop()

    def _ensure_cols(self, g: int, pages: int) -> None:
        cols = self._tables[g].shape[1]
        if pages <= cols:
            return
        new_cols = max(pages, 2 * cols)
        grown = np.full((self._row_cap, new_cols), INVALID_BLOCK, dtype=np.int32)
        grown[:, :cols] = self._tables[g]
        self._tables[g] = grown

    def _allocate(self, g: int, count: int, seq_id) -> list[int]:
        blocks = self.allocators[g].allocate(count, seq_id)
        if self.prefix is not None:
            for b in blocks:  # handing out a free cached block evicts its prefix entry
                self.prefix[g].forget(b)
        return blocks

    def _drop_pages(self, g: int, row: int, start: int, stop: int, reverse: bool = False) -> None:
        table_row = self._tables[g][row]
        pages = range(stop - 1, start - 1, -1) if reverse else range(start, stop)
        for j in pages:
            b = int(table_row[j])
            if b >= 0:
                self.allocators[g].decref(b)
        table_row[start:stop] = INVALID_BLOCK

    def _release_window(self, st: SequenceState, g: int, length: int) -> None:
        lo, hi = released_page_range(self.groups[g], length)
        start = max(lo, st.released_hi[g])
        if hi > start:
            table_row = self._tables[g][st.row]
            for j in range(start, hi):
                b = int(table_row[j])
                if b >= 0:
                    table_row[j] = INVALID_BLOCK
                    self.allocators[g].decref(b)
            st.released_hi[g] = hi

    def _register_full_pages(self, st: SequenceState, g: int, length: int) -> None:
        P = self.groups[g].page_size
        hashes = st.hashes[g]
        full = min(length, st.tokens_known) // P  # only pages whose token ids are all known
        if len(hashes) >= full:
            return
        parent = hashes[-1] if hashes else st.salt
        table_row = self._tables[g][st.row]
        for j in range(len(hashes), full):
            toks = st.tokens[j * P:(j + 1) * P]
            digest = block_hash(parent, toks)
            hashes.append(digest)
            parent = digest
            self.prefix[g].register(int(table_row[j]), digest, toks)

    def _copy(self, c: BlockCopy) -> None:
        self.copy_log.append(c)
        if self.storage is not None:
            self.storage.copy(c)
