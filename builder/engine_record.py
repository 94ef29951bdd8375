"""What an engine file says about itself, read without a GPU: the record ``pagedkv build`` writes into the engine,
the TensorRT-RTX engine header, and the plugins' own serialized fields. ``pagedkv inspect`` reports them, each
with where it came from; nothing here imports TensorRT.

1. **The build record** (written at build time, read back from the engine file). ``pagedkv build`` puts a JSON
   object into every plugin layer's metadata (``ILayer.metadata``, TensorRT's documented per-layer string, at
   most 4096 bytes, kept in the engine and emitted by ``IEngineInspector`` with ``ProfilingVerbosity.DETAILED``):
   that layer's name, plugin and fields, and one chunk of the build record (flavour and version, targets, limits,
   optimization profile, the network's I/O). ``read_record`` finds the objects in the engine bytes by their
   opening (``{"pagedkv_engine": 1``) and joins the chunks. Measured: TensorRT-RTX 1.7.1 keeps layer metadata
   verbatim in the plan.
2. **The TensorRT-RTX header** (read from the engine): the first 64 bytes (``Runtime.engine_header_size``) of a
   TensorRT-RTX plan. Its layout is not documented; ``read_rtx_header`` decodes what was measured on 1.7.1.116
   plans built for each target separately (``tests/test_engine_build.py`` re-measures it on every CI run): magic
   ``vtrt``, u64 plan size at 16, version bytes (major, minor, patch, build) at 24, u64 compute-capability mask at
   32 (bit 0 SM75, 1 SM80, 2 SM86, 3 SM89, 4 SM120, 5 SM121; the library's default targets also set bit 6,
   which no single target sets). Other plans: the header is reported as not decoded.
3. **Plugin field records** (read from the engine): each plugin's ``getFieldsToSerialize`` as a TensorRT-RTX 1.7
   plan stores it (u32 count, 8 bytes not interpreted, then per field u32 name length, name, u32
   ``PluginFieldType``, u32 length, data: the layout the test host's ``FieldSet::toBlob`` reproduces). ``read_plugin_fields`` finds them by their first field
   (``num_q_heads``, the first of both plugins' tables) and decodes them; a record is a plugin's own account of
   its fields, to hold against the build record.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np

from pagedkv.config import (ATTENTION_PLUGIN_NAME, FLOATS, WRITE_PLUGIN_NAME, AttentionConfig, WriteConfig,
                            attribute_types)

RECORD_KEY = "pagedkv_engine"
RECORD_VERSION = 1
RECORD_OPENING = ('{"' + RECORD_KEY + '":').encode()
MAX_LAYER_METADATA = 4095  # TensorRT: at most 4096 bytes including the terminator
_PLUGIN_CLASSES = {WRITE_PLUGIN_NAME: WriteConfig, ATTENTION_PLUGIN_NAME: AttentionConfig}
# FLOATS fields (LongRoPE's factor lists): serialized as kFLOAT32 of their length, and left out when empty
_ARRAY_FIELDS = frozenset(n for c in _PLUGIN_CLASSES.values() for n, t in attribute_types(c).items() if t == FLOATS)


# ---- 1. the build record -----------------------------------------------------------------------------------
def layer_metadata(layers: list[dict], record: dict) -> list[str]:
    """The metadata string of each plugin layer (``layers``: [{"layer", "plugin", "fields"}] in network order):
    the layer's own entry plus a chunk of ``record``, every string within TensorRT's limit."""
    text = json.dumps(record, sort_keys=True, separators=(",", ":"))
    own = [json.dumps({RECORD_KEY: RECORD_VERSION, "layer": entry}, separators=(",", ":")) for entry in layers]
    # room left on each layer for a chunk: what the entry leaves, less `,"record":[i,n,...]`; the chunk travels as
    # a JSON string, so it is cut where its escaped form fits
    room = [MAX_LAYER_METADATA - len(o) - 32 for o in own]
    if not layers or min(room) < 8:
        raise ValueError(f"layer metadata: a plugin layer's own entry leaves no room within {MAX_LAYER_METADATA} bytes")
    chunks, at = [], 0
    for r in room:
        n = r
        while len(json.dumps(text[at:at + n])) > r:
            n -= len(json.dumps(text[at:at + n])) - r
        chunks.append(text[at:at + n])
        at += n
    if at < len(text):
        raise ValueError(f"layer metadata: the build record ({len(text)} bytes) does not fit in {len(layers)} plugin "
                         f"layers' metadata")
    n = sum(1 for c in chunks if c)
    out = []
    for entry, chunk, i in zip(layers, chunks, range(len(layers))):
        obj = {RECORD_KEY: RECORD_VERSION, "layer": entry}  # the key first: read_record finds the opening
        if chunk:
            obj["record"] = [i, n, chunk]
        s = json.dumps(obj, separators=(",", ":"))
        assert len(s) <= MAX_LAYER_METADATA, len(s)
        out.append(s)
    return out


@dataclass
class EngineRecord:
    """What the layer metadata of an engine says: the build record and each plugin layer's entry."""

    record: dict | None  # None: no complete record found
    layers: list[dict] = field(default_factory=list)  # [{"layer", "plugin", "fields"}], in engine order, deduplicated
    problems: list[str] = field(default_factory=list)


def read_record(data: bytes) -> EngineRecord:
    """The build record and plugin-layer entries found in an engine file's bytes (or in an inspector's JSON text)."""
    decoder = json.JSONDecoder()
    entries, chunks, problems = {}, {}, []
    at = data.find(RECORD_OPENING)
    while at >= 0:
        window = data[at:at + MAX_LAYER_METADATA].decode("ascii", errors="replace")  # one layer's string at most
        try:
            obj, _ = decoder.raw_decode(window)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and obj.get(RECORD_KEY) == RECORD_VERSION and isinstance(obj.get("layer"), dict):
            layer = obj["layer"]
            entries.setdefault(layer.get("layer"), layer)
            if "record" in obj:
                i, n, chunk = obj["record"]
                chunks[i] = (n, chunk)
        at = data.find(RECORD_OPENING, at + 1)
    record = None
    if chunks:
        counts = {n for n, _ in chunks.values()}
        n = counts.pop() if len(counts) == 1 else -1
        if n < 0 or sorted(chunks) != list(range(n)):
            problems.append(f"build record: chunks {sorted(chunks)} of {sorted({c[0] for c in chunks.values()})} found, "
                            "not all of them: the record cannot be read")
        else:
            try:
                record = json.loads("".join(chunks[i][1] for i in range(n)))
            except ValueError as exc:
                problems.append(f"build record: not valid JSON once joined ({exc})")
    return EngineRecord(record, list(entries.values()), problems)


# ---- 2. the TensorRT-RTX header ------------------------------------------------------------------------------
RTX_MAGIC = b"vtrt"
RTX_HEADER_BYTES = 64
RTX_TARGET_BITS = {0: "SM75", 1: "SM80", 2: "SM86", 3: "SM89", 4: "SM120", 5: "SM121"}


@dataclass(frozen=True)
class RTXHeader:
    plan_bytes: int  # the plan's size as the header states it
    version: str  # "1.7.1.116"
    targets: tuple[str, ...]  # compute capabilities whose bit is set
    unnamed_target_bits: tuple[int, ...]  # set bits no single-target build was seen to set


def read_rtx_header(data: bytes) -> RTXHeader | None:
    """The decoded header of a TensorRT-RTX plan (layout measured on 1.7.1), or None when ``data`` is not one."""
    if len(data) < RTX_HEADER_BYTES or data[:4] != RTX_MAGIC:
        return None
    (plan_bytes,) = struct.unpack_from("<Q", data, 16)
    major, minor, patch, build = data[24:28]
    (mask,) = struct.unpack_from("<Q", data, 32)
    bits = [b for b in range(64) if mask >> b & 1]
    return RTXHeader(int(plan_bytes), f"{major}.{minor}.{patch}.{build}",
                     tuple(RTX_TARGET_BITS[b] for b in bits if b in RTX_TARGET_BITS),
                     tuple(b for b in bits if b not in RTX_TARGET_BITS))


# ---- 3. plugin field records ---------------------------------------------------------------------------------
_FIELD_TYPES = {1: ("kFLOAT32", "<f", 4), 5: ("kINT32", "<i", 4)}  # what our plugins serialize
_FIRST_FIELD = "num_q_heads"
_FIRST_FIELD_BYTES = struct.pack("<I", len(_FIRST_FIELD) + 1) + _FIRST_FIELD.encode() + b"\x00"


_RESERVED = 8  # after the count: bytes not interpreted (zeros in some records, another value in others)


def _decode_record(data: bytes, start: int) -> dict | None:
    """The field record whose count is at ``start``: {name: value}, or None when the bytes do not hold one of ours."""
    try:
        (count,) = struct.unpack_from("<I", data, start)
        at, fields = start + 4 + _RESERVED, {}
        if not 0 < count <= 256:
            return None
        for _ in range(count):
            (name_len,) = struct.unpack_from("<I", data, at)
            name = data[at + 4:at + 4 + name_len]
            if not name_len or name[-1:] != b"\x00":
                return None
            at += 4 + name_len
            key = name[:-1].decode("ascii")
            ftype, length = struct.unpack_from("<II", data, at)
            at += 8
            is_array = key in _ARRAY_FIELDS and ftype == 1
            if ftype not in _FIELD_TYPES or not (length == 1 or is_array and 0 < length <= 256):
                return None
            _, fmt, size = _FIELD_TYPES[ftype]
            values = struct.unpack_from(f"<{length}{fmt[1:]}", data, at)
            at += size * length
            if is_array:
                fields[key] = [float(np.float32(v)) for v in values]  # a list, as the JSON build record holds it
            else:
                fields[key] = float(np.float32(values[0])) if ftype == 1 else int(values[0])
        return fields
    except (struct.error, UnicodeDecodeError):
        return None


def plugin_of_fields(names) -> str | None:
    """Which plugin has these field names (config.py's attribute sets; FLOATS fields may be absent), or None."""
    for plugin, cls in _PLUGIN_CLASSES.items():
        every = set(attribute_types(cls))
        if every - _ARRAY_FIELDS <= set(names) <= every:
            return plugin
    return None


def read_plugin_fields(data: bytes) -> list[tuple[str, dict]]:
    """Every distinct (plugin, fields) record of our plugins in an engine file, in file order."""
    seen, out = set(), []
    at = data.find(_FIRST_FIELD_BYTES)
    while at >= 0:
        fields = _decode_record(data, at - 4 - _RESERVED)
        plugin = plugin_of_fields(fields) if fields else None
        if plugin is not None:
            key = (plugin, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in fields.items())))
            if key not in seen:
                seen.add(key)
                out.append((plugin, fields))
        at = data.find(_FIRST_FIELD_BYTES, at + 1)
    return out
