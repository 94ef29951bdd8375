"""Per-sequence state and the window rules: which pages a sequence needs, which it may release, which a
step writes.

Positions are cache positions (0-based token index of the sequence). ``L`` is the committed length (tokens
whose KV is in the cache), ``R`` the reserved room (slots allocated for the next step's new tokens, not yet
committed). Page ``j`` of a sequence is entry ``j`` of its block list (the block table row); the contract's
``KVLayout.token_slot`` / ``pages_needed`` map positions to pages, cyclic rings included.

Window rules (``W`` the attention window, ``S`` the sinks, ``P`` the page size):

* FULL: all ``pages_needed(L + R)`` pages are live.
* RELEASE: the next query sits at position >= L and sees positions >= L - W + 1 plus the sinks, so after a
  commit the pages wholly inside ``[S, L - W + 1)`` are released; their entries become -1.
* CYCLIC: the ring holds ``cyclic_len`` slots after the sinks (and the bubble that page-aligns it). A step of
  ``n`` new tokens overwrites the slots of positions ``p - cyclic_len`` while its first query still needs
  ``p0 - W + 1``: the ring must satisfy ``cyclic_len >= W + n - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedkv.pool_group import PoolGroup, WindowMode


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def pages_needed(spec: PoolGroup, length: int) -> int:
    return int(spec.layout.pages_needed(length))


def released_page_range(spec: PoolGroup, length: int) -> tuple[int, int]:
    """RELEASE groups: pages ``[lo, hi)`` no future query of a sequence of committed ``length`` can see."""
    if spec.mode != WindowMode.RELEASE:
        return 0, 0
    P = spec.page_size
    first_needed = max(0, length - spec.window + 1)
    lo = _ceil_div(spec.attention_sinks, P)
    return lo, max(lo, first_needed // P)


def written_pages(spec: PoolGroup, length: int, count: int) -> np.ndarray:
    """Pages (sorted, unique) that writing positions ``[length, length + count)`` touches."""
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    lay = spec.layout
    if not lay.cyclic_len:
        P = lay.page_size
        return np.arange(length // P, (length + count - 1) // P + 1, dtype=np.int64)
    # A step never writes more than the ring (checked by check_cyclic_step), so at most ring + sinks slots.
    page, _ = lay.slot_to_page(lay.token_slot(np.arange(length, length + count, dtype=np.int64)))
    return np.unique(page)


def committed_tokens_in_page(spec: PoolGroup, page: int, length: int) -> int:
    """Tokens of a linear sequence of committed ``length`` stored in ``page`` (what a copy must keep).
    Cyclic pages hold ring slots of many positions: the whole block counts (returns page_size)."""
    P = spec.page_size
    if spec.layout.cyclic_len:
        return P
    return int(min(P, max(0, length - page * P)))


def check_cyclic_step(spec: PoolGroup, count: int, seq=None) -> None:
    """A cyclic group's ring must keep the window of the step's first query while the step writes."""
    if spec.mode != WindowMode.CYCLIC or count <= 0:
        return
    need = spec.window + count - 1
    if spec.layout.cyclic_len < need:
        who = f"sequence {seq!r}: " if seq is not None else ""
        raise ValueError(f"{who}cyclic_len={spec.layout.cyclic_len} of pool group {spec.name!r} is too short for a "
                         f"step of {count} new tokens with window={spec.window}: the ring needs "
                         f"cyclic_len >= window + new_tokens - 1 = {need}")


@dataclass
class SequenceState:
    """The Python-side state of one sequence. Lengths live in the manager's arrays (indexed by ``row``) so
    that step metadata is built without per-sequence Python work."""

    seq_id: object
    row: int
    num_groups: int
    prompt_len: int = 0
    salt: bytes = b""
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(16, dtype=np.int32))
    tokens_known: int = 0        # token ids known for positions [0, tokens_known)
    token_gap: bool = False      # a commit came without token ids: no later block is hashable
    hashes: list = field(default_factory=list)           # per group: hashes of pages [0, len)
    released_hi: list = field(default_factory=list)      # per group (RELEASE): pages below are released
    swapped: list | None = None  # per group: [(page, host_block, tokens)] while swapped out

    def __post_init__(self):
        if not self.hashes:
            self.hashes = [[] for _ in range(self.num_groups)]
        if not self.released_hi:
            self.released_hi = [0] * self.num_groups

    def append_tokens(self, token_ids: np.ndarray) -> None:
        n = self.tokens_known + len(token_ids)
        if n > len(self.tokens):
            grown = np.zeros(max(n, 2 * len(self.tokens)), dtype=np.int32)
            grown[:self.tokens_known] = self.tokens[:self.tokens_known]
            self.tokens = grown
        self.tokens[self.tokens_known:n] = token_ids
        self.tokens_known = n

    def known_tokens(self) -> np.ndarray:
        return self.tokens[:self.tokens_known]
