"""ctypes mirrors of the C API's structs, built from the library's own description of them.

The C API takes the launchers' parameter structs (``pagedkv::QKVWriteParams``, ``pagedkv::AttentionParams``,
``pagedkv::KVLayout``, ... in ``plugins/include/pagedkv/``). Their field lists exist once, in C++; the library
describes each struct (``pagedkv_struct_layouts()``: field names, types, byte offsets, sizes) and this module
turns the description into a ``ctypes.Structure``, so no binding copies a struct by hand. Field names are the
C++ members' (``numQHeads``, ``meta.cuQLens``, ``layout.ringSinkTokens``).

The layout check: ctypes places the described fields by its own (C) rules; every field's offset and size, and
the struct's size and alignment, must come out as the library reported them, else the struct is refused naming both layouts (the
C++ side checks at compile time that each description lists every member, capi_structs.cpp).
"""

from __future__ import annotations

import ctypes
import functools
import json
from types import SimpleNamespace

from pagedkv import _lib
from pagedkv.layout import KVLayout

_SCALARS = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "u64": ctypes.c_uint64, "f32": ctypes.c_float,
            "f64": ctypes.c_double, "bool": ctypes.c_bool, "ptr": ctypes.c_void_p, "str": ctypes.c_char_p}


@functools.lru_cache(maxsize=None)
def _descriptions() -> dict:
    return json.loads(_lib.capi().pagedkv_struct_layouts().decode())


def build_struct(name: str, descriptions: dict, built: dict | None = None) -> type[ctypes.Structure]:
    """The ctypes mirror of struct ``name`` from ``descriptions`` (the library's JSON, parsed). Raises
    ``RuntimeError`` when ctypes does not lay it out where the library says its fields are."""
    built = {} if built is None else built
    if name in built:
        return built[name]
    desc = descriptions[name]
    fields = []
    for f in desc["fields"]:
        ctype = _SCALARS[f["type"]] if f["type"] in _SCALARS else build_struct(f["type"], descriptions, built)
        fields.append((f["name"], ctype * f["count"] if "count" in f else ctype))
    struct = type(name, (ctypes.Structure,), {"_fields_": fields, "__doc__": f"Mirror of pagedkv {name} (C API)."})
    ours = [(getattr(struct, f["name"]).offset, getattr(struct, f["name"]).size) for f in desc["fields"]]
    theirs = [(f["offset"], f["size"]) for f in desc["fields"]]
    if (ours, ctypes.sizeof(struct), ctypes.alignment(struct)) != (theirs, desc["size"], desc["align"]):
        raise RuntimeError(f"{name}: ctypes lays it out as (offset, size) {ours}, size {ctypes.sizeof(struct)}, "
                           f"alignment {ctypes.alignment(struct)}; the library as {theirs}, size {desc['size']}, "
                           f"alignment {desc['align']}")
    built[name] = struct
    return struct


def struct_mirrors(layouts, names: dict[str, str]) -> SimpleNamespace:
    """The checked mirrors of another API's structs by Python name: ``layouts`` is its ``*_struct_layouts`` entry
    (a ctypes function of the loaded library), ``names`` maps each Python name to the C struct's
    (``{"SeqInfo": "pagedkv_kv_seq_info"}``)."""
    layouts.argtypes, layouts.restype = [], ctypes.c_char_p
    descriptions, built = json.loads(layouts().decode()), {}
    return SimpleNamespace(**{name: build_struct(c_name, descriptions, built) for name, c_name in names.items()})


_built: dict = {}  # the library's structs, each built once (nested ones are shared)


def struct(name: str) -> type[ctypes.Structure]:
    """The checked ctypes mirror of the C API struct ``name`` (``"QKVWriteParams"``, ``"KVLayout"``, ...)."""
    return build_struct(name, _descriptions(), _built)


def set_fields(struct: ctypes.Structure, overrides: dict) -> None:
    """Set members of a mirror by C++ path, e.g. ``{"headDim": 96, "layout.pageSize": 0}`` (to patch one field of
    an otherwise valid launch: the tests of the launchers' validation do)."""
    for path, value in overrides.items():
        *outer, name = path.split(".")
        target = struct
        for part in outer:
            target = getattr(target, part)
        if not any(field == name for field, _ in type(target)._fields_):
            raise AttributeError(f"{type(target).__name__} has no member {name!r} (path {path!r})")
        setattr(target, name, value)


def kv_layout(layout: KVLayout) -> ctypes.Structure:
    """``pagedkv::KVLayout`` of a pool group, built by the library's ``makeKVLayout`` (``pagedkv_kv_layout``).
    Raises ``pagedkv._lib.CapiError`` naming the first bad geometry field."""
    lib = _lib.capi()
    out = struct("KVLayout")()
    lib.pagedkv_kv_layout.argtypes = [ctypes.c_int32] * 7 + [ctypes.c_void_p]
    lib.pagedkv_kv_layout.restype = ctypes.c_int32
    _lib.check(lib.pagedkv_kv_layout(layout.num_layers, layout.num_kv_heads, layout.page_size, layout.head_dim,
                                     int(layout.page_layout), layout.ring_sink_tokens, layout.cyclic_len,
                                     ctypes.byref(out)), "pagedkv_kv_layout")
    return out
