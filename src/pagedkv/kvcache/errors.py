"""The KV manager's exception types, in one place.

Every error names what it is about (sequence, pool group, tier, block) and the values involved, so that a
failing step can be diagnosed from the message alone.
"""

from __future__ import annotations


class KVCacheError(RuntimeError):
    """Base class of the KV manager's errors."""


class KVCacheExhaustedError(KVCacheError):
    """Not enough free blocks for an operation. The operation changed nothing (no partial state)."""

    def __init__(self, *, needed: int, free: int, group: str, tier: str = "primary", seq=None, what: str = ""):
        self.needed, self.free, self.group, self.tier, self.seq = needed, free, group, tier, seq
        who = f"sequence {seq!r} " if seq is not None else ""
        doing = f" ({what})" if what else ""
        super().__init__(f"KV cache exhausted: {who}needs {needed} block(s) in pool group {group!r} "
                         f"({tier} tier){doing} but only {free} are free; nothing was changed")


class BlockRefcountError(KVCacheError):
    """A block was released more often than it was held (double free) or used while free."""

    def __init__(self, message: str, block: int, refcount: int):
        super().__init__(message)
        self.block, self.refcount = block, refcount


class KVInvariantError(KVCacheError):
    """The validator ("kv doctor") found the first violated invariant.

    Fields: ``check`` (which invariant), ``seq``, ``group``, ``page`` (index in the sequence's block list),
    ``block`` (physical block id), ``expected`` and ``found``; fields that do not apply are None.
    """

    def __init__(self, check: str, detail: str, *, seq=None, group=None, page=None, block=None,
                 expected=None, found=None):
        self.check, self.detail = check, detail
        self.seq, self.group, self.page, self.block = seq, group, page, block
        self.expected, self.found = expected, found
        where = ", ".join(f"{name}={value!r}" for name, value in
                          (("seq", seq), ("group", group), ("page", page), ("block", block)) if value is not None)
        super().__init__(f"kv doctor: {check}: {detail}" + (f" [{where}]" if where else "")
                         + f": expected {expected!r}, found {found!r}")
