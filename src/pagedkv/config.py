"""The two plugins' attribute sets, in one place.

Each dataclass here is one plugin's attributes as an ONNX node carries them (``to_attributes`` /
``from_attributes``) and as the C++ plugin reads them as fields (same names, INT -> kINT32,
FLOAT -> kFLOAT32, FLOATS -> kFLOAT32 of its length, per the TensorRT ONNX parser; a FLOATS attribute that is
empty is left out, as ONNX cannot type an empty list). An attribute's ONNX type is its field's *declared* type
(``attribute_types``): a float field is a FLOAT attribute even when it was given an int (``theta=500000``),
because the plugin refuses a kINT32 where it expects kFLOAT32. The builder writes nodes from them
(``to_node_attributes`` adds ``plugin_namespace`` and ``plugin_version``, which the ONNX parser uses to find the
creator), the references and the kernel bindings take them as parameters. ``docs/plugin_io.md`` is the
human-readable contract; the C++ creators list the same names and types in ``getFieldNames``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import typing
from dataclasses import dataclass, field

from pagedkv.capabilities import capabilities
from pagedkv.layout import CacheDType, KVLayout, PageLayout

PLUGIN_NAMESPACE = "pagedkv"
ONNX_DOMAIN = "pagedkv"  # custom domain: the ONNX parser ignores it, ONNX tools then don't mistake the op
WRITE_PLUGIN_NAME = "PagedKVQKVWrite"  # never an ONNX/TensorRT op name (built-in importers win)
ATTENTION_PLUGIN_NAME = "PagedKVAttention"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE_ATTRIBUTE, PLUGIN_VERSION_ATTRIBUTE = "plugin_namespace", "plugin_version"  # the parser's names
OUT_DTYPE_LIKE_Q = -1  # AttentionConfig.out_dtype: the output takes q's dtype

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
# Float attributes that must be finite and > 0 (FieldSpec::positiveFloat) or >= 0 (FieldSpec::nonNegativeFloat),
# and fit float32, as the plugin creators check them.
POSITIVE_FLOAT_ATTRIBUTES = ("k_scale", "v_scale", "q_scale", "rope_theta", "rope_factor", "rope_low_freq_factor",
                             "rope_high_freq_factor")
NON_NEGATIVE_FLOAT_ATTRIBUTES = ("softmax_scale", "logit_softcap")


@functools.lru_cache(maxsize=None)
def attribute_ranges() -> dict[str, tuple[int, int]]:
    """Integer attribute ranges, inclusive, as the plugin creators check them: the C++ capability table's limits
    (``pagedkv.capabilities``), the int32 field type's bounds elsewhere. Also ``config.ATTRIBUTE_RANGES``."""
    cap = capabilities()
    return {
        "num_q_heads": (1, cap.max_heads), "num_kv_heads": (1, cap.max_heads),
        "page_size": (cap.min_page_size, cap.max_page_size),
        "num_layers": (1, cap.max_layers), "layer_index": (0, cap.max_layers - 1),
        "pool_index": (0, cap.max_pools - 1),
        "ring_sink_tokens": (0, INT32_MAX), "cyclic_len": (0, INT32_MAX),
        "rope_rotary_dim": (0, cap.max_rotary_dim), "rope_original_max_positions": (1, INT32_MAX),
        "window": (INT32_MIN, INT32_MAX), "attention_sinks": (0, INT32_MAX),
    }


@functools.lru_cache(maxsize=None)
def supported_io_dtypes() -> tuple[str, ...]:
    """numpy names of the plugins' activation dtypes (qkv, bias, q, attention output): the capability table's
    I/O dtypes. The rewrite converts graphs to them (``--dtype``). Also ``config.SUPPORTED_IO_DTYPES``."""
    from pagedkv.kernels.write import IODType

    return tuple(IODType(v).numpy_dtype.name for v in capabilities().io_dtypes)


def __getattr__(name: str):
    # The capability-derived tables read the library on first use, not at import (``pagedkv --help`` needs none).
    if name == "ATTRIBUTE_RANGES":
        return attribute_ranges()
    if name == "SUPPORTED_IO_DTYPES":
        return supported_io_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_attribute_values(attrs: dict) -> None:
    """Every attribute in the range the plugins accept (``attribute_ranges()`` and the float rules above), else
    ValueError naming the attribute, the value and the range."""
    ranges = attribute_ranges()
    for name, value in attrs.items():
        if name in ranges:
            low, high = ranges[name]
            if not low <= value <= high:
                raise ValueError(f"{name}: expected a value in [{low}, {high}], got {value}")
        elif name in POSITIVE_FLOAT_ATTRIBUTES or name in NON_NEGATIVE_FLOAT_ATTRIBUTES:
            positive = name in POSITIVE_FLOAT_ATTRIBUTES
            if not (math.isfinite(value) and (value > 0 if positive else value >= 0) and value <= FLOAT32_MAX):
                raise ValueError(f"{name}: expected a finite value {'>' if positive else '>='} 0 (float32), "
                                 f"got {value}")


class RopeStyle(enum.IntEnum):
    NONE = 0
    NEOX = 1  # GPT-NeoX: pairs (i, i + R/2), "rotate half"
    GPTJ = 2  # GPT-J: pairs (2i, 2i + 1), interleaved


class RopeScaling(enum.IntEnum):
    """How the inverse frequencies are scaled (``pagedkv::RopeScaling``; formulas in ``pagedkv.reference.rope``)."""

    NONE = 0
    LINEAR = 1
    LLAMA3 = 2
    YARN = 3  # Hugging Face rope_type "yarn" (Qwen2.5, DeepSeek): ramp between kept and interpolated dims
    LONGROPE = 4  # "longrope" (Phi-3): short factors, long factors past original_max_positions


@dataclass(frozen=True)
class RopeConfig:
    """The ``rope_*`` attributes of the write plugin (``pagedkv::RopeConfig``). Which fields a scaling reads:

    linear: factor; llama3: factor, low/high_freq_factor, original_max_positions; yarn: factor, beta_fast,
    beta_slow, truncate, original_max_positions, attention_factor; longrope: short_factors and long_factors (R/2
    each), original_max_positions (a sequence whose kv length after the step exceeds it uses the long factors),
    attention_factor, and factor (only for the default attention factor).
    """

    style: RopeStyle = RopeStyle.NEOX
    rotary_dim: int = 0  # 0 -> head_dim
    theta: float = 10000.0
    scaling: RopeScaling = RopeScaling.NONE
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 0.0  # multiplies cos and sin (yarn, longrope); 0: Hugging Face's default from factor
    short_factors: tuple[float, ...] = ()
    long_factors: tuple[float, ...] = ()

    def __post_init__(self):
        for name in ("short_factors", "long_factors"):  # attribute lists and numpy arrays become tuples
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))

    def resolved_rotary_dim(self, head_dim: int) -> int:
        r = self.rotary_dim or head_dim
        if r <= 0 or r > head_dim or r % 2:
            raise ValueError(f"rope_rotary_dim: must be even and in (0, head_dim={head_dim}], got {r}")
        return r


FLOAT, INT, FLOATS = "FLOAT", "INT", "FLOATS"  # ONNX types of the plugin fields: kFLOAT32, kINT32, kFLOAT32[n]


def _is_floats(declared) -> bool:
    """A ``tuple[float, ...]`` field: a FLOATS attribute (LongRoPE's factor lists)."""
    return typing.get_origin(declared) is tuple


@functools.lru_cache(maxsize=None)
def _declared(cls) -> tuple[tuple[str, object], ...]:
    """(field name, declared type) of a config dataclass, annotations resolved."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))


def _attribute_value(name: str, declared, value):
    """``value`` as its field's declared ONNX type: float fields -> float (FLOAT), every other -> int (INT:
    ints, bools, enums). A non-integral number for an int field is an error naming it."""
    if declared is float:
        return float(value)
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name}: an integer attribute, got {value!r}")
    return int(value)


def _attrs(obj, prefix: str = "") -> dict:
    """``obj``'s own attributes (a RopeConfig member expanded as ``rope_*``; the pool is added by the caller)."""
    out = {}
    for name, declared in _declared(type(obj)):
        value = getattr(obj, name)
        if declared is RopeConfig:
            out.update(_attrs(value, "rope_"))
        elif declared is not PoolConfig:
            if _is_floats(declared):
                if value:  # FLOATS; an empty list has no ONNX type and stays out (the plugin reads it as empty)
                    out[prefix + name] = [float(v) for v in value]
            else:
                out[prefix + name] = _attribute_value(prefix + name, declared, value)
    return out


def attribute_types(cls) -> dict[str, str]:
    """Attribute name -> ``FLOAT``, ``INT`` or ``FLOATS`` of a plugin config class (``WriteConfig``,
    ``AttentionConfig``), in ``to_attributes`` order, the FLOATS an instance may leave out included: what the C++
    creator's ``getFieldNames`` lists as kFLOAT32 / kINT32 / kFLOAT32 arrays."""
    def walk(c, prefix=""):
        for name, declared in _declared(c):
            if declared is RopeConfig:
                yield from walk(declared, "rope_")
            elif declared is not PoolConfig:
                yield prefix + name, FLOATS if _is_floats(declared) else FLOAT if declared is float else INT

    return {**dict(walk(cls)), **dict(walk(PoolConfig))}


@dataclass(frozen=True)
class PoolConfig:
    """Where a layer's K/V live: the pool group's geometry and dtype (shared by both plugins). The rewrite derives
    it from the layer's ``pagedkv.pool_group.PoolGroup`` (``group.pool_config(layer_index, pool_index)``)."""

    num_kv_heads: int
    head_dim: int
    page_size: int
    num_layers: int  # layers in the pool group
    layer_index: int  # this layer within the group
    pool_index: int = 0  # row of the `kv_pools` engine input
    cache_dtype: CacheDType = CacheDType.FP16
    page_layout: PageLayout = PageLayout.HND
    ring_sink_tokens: int = 0  # cyclic cache: first positions kept outside the ring (not attention_sinks)
    cyclic_len: int = 0  # 0: linear cache
    k_scale: float = 1.0  # quantized caches: x ~= stored * k_scale
    v_scale: float = 1.0

    def layout(self) -> KVLayout:
        return KVLayout(self.num_layers, self.num_kv_heads, self.page_size, self.head_dim,
                        PageLayout(self.page_layout), self.ring_sink_tokens, self.cyclic_len)


def _check_common(num_q_heads: int, pool: PoolConfig) -> None:
    supported = capabilities()
    if pool.head_dim not in supported.head_dims:
        raise ValueError(f"head_dim: expected one of {supported.head_dims}, got {pool.head_dim}")
    if num_q_heads <= 0 or pool.num_kv_heads <= 0 or num_q_heads % pool.num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads}: must be a positive multiple of num_kv_heads={pool.num_kv_heads}")
    if not 0 <= pool.layer_index < pool.num_layers:
        raise ValueError(f"layer_index: expected in [0, num_layers={pool.num_layers}), got {pool.layer_index}")
    if CacheDType(pool.cache_dtype) not in supported.cache_dtypes:
        raise ValueError(f"cache_dtype: {CacheDType(pool.cache_dtype).name} ({int(pool.cache_dtype)}) is reserved in "
                         f"the layout but has no kernel; expected one of {[c.name for c in supported.cache_dtypes]}")
    for name in ("k_scale", "v_scale"):
        v = getattr(pool, name)
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name}: must be finite and > 0, got {v}")
    pool.layout()  # geometry checks


class _PluginAttributes:
    """ONNX node attributes <-> config, for both plugins: the plugin's own fields, then its pool's."""

    def to_attributes(self) -> dict:
        """The plugin fields: name -> int (INT attribute, kINT32 field) or float (FLOAT, kFLOAT32)."""
        attrs = _attrs(self)
        attrs.update(_attrs(self.pool))
        return attrs

    def to_node_attributes(self) -> dict:
        """The plugin node's ONNX attributes: the fields, and ``plugin_namespace`` / ``plugin_version`` (STRING),
        which TensorRT's ONNX parser reads to find the creator (TensorRT 10.1's parser looks in namespace ""
        without them)."""
        return {**self.to_attributes(), PLUGIN_NAMESPACE_ATTRIBUTE: PLUGIN_NAMESPACE,
                PLUGIN_VERSION_ATTRIBUTE: PLUGIN_VERSION}

    @classmethod
    def from_attributes(cls, attrs: dict):
        return _split_pool(cls, attrs)


@dataclass(frozen=True)
class WriteConfig(_PluginAttributes):
    """Attributes of the ``PagedKVQKVWrite`` plugin (fused bias + RoPE + quantize + paged KV write)."""

    num_q_heads: int
    pool: PoolConfig
    rope: RopeConfig = field(default_factory=RopeConfig)
    has_bias: bool = False
    explicit_positions: bool = False  # take RoPE positions from the `position_ids` input
    zero_v_tail: bool = True
    q_out_fp8: bool = False
    q_scale: float = 1.0

    def __post_init__(self):
        _check_common(self.num_q_heads, self.pool)
        if self.rope.style != RopeStyle.NONE:
            self.rope.resolved_rotary_dim(self.pool.head_dim)
        check_attribute_values(self.to_attributes())


@dataclass(frozen=True)
class AttentionConfig(_PluginAttributes):
    """Attributes of the ``PagedKVAttention`` plugin."""

    num_q_heads: int
    pool: PoolConfig
    window: int = 0  # <= 0: full causal
    attention_sinks: int = 0  # with window > 0: the first positions stay visible (not the pool's ring_sink_tokens)
    softmax_scale: float = 0.0  # 0 -> 1/sqrt(head_dim)
    logit_softcap: float = 0.0  # > 0: cap * tanh(logits / cap)
    q_fp8: bool = False
    q_scale: float = 1.0
    # The output's dtype, an IODType value (pagedkv.kernels.write: 0 fp16, 1 bf16), or OUT_DTYPE_LIKE_Q. An fp8
    # query does not say what the model computes in, so a plugin node with q_fp8 needs it (the graph's dtype).
    out_dtype: int = OUT_DTYPE_LIKE_Q

    def __post_init__(self):
        _check_common(self.num_q_heads, self.pool)
        accepted = (OUT_DTYPE_LIKE_Q, *capabilities().io_dtypes)
        if self.out_dtype not in accepted:
            raise ValueError(f"out_dtype: expected one of {accepted} (-1 like q, 0 fp16, 1 bf16), got {self.out_dtype}")
        check_attribute_values(self.to_attributes())

    def to_node_attributes(self) -> dict:
        # The kernels take the output dtype as a launch argument; a plugin node must carry it (the plugin
        # refuses q_fp8 without it).
        if self.q_fp8 and self.out_dtype == OUT_DTYPE_LIKE_Q:
            raise ValueError("out_dtype: a PagedKVAttention node with q_fp8 needs the output dtype (0 fp16, "
                             "1 bf16), got -1 (like q)")
        return super().to_node_attributes()

    @property
    def resolved_softmax_scale(self) -> float:
        return self.softmax_scale if self.softmax_scale > 0 else 1.0 / math.sqrt(self.pool.head_dim)


def _split_pool(cls, attrs: dict):
    pool_names = {f.name for f in dataclasses.fields(PoolConfig)}
    pool_attrs = {k: v for k, v in attrs.items() if k in pool_names}
    rest = {k: v for k, v in attrs.items() if k not in pool_names}
    missing = {f.name for f in dataclasses.fields(PoolConfig)
               if f.default is dataclasses.MISSING} - set(pool_attrs)
    if missing:
        raise ValueError(f"{cls.__name__}: missing attribute(s) {sorted(missing)}")
    pool = PoolConfig(**{k: (CacheDType(v) if k == "cache_dtype" else PageLayout(v) if k == "page_layout" else v)
                         for k, v in pool_attrs.items()})
    kwargs = {}
    rope_kwargs = {}
    known = {f.name for f in dataclasses.fields(cls)}
    identity = {PLUGIN_NAMESPACE_ATTRIBUTE: PLUGIN_NAMESPACE, PLUGIN_VERSION_ATTRIBUTE: PLUGIN_VERSION}
    for key, value in rest.items():
        if key in identity:
            text = value.decode() if isinstance(value, bytes) else value
            if text != identity[key]:
                raise ValueError(f"{cls.__name__}: attribute {key}={text!r}, expected {identity[key]!r} (the "
                                 "plugins this library registers)")
            continue
        if key.startswith("rope_") and "rope" in known:
            rope_kwargs[key[len("rope_"):]] = value
        elif key in known and key not in ("pool", "rope"):
            kwargs[key] = value
        else:
            raise ValueError(f"{cls.__name__}: unknown attribute {key!r}={value!r}")
    if "rope" in known:
        rope_fields = {f.name for f in dataclasses.fields(RopeConfig)}
        bad = set(rope_kwargs) - rope_fields
        if bad:
            raise ValueError(f"{cls.__name__}: unknown attribute(s) {sorted('rope_' + b for b in bad)}")
        if "style" in rope_kwargs:
            rope_kwargs["style"] = RopeStyle(rope_kwargs["style"])
        if "scaling" in rope_kwargs:
            rope_kwargs["scaling"] = RopeScaling(rope_kwargs["scaling"])
        if "truncate" in rope_kwargs:
            rope_kwargs["truncate"] = bool(rope_kwargs["truncate"])
        kwargs["rope"] = RopeConfig(**rope_kwargs)
    return cls(pool=pool, **kwargs)
