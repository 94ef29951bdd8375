"""The ABI check of a ctypes mirror of a C API argument struct, run once when a binding loads the library.

The C API reports each field's byte offset in declaration order (``offsetof``), and optionally ``sizeof``; any
difference from the ctypes mirror means the library and the binding come from different headers, and a launch
would read the wrong fields. Failing at load time names both layouts instead.
"""

from __future__ import annotations

import ctypes
from typing import Callable


def check_struct_layout(struct: type[ctypes.Structure], c_name: str, binding: str, *,
                        library_offsets: Callable[[ctypes.Array, int], int],
                        library_size: int | None = None) -> None:
    """Raise ``RuntimeError`` unless the library's layout of ``c_name`` equals ``struct``'s.

    ``library_offsets(offsets, n)`` is the C API's query: it writes the byte offset of each field into
    ``offsets[0..n)`` and returns its number of fields (or -1). ``library_size`` is the library's ``sizeof``,
    when the C API reports it. ``binding`` names the Python module that holds the mirror, for the message.
    """
    n = len(struct._fields_)
    offsets = (ctypes.c_int64 * n)()
    count = library_offsets(offsets, n)
    ours = [getattr(struct, name).offset for name, _ in struct._fields_]
    size_agrees = library_size is None or library_size == ctypes.sizeof(struct)
    if not size_agrees or count != n or list(offsets) != ours:
        theirs_size = "" if library_size is None else f"size {library_size}, "
        our_size = "" if library_size is None else f"size {ctypes.sizeof(struct)}, "
        raise RuntimeError(f"{c_name} layout mismatch between the library ({theirs_size}{count} fields, offsets "
                           f"{list(offsets)[:max(count, 0)]}) and {binding} ({our_size}{n} fields, offsets {ours}): "
                           "rebuild the library")
