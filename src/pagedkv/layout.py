"""The KV-layout contract in Python: the twin of ``plugins/include/pagedkv/kv_layout.h``.

The numpy references, the tests and the KV manager compute every pool address through this module,
never on their own. ``tests/test_layout.py`` checks it against the C++ header (through the C API) and
against independent formulations. ``docs/kv_layout.md`` explains the choices.

Dimension legend: L layers in a pool group, KVH KV heads, D head dim, P page size (tokens per block),
NB blocks in the pool, B sequences in a step, MB block-table width.

Pool of one pool group (elements of the cache dtype)::

    HND (default): [NB, L, 2, KVH, P, D]      2 = K then V
    NHD (option) : [NB, L, 2, P, KVH, D]
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

INVALID_BLOCK = -1  # block-table sentinel


class CacheDType(enum.IntEnum):
    """Pool storage dtype; the values are the ``cache_dtype`` plugin attribute."""

    FP16 = 0
    BF16 = 1
    FP8_E4M3 = 2
    INT8 = 3
    NVFP4 = 4  # reserved: not implemented yet

    @property
    def itemsize(self) -> int:
        return 2 if self in (CacheDType.FP16, CacheDType.BF16) else 1

    @property
    def quantized(self) -> bool:
        return self in (CacheDType.FP8_E4M3, CacheDType.INT8)

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype that holds one stored element (bit-exact)."""
        import ml_dtypes

        return {
            CacheDType.FP16: np.dtype(np.float16),
            CacheDType.BF16: np.dtype(ml_dtypes.bfloat16),
            CacheDType.FP8_E4M3: np.dtype(ml_dtypes.float8_e4m3fn),
            CacheDType.INT8: np.dtype(np.int8),
        }[self]

    @classmethod
    def parse(cls, value: "str | int | CacheDType") -> "CacheDType":
        if isinstance(value, CacheDType):
            return value
        if isinstance(value, (int, np.integer)):
            return cls(int(value))
        names = {"fp16": cls.FP16, "float16": cls.FP16, "bf16": cls.BF16, "bfloat16": cls.BF16,
                 "fp8": cls.FP8_E4M3, "fp8_e4m3": cls.FP8_E4M3, "int8": cls.INT8, "nvfp4": cls.NVFP4}
        try:
            return names[str(value).lower()]
        except KeyError:
            raise ValueError(f"cache_dtype: unknown value {value!r}; expected one of {sorted(names)}") from None


class PageLayout(enum.IntEnum):
    HND = 0
    NHD = 1


def log2_if_pow2(x: int) -> int:
    return int(x).bit_length() - 1 if x > 0 and (x & (x - 1)) == 0 else -1


def length_from_pages(num_pages, last_page_len, page_size):
    """``(pages - 1) * page_size + last_page_len`` (0 pages -> 0); works on scalars and arrays."""
    num_pages = np.asarray(num_pages)
    return np.where(num_pages == 0, 0, (num_pages - 1) * page_size + np.asarray(last_page_len))


def last_page_len(length, page_size):
    length = np.asarray(length)
    return np.where(length == 0, 0, (length - 1) % page_size + 1)


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one pool group plus its cyclic window. Mirrors ``pagedkv::KVLayout``."""

    num_layers: int
    num_kv_heads: int
    page_size: int
    head_dim: int
    page_layout: PageLayout = PageLayout.HND
    ring_sink_tokens: int = 0
    cyclic_len: int = 0  # 0: linear cache. Else ring length in slots, a multiple of page_size.
    page_shift: int = field(init=False)
    bubble_len: int = field(init=False)

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "page_size", "head_dim"):
            v = getattr(self, name)
            if int(v) <= 0:
                raise ValueError(f"{name}: must be > 0, got {v}")
        if self.ring_sink_tokens < 0:
            raise ValueError(f"ring_sink_tokens: must be >= 0, got {self.ring_sink_tokens}")
        if self.cyclic_len < 0 or (self.cyclic_len and self.cyclic_len % self.page_size):
            raise ValueError(f"cyclic_len: must be 0 or a positive multiple of page_size={self.page_size}, "
                             f"got {self.cyclic_len}")
        if self.page_layout not in tuple(PageLayout):
            raise ValueError(f"page_layout: expected 0 (HND) or 1 (NHD), got {self.page_layout}")
        object.__setattr__(self, "page_layout", PageLayout(self.page_layout))
        if not self.cyclic_len:
            object.__setattr__(self, "ring_sink_tokens", 0)
        object.__setattr__(self, "page_shift", log2_if_pow2(self.page_size))
        sink_in_last = self.ring_sink_tokens % self.page_size
        object.__setattr__(self, "bubble_len", 0 if (not self.cyclic_len or sink_in_last == 0)
                           else self.page_size - sink_in_last)

    # ---- strides (elements) -------------------------------------------------------------------------
    @property
    def stride_token(self) -> int:
        return self.head_dim if self.page_layout == PageLayout.HND else self.num_kv_heads * self.head_dim

    @property
    def stride_head(self) -> int:
        return self.page_size * self.head_dim if self.page_layout == PageLayout.HND else self.head_dim

    @property
    def stride_kv(self) -> int:
        return self.num_kv_heads * self.page_size * self.head_dim

    @property
    def stride_layer(self) -> int:
        return 2 * self.stride_kv

    @property
    def stride_block(self) -> int:
        return self.num_layers * self.stride_layer

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        L, H, P, D = self.num_layers, self.num_kv_heads, self.page_size, self.head_dim
        return (num_blocks, L, 2, H, P, D) if self.page_layout == PageLayout.HND else (num_blocks, L, 2, P, H, D)

    def pool_elements(self, num_blocks: int) -> int:
        return num_blocks * self.stride_block

    # ---- mapping ------------------------------------------------------------------------------------
    def token_slot(self, pos):
        """Cache position -> slot in the sequence's block list (the seed's ``getKVTokenIdx``)."""
        pos = np.asarray(pos, dtype=np.int64)
        if np.any(pos < 0):
            raise ValueError(f"pos: cache positions must be >= 0, got {int(np.min(pos))}")
        if not self.cyclic_len:
            return pos
        ring = self.ring_sink_tokens + self.bubble_len + (pos - self.ring_sink_tokens) % self.cyclic_len
        return np.where(pos < self.ring_sink_tokens, pos, ring)

    def slots_used(self, length):
        length = np.asarray(length, dtype=np.int64)
        if not self.cyclic_len:
            return length
        ring = np.minimum(length - self.ring_sink_tokens, self.cyclic_len)
        return np.where(length <= self.ring_sink_tokens, length, self.ring_sink_tokens + self.bubble_len + ring)

    def pages_needed(self, length):
        """Block-list entries a sequence of ``length`` tokens needs."""
        return -(-self.slots_used(length) // self.page_size)

    def slot_to_page(self, slot):
        slot = np.asarray(slot, dtype=np.int64)
        if self.page_shift >= 0:
            return slot >> self.page_shift, slot & (self.page_size - 1)
        return np.divmod(slot, self.page_size)

    def locate(self, block_row, pos, num_blocks: int):
        """Cache position(s) of one sequence -> (physical block, offset, raw entry).

        ``block`` is ``INVALID_BLOCK`` where the entry is -1, out of range ``[0, num_blocks)`` or past the row.
        """
        block_row = np.asarray(block_row, dtype=np.int64)
        page, offset = self.slot_to_page(self.token_slot(pos))
        inside = (page >= 0) & (page < block_row.shape[0])
        raw = np.where(inside, block_row[np.clip(page, 0, max(block_row.shape[0] - 1, 0))]
                       if block_row.shape[0] else INVALID_BLOCK, INVALID_BLOCK)
        valid = (raw >= 0) & (raw < num_blocks)
        return np.where(valid, raw, INVALID_BLOCK), offset, raw

    def elem_offset(self, block, layer, kv, head, offset):
        """Element offset of (block, layer, kv, head, offset-in-page, dim 0) from the pool base."""
        return (np.asarray(block, dtype=np.int64) * self.stride_block + np.asarray(layer) * self.stride_layer
                + np.asarray(kv) * self.stride_kv + np.asarray(head) * self.stride_head
                + np.asarray(offset) * self.stride_token)


def attends(q_pos, kv_pos, window: int = 0, attention_sinks: int = 0):
    """Attention visibility: causal, and inside the window of the ``window`` most recent positions
    (the query's own included) or among the first ``attention_sinks`` positions. ``window <= 0``: full causal."""
    q_pos = np.asarray(q_pos)
    kv_pos = np.asarray(kv_pos)
    causal = kv_pos <= q_pos
    if window <= 0:
        return causal
    return causal & (((q_pos - kv_pos) < window) | (kv_pos < attention_sinks))
