"""Pool groups: the layers that share one pool (same geometry, cache dtype and window).

A model whose layers differ (other KV head counts, head dims or attention windows) gets one pool group per
kind of layer. Each group has its own pool (one allocation, ``KVLayout.pool_shape``), its own blocks and
its own block table; a block of a group holds all of the group's layers (as in TensorRT-LLM), so one block
id addresses a token range in every layer of the group.

``PoolGroup`` is the one description of a group: the rewrite makes them (``pagedkv.builder.rewrite``), the
runtime's graph reader reads them back off the plugin attributes (``pagedkv.runtime.graph``), the KV manager
(``pagedkv.kvcache``) allocates and fills their pools. In a list of groups, group g is row g of the
``kv_pools`` engine input and owns the engine input ``block_table_{g}`` (``pagedkv.engine_io``). A layer's
plugin attributes (``pagedkv.config.PoolConfig``) are derived from its group (``pool_config``), never
specified a second time.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from pagedkv.capabilities import capabilities
from pagedkv.config import PoolConfig
from pagedkv.layout import CacheDType, KVLayout


class WindowMode(enum.Enum):
    FULL = "full"        # full causal attention: every page stays
    RELEASE = "release"  # sliding window on a linear cache: pages that leave the window are released (-1)
    CYCLIC = "cyclic"    # sliding window on a ring (KVLayout.cyclic_len): slots are reused in place


@dataclass(frozen=True)
class PoolGroup:
    """One pool group.

    ``window`` is the attention window of the group's layers (``AttentionConfig.window``, 0: full causal)
    and ``attention_sinks`` the always-visible first positions. The window mode follows from the layout:
    ``layout.cyclic_len > 0`` -> CYCLIC (the ring must hold the window; sinks are the layout's
    ``ring_sink_tokens``), else ``window > 0`` -> RELEASE, else FULL.
    ``k_scales`` / ``v_scales``: one per layer of the group, for quantized caches (x ~= stored * scale).
    ``layers``: the model layers the group holds, in ``layer_index`` order (a graph's groups say which;
    empty for a group not tied to a model, e.g. a KV manager's own).
    """

    name: str
    layout: KVLayout
    cache_dtype: CacheDType = CacheDType.FP16
    window: int = 0
    attention_sinks: int = 0
    k_scales: tuple[float, ...] | None = None
    v_scales: tuple[float, ...] | None = None
    layers: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "cache_dtype", CacheDType.parse(self.cache_dtype))
        if not self.name:
            raise ValueError("name: a pool group needs a non-empty name")
        if self.cache_dtype not in capabilities().cache_dtypes:
            raise ValueError(f"cache_dtype: {self.cache_dtype.name} is reserved in the layout but not implemented "
                             f"(group {self.name!r})")
        if self.window < 0:
            raise ValueError(f"window: must be >= 0 (0: full causal), got {self.window} (group {self.name!r})")
        if self.attention_sinks < 0:
            raise ValueError(f"attention_sinks: must be >= 0, got {self.attention_sinks} (group {self.name!r})")
        if self.attention_sinks and not self.window:
            raise ValueError(f"attention_sinks={self.attention_sinks}: only meaningful with a window > 0 "
                             f"(group {self.name!r})")
        lay = self.layout
        if lay.cyclic_len:
            if self.window <= 0:
                raise ValueError(f"window: a cyclic pool group (cyclic_len={lay.cyclic_len}) needs the attention "
                                 f"window > 0, got {self.window} (group {self.name!r})")
            if lay.cyclic_len < self.window:
                raise ValueError(f"cyclic_len={lay.cyclic_len} < window={self.window}: the ring must hold the "
                                 f"window (group {self.name!r})")
            if self.attention_sinks != lay.ring_sink_tokens:
                raise ValueError(f"attention_sinks={self.attention_sinks} must equal the layout's ring_sink_tokens="
                                 f"{lay.ring_sink_tokens}: sink positions outside the ring's sinks would be "
                                 f"overwritten (group {self.name!r})")
        for name in ("k_scales", "v_scales"):
            scales = getattr(self, name)
            if scales is None:
                scales = (1.0,) * lay.num_layers
            scales = tuple(float(s) for s in scales)
            if len(scales) != lay.num_layers:
                raise ValueError(f"{name}: expected {lay.num_layers} values (one per layer of group "
                                 f"{self.name!r}), got {len(scales)}")
            for i, s in enumerate(scales):
                if not (math.isfinite(s) and s > 0):
                    raise ValueError(f"{name}[{i}]: must be finite and > 0, got {s} (group {self.name!r})")
            if not self.cache_dtype.quantized and any(s != 1.0 for s in scales):
                raise ValueError(f"{name}: only quantized caches (fp8/int8) take scales; group {self.name!r} "
                                 f"is {self.cache_dtype.name}")
            object.__setattr__(self, name, scales)
        layers = tuple(int(i) for i in self.layers)
        if layers and (len(layers) != lay.num_layers or len(set(layers)) != len(layers) or min(layers) < 0):
            raise ValueError(f"layers: expected {lay.num_layers} distinct model layer indices >= 0 (one per layer "
                             f"of group {self.name!r}), got {list(layers)}")
        object.__setattr__(self, "layers", layers)
        # fixed for the spec's life; cached because the manager asks on every reserve/commit
        mode = (WindowMode.CYCLIC if lay.cyclic_len else WindowMode.RELEASE if self.window > 0 else WindowMode.FULL)
        object.__setattr__(self, "_mode", mode)

    @property
    def mode(self) -> WindowMode:
        return self._mode

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def itemsize(self) -> int:
        return self.cache_dtype.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: all layers, K and V, all heads, ``page_size`` tokens."""
        return self.layout.stride_block * self.itemsize

    @property
    def ring_pages(self) -> int:
        """Cyclic groups: the most pages a sequence ever holds (sinks + bubble + ring); 0 otherwise."""
        if not self.layout.cyclic_len:
            return 0
        lay = self.layout
        return -(-(lay.ring_sink_tokens + lay.bubble_len + lay.cyclic_len) // lay.page_size)

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return self.layout.pool_shape(num_blocks)

    def pool_config(self, layer_in_group: int, pool_index: int) -> PoolConfig:
        """The plugin attributes of one layer of this group (row ``pool_index`` of ``kv_pools``)."""
        lay = self.layout
        if not 0 <= layer_in_group < lay.num_layers:
            raise ValueError(f"layer_in_group: expected in [0, {lay.num_layers}), got {layer_in_group}")
        return PoolConfig(num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim, page_size=lay.page_size,
                          num_layers=lay.num_layers, layer_index=layer_in_group, pool_index=pool_index,
                          cache_dtype=self.cache_dtype, page_layout=lay.page_layout,
                          ring_sink_tokens=lay.ring_sink_tokens, cyclic_len=lay.cyclic_len,
                          k_scale=self.k_scales[layer_in_group], v_scale=self.v_scales[layer_in_group])
