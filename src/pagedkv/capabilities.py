"""What the kernels support, as the library says: the C++ capability table (``plugins/include/pagedkv/capabilities.h``).

The table lives in C++ only; this module reads it from ``libpagedkv_capi.so`` (``pagedkv_capabilities()``), so
``pagedkv.config``'s checks, the builder and the tests see exactly the sets the launchers and the plugins accept.
Adding a head dim is one edit of the C++ table (and its kernels), nothing here.

Example::

    from pagedkv.capabilities import capabilities
    capabilities().head_dims          # (32, 64, 80, 96, 128, 256)
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from pagedkv import _lib
from pagedkv.layout import CacheDType, PageLayout


@dataclass(frozen=True)
class Capabilities:
    head_dims: tuple[int, ...]  # D the kernels are compiled for
    min_page_size: int  # P in [min_page_size, max_page_size] (the plugins' attribute range)
    max_page_size: int
    cache_dtypes: tuple[CacheDType, ...]  # pool dtypes with a kernel (NVFP4 is reserved, not among them)
    io_dtypes: tuple[int, ...]  # pagedkv.kernels.write.IODType values
    page_layouts: tuple[PageLayout, ...]
    max_heads: int  # num_q_heads and num_kv_heads of a plugin
    max_layers: int  # num_layers of a pool group
    max_pools: int  # pool_index < max_pools
    max_attention_kv_heads: int  # the attention launcher's bound (grid.y)
    max_rotary_dim: int  # rope_rotary_dim <= this (and <= head_dim)


@functools.lru_cache(maxsize=None)
def capabilities() -> Capabilities:
    """The library's capability table (loaded once). Raises ``FileNotFoundError`` naming the searched
    directories when the library is not built: the table has no copy on the Python side."""
    try:
        lib = _lib.capi()
    except FileNotFoundError as e:
        raise FileNotFoundError(f"the kernels' capability table (head dims, page sizes, dtypes) is read from the "
                                f"library: {e}") from None
    raw = json.loads(lib.pagedkv_capabilities().decode())
    return Capabilities(
        head_dims=tuple(raw["head_dims"]), min_page_size=raw["page_size"][0], max_page_size=raw["page_size"][1],
        cache_dtypes=tuple(CacheDType(v) for v in raw["cache_dtypes"]), io_dtypes=tuple(raw["io_dtypes"]),
        page_layouts=tuple(PageLayout(v) for v in raw["page_layouts"]), max_heads=raw["max_heads"],
        max_layers=raw["max_layers"], max_pools=raw["max_pools"],
        max_attention_kv_heads=raw["max_attention_kv_heads"], max_rotary_dim=raw["max_rotary_dim"])
