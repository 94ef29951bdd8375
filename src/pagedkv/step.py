"""Step metadata: which of a step's tokens belong to which sequence and where each sequence's cache stands.

The Python twin of ``pagedkv::StepMetadata`` (``plugins/include/pagedkv/step_metadata.h``), with the two
records laid out there: the rows of the ``kv_pools`` engine input (``POOL_DESC_*``) and the
``kv_write_status_{i}`` error record (``STATUS_*``). The KV manager builds the metadata, the references and the
kernel bindings consume it, the runtime binds it as engine inputs (their names: ``pagedkv.engine_io``).
``docs/plugin_io.md`` is the plugins' contract, ``docs/engine_io.md`` the engine's.

Legend: T tokens of the step (sequence after sequence, padding removed), B sequences, MB block-table width.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedkv.layout import INVALID_BLOCK

# A row of the engine input `kv_pools` (INT64 [num_pools, POOL_DESC_FIELDS]): step_metadata.h PoolDescField
POOL_DESC_ADDRESS, POOL_DESC_NUM_BLOCKS = 0, 1
POOL_DESC_FIELDS = 4

# The engine output `kv_write_status_{i}` (INT32 [STATUS_FIELDS]): step_metadata.h StatusField, StatusFlag
STATUS_FLAGS, STATUS_SEQ, STATUS_PAGE_IN_SEQ, STATUS_ENTRY = 0, 1, 2, 3
STATUS_FIELDS = 4
STATUS_INVALID_BLOCK, STATUS_BLOCK_OUT_OF_RANGE, STATUS_PAST_BLOCK_TABLE = 1, 2, 4


class KVWriteError(RuntimeError):
    """A live token of the step had no valid page to go to. Nothing was written outside the pool."""

    def __init__(self, message: str, seq: int, page_in_seq: int, entry: int):
        super().__init__(message)
        self.seq, self.page_in_seq, self.entry = seq, page_in_seq, entry


def raise_for_status(status: np.ndarray, where: str = "kv write") -> None:
    """Turn a ``kv_write_status`` record (read back from the device) into a ``KVWriteError``."""
    flags = int(status[STATUS_FLAGS])
    if flags == 0:
        return
    seq, page, entry = int(status[STATUS_SEQ]), int(status[STATUS_PAGE_IN_SEQ]), int(status[STATUS_ENTRY])
    reasons = []
    if flags & STATUS_INVALID_BLOCK:
        reasons.append(f"block_table[{seq}][{page}] = {entry} is the invalid-page sentinel {INVALID_BLOCK}")
    if flags & STATUS_BLOCK_OUT_OF_RANGE:
        reasons.append(f"block_table[{seq}][{page}] = {entry} is outside the pool")
    if flags & STATUS_PAST_BLOCK_TABLE:
        reasons.append(f"sequence {seq} needs page {page}, past the block table's width")
    raise KVWriteError(f"{where}: " + "; ".join(reasons) + " (tokens there were skipped)", seq, page, entry)


@dataclass
class StepMetadata:
    block_table: np.ndarray  # [B, MB] int32, -1 where no page
    cu_q_lens: np.ndarray  # [B + 1] int32, sequence b owns tokens [cu_q_lens[b], cu_q_lens[b+1])
    past_lens: np.ndarray  # [B] int32, tokens cached before this step
    position_ids: np.ndarray | None = None  # [T] int32 explicit RoPE positions, None -> past_len + i

    def __post_init__(self):
        self.block_table = np.ascontiguousarray(self.block_table, dtype=np.int32)
        self.cu_q_lens = np.ascontiguousarray(self.cu_q_lens, dtype=np.int32)
        self.past_lens = np.ascontiguousarray(self.past_lens, dtype=np.int32)
        if self.position_ids is not None:
            self.position_ids = np.ascontiguousarray(self.position_ids, dtype=np.int32)
        self.validate()

    def validate(self) -> None:
        """Shape and consistency checks; errors name the field and the value."""
        if self.block_table.ndim != 2:
            raise ValueError(f"block_table: expected [batch, max_blocks], got shape {self.block_table.shape}")
        b = self.block_table.shape[0]
        if self.cu_q_lens.shape != (b + 1,):
            raise ValueError(f"cu_q_lens: expected shape ({b + 1},) for batch {b}, got {self.cu_q_lens.shape}")
        if self.past_lens.shape != (b,):
            raise ValueError(f"past_lens: expected shape ({b},), got {self.past_lens.shape}")
        if b and self.cu_q_lens[0] != 0:
            raise ValueError(f"cu_q_lens[0]: expected 0, got {self.cu_q_lens[0]}")
        falls = self.cu_q_lens[1:] < self.cu_q_lens[:-1]
        if falls.any():
            i = int(np.argmax(falls))
            raise ValueError(f"cu_q_lens: must be non-decreasing, cu_q_lens[{i + 1}]={self.cu_q_lens[i + 1]} "
                             f"< cu_q_lens[{i}]={self.cu_q_lens[i]}")
        if b and self.past_lens.min() < 0:
            i = int(np.argmax(self.past_lens < 0))
            raise ValueError(f"past_lens[{i}]: must be >= 0, got {self.past_lens[i]}")
        if self.position_ids is not None and self.position_ids.shape != (self.num_tokens,):
            raise ValueError(f"position_ids: expected shape ({self.num_tokens},), got {self.position_ids.shape}")

    @property
    def num_seqs(self) -> int:
        return int(self.block_table.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.cu_q_lens[-1]) if self.cu_q_lens.size else 0

    @property
    def max_blocks(self) -> int:
        return int(self.block_table.shape[1])

    @property
    def q_lens(self) -> np.ndarray:
        return np.diff(self.cu_q_lens)

    @property
    def kv_lens(self) -> np.ndarray:
        """Cache length of each sequence after this step's write."""
        return self.past_lens + self.q_lens

    @property
    def token_seq(self) -> np.ndarray:
        """[T] sequence of each token."""
        return np.repeat(np.arange(self.num_seqs, dtype=np.int32), self.q_lens)

    @property
    def token_cache_pos(self) -> np.ndarray:
        """[T] cache position of each token: past_len + index within the sequence's new tokens."""
        seq = self.token_seq
        return (self.past_lens[seq] + np.arange(self.num_tokens, dtype=np.int32) - self.cu_q_lens[seq]).astype(np.int32)

    @property
    def rope_positions(self) -> np.ndarray:
        """[T] RoPE position of each token (explicit ids when given)."""
        return self.position_ids if self.position_ids is not None else self.token_cache_pos
