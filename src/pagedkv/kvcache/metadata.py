"""Step metadata: every array the plugins (and a FlashInfer-style consumer) need for one step, in numpy,
without per-token Python loops.

Legend: B sequences of the step, T tokens (sequence after sequence), MB block-table width of a group
(max pages of the step's sequences in it), NNZ pages of the step in a group.

Shared by all pool groups (``StepBatch``)::

    cu_q_lens  [B + 1] int32   sequence b owns tokens [cu_q_lens[b], cu_q_lens[b+1])
    past_lens  [B] int32       tokens cached before the step (chunked prefill: the chunk's start)
    q_lens     [B] int32       new tokens;   kv_lens [B] int32 = past_lens + q_lens
    token_seq  [T] int32       sequence of each token (FlashInfer's batch_indices)
    positions  [T] int32       cache position of each token (past_len + i; FlashInfer's positions)
    position_ids [T] or None   explicit RoPE positions, passed through to StepMetadata

Per pool group (``GroupStep``), with the contract's mapping (``KVLayout.pages_needed`` / ``slots_used``)::

    block_table    [B, MB] int32  -1 padded (and -1 where a window released a page)
    num_pages      [B] int32      pages_needed(kv_len)
    last_page_lens [B] int32      slots_used(kv_len) - (num_pages - 1) * page_size, so that
                                  length_from_pages(num_pages, last_page_lens) == slots_used(kv_len)
                                  (== kv_len for a linear cache: FlashInfer's formula)
    kv_indptr      [B + 1] int32  sequence b's pages are kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    kv_indices     [NNZ] int32    the block-table rows without padding (entries keep their -1 holes)

A consumer that does not understand -1 holes must not be given a RELEASE-window group's arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedkv.layout import INVALID_BLOCK
from pagedkv.step import POOL_DESC_ADDRESS, POOL_DESC_FIELDS, POOL_DESC_NUM_BLOCKS, StepMetadata


@dataclass
class GroupStep:
    name: str
    pool_index: int
    meta: StepMetadata
    num_pages: np.ndarray
    last_page_lens: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray

    @property
    def block_table(self) -> np.ndarray:
        return self.meta.block_table


@dataclass
class StepBatch:
    seq_ids: tuple
    cu_q_lens: np.ndarray
    past_lens: np.ndarray
    q_lens: np.ndarray
    kv_lens: np.ndarray
    token_seq: np.ndarray
    positions: np.ndarray
    position_ids: np.ndarray | None
    groups: tuple[GroupStep, ...]
    max_q_len: int
    max_kv_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_q_lens[-1])

    def meta(self, group: int = 0) -> StepMetadata:
        return self.groups[group].meta


def build_step_arrays(groups, tables: Sequence[np.ndarray], npages: Sequence[np.ndarray], rows: np.ndarray,
                      past: np.ndarray, q: np.ndarray, seq_ids: tuple, position_ids=None,
                      page_indices: bool = True) -> StepBatch:
    """Vectorised construction from the manager's tables (``tables[g][row]`` is a block list, -1 past its
    ``npages[g][row]`` entries). ``rows``/``past``/``q`` are per step sequence (``q`` may be one int >= 1 for
    all: a decode step's 1). ``page_indices=False`` leaves out what only a FlashInfer-style consumer reads
    (``kv_indptr``, ``kv_indices``, ``last_page_lens``, ``num_pages``: None) — the engine inputs need block
    tables and lengths only."""
    B = int(rows.shape[0])
    past = np.ascontiguousarray(past, dtype=np.int32)
    if isinstance(q, int):  # the same count for every sequence: cu_q_lens is a ramp
        max_q = q if B else 0
        cu = np.arange(0, q * B + 1, q, dtype=np.int32)
        q = np.full(B, q, dtype=np.int32)
    else:
        q = np.ascontiguousarray(q, dtype=np.int32)
        max_q = int(q.max()) if B else 0
        cu = np.zeros(B + 1, dtype=np.int32)
        np.cumsum(q, out=cu[1:])
    kv = past + q
    T = int(cu[-1])
    if T == B and max_q == 1:  # a decode step (B tokens, none of q above 1: one each)
        token_seq = np.arange(B, dtype=np.int32)
        positions = past.copy()
    else:
        token_seq = np.repeat(np.arange(B, dtype=np.int32), q)
        # position of token t = past[b] + (t - cu[b]) for its sequence b
        positions = np.arange(T, dtype=np.int32) + np.repeat(past - cu[:-1], q)
    if position_ids is not None:
        position_ids = np.ascontiguousarray(position_ids, dtype=np.int32)
    out_groups = []
    for g, spec in enumerate(groups):
        lay = spec.layout
        pages = lay.pages_needed(kv).astype(np.int32)
        mb = int(pages.max()) if B else 0
        table = tables[g][rows, :mb]  # fancy indexing: a fresh [B, MB] array
        held = npages[g][rows]
        if (held != pages).any():  # a reservation beyond this step: hide its extra pages
            table[np.arange(mb, dtype=np.int32)[None, :] >= pages[:, None]] = INVALID_BLOCK
        meta = StepMetadata(block_table=table, cu_q_lens=cu, past_lens=past, position_ids=position_ids)
        if not page_indices:
            out_groups.append(GroupStep(spec.name, g, meta, None, None, None, None))
            continue
        if B and int(pages.min()) == mb:
            indices = table.reshape(-1).copy()
        else:
            indices = table[np.arange(mb, dtype=np.int32)[None, :] < pages[:, None]]
        indptr = np.zeros(B + 1, dtype=np.int32)
        np.cumsum(pages, out=indptr[1:])
        slots = lay.slots_used(kv)
        last = np.where(pages > 0, slots - (pages.astype(np.int64) - 1) * lay.page_size, 0).astype(np.int32)
        out_groups.append(GroupStep(spec.name, g, meta, pages, last, indptr, indices))
    return StepBatch(seq_ids=seq_ids, cu_q_lens=cu, past_lens=past, q_lens=q, kv_lens=kv, token_seq=token_seq,
                     positions=positions, position_ids=position_ids, groups=tuple(out_groups),
                     max_q_len=max_q, max_kv_len=int(kv.max()) if B else 0)


def pool_descriptors(addresses: Sequence[int], num_blocks: Sequence[int]) -> np.ndarray:
    """The ``kv_pools`` array: INT64 [num_pools, POOL_DESC_FIELDS], row g = (address, num_blocks, 0, 0)."""
    if len(addresses) != len(num_blocks):
        raise ValueError(f"kv_pools: {len(addresses)} addresses for {len(num_blocks)} pools")
    desc = np.zeros((len(addresses), POOL_DESC_FIELDS), dtype=np.int64)
    desc[:, POOL_DESC_ADDRESS] = np.asarray(addresses, dtype=np.uint64).astype(np.int64)
    desc[:, POOL_DESC_NUM_BLOCKS] = num_blocks
    return desc
