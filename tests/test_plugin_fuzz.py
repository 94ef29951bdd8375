"""Corrupt and hostile plugin data through the creators, the way TensorRT would hand it over (CPU, no TensorRT).

10^4 cases from a seeded generator go through the C++ test host's ``fuzz`` command (``createPlugin`` in one
process, both phases): field collections with wrong types, wrong lengths, null data or names, out-of-range values,
NaN/inf floats, duplicates, missing and unknown fields, broken cross-field rules, a malformed collection or phase;
and serialized blobs (the field collection as TensorRT-RTX stores it in an engine, ``FieldSet::toBlob`` in the
test host) truncated, bit-flipped, spliced or overwritten. The bar: the library never crashes (a signal fails the
test), every case designed to be invalid is refused, every refusal says which field (or which part of the
collection) is wrong, and whatever is accepted survives a serialization round trip and a clone.

The base configurations are random valid ``WriteConfig`` / ``AttentionConfig`` (``src/pagedkv/config.py``); they
must all be accepted, so Python's validation and the plugins' agree on them too.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess

import numpy as np
import pytest

from pagedkv import _lib
from pagedkv.capabilities import capabilities
from pagedkv.config import (ATTENTION_PLUGIN_NAME, FLOAT, FLOATS, WRITE_PLUGIN_NAME, AttentionConfig, PoolConfig,
                            RopeConfig, RopeScaling, RopeStyle, WriteConfig, attribute_types)

NUM_CASES = 10_000
NUM_BASES = 64  # valid configurations the mutations start from (half per plugin)
SEED = 20261201
HOST_TIMEOUT_S = 300
CLASSES = {WRITE_PLUGIN_NAME: WriteConfig, ATTENTION_PLUGIN_NAME: AttentionConfig}
FIELD_TYPES = ["kFLOAT16", "kFLOAT32", "kFLOAT64", "kINT8", "kINT16", "kINT32", "kCHAR", "kDIMS", "kUNKNOWN",
               "kBF16", "kINT64", "kFP8", "kINT4", "kFP4"]
INVALID_TYPE_VALUES = [14, 99, -1, 2 ** 31 - 1]  # not a PluginFieldType at all
# Names a refusal may cite instead of a field: the collection itself, the phase, a nameless field.
COLLECTION_WORDS = ("PluginFieldCollection", "TensorRTPhase", "has no name")


# ---- valid configurations ------------------------------------------------------------------------------------
def random_config(rng: np.random.Generator, plugin: str):
    caps = capabilities()
    kv_heads = int(rng.choice([1, 2, 4, 8]))
    head_dim = int(rng.choice(caps.head_dims))
    page = int(rng.choice([1, 7, 16, 32, 64, 100, 256]))
    layers = int(rng.integers(1, 5))
    cache = caps.cache_dtypes[int(rng.integers(len(caps.cache_dtypes)))]
    cyclic = int(rng.integers(0, 3)) * page * 4
    pool = PoolConfig(num_kv_heads=kv_heads, head_dim=head_dim, page_size=page, num_layers=layers,
                      layer_index=int(rng.integers(layers)), pool_index=int(rng.integers(4)), cache_dtype=cache,
                      page_layout=caps.page_layouts[int(rng.integers(len(caps.page_layouts)))],
                      ring_sink_tokens=int(rng.integers(0, page)) if cyclic else 0, cyclic_len=cyclic,
                      k_scale=float(rng.uniform(0.01, 2)), v_scale=float(rng.uniform(0.01, 2)))
    heads = kv_heads * int(rng.choice([1, 2, 4]))
    if plugin == WRITE_PLUGIN_NAME:
        style = RopeStyle(int(rng.integers(3)))
        scaling = RopeScaling(int(rng.integers(3)))
        rope = RopeConfig(style=style, rotary_dim=int(rng.choice([0, head_dim // 2, head_dim])),
                          theta=float(rng.choice([10000, 500000, 1e6])), scaling=scaling,
                          factor=float(rng.choice([1, 2, 8])), low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_positions=int(rng.choice([2048, 8192])))
        q_fp8 = bool(rng.integers(2))
        return WriteConfig(num_q_heads=heads, pool=pool, rope=rope, has_bias=bool(rng.integers(2)),
                           explicit_positions=bool(rng.integers(2)), zero_v_tail=bool(rng.integers(2)),
                           q_out_fp8=q_fp8, q_scale=float(rng.uniform(0.1, 2)))
    q_fp8 = bool(rng.integers(2))
    return AttentionConfig(num_q_heads=heads, pool=pool, window=int(rng.choice([0, -1, 64, 4096])),
                           attention_sinks=int(rng.choice([0, 4])), softmax_scale=float(rng.choice([0.0, 0.125])),
                           logit_softcap=float(rng.choice([0.0, 30.0])), q_fp8=q_fp8, q_scale=0.5,
                           out_dtype=int(rng.integers(2)) if q_fp8 else int(rng.integers(-1, 2)))


def raw(attrs: dict, types: dict) -> dict:
    """Attributes as the raw fields an application would pass: kINT32 / kFLOAT32 values (one, or a FLOATS list)."""
    return {name: {"raw_type": "kFLOAT32" if types[name] in (FLOAT, FLOATS) else "kINT32",
                   "values": list(value) if types[name] == FLOATS else [value]}
            for name, value in attrs.items()}


# ---- mutations of a field collection (each one makes the collection invalid) ---------------------------------
def mutate_fields(rng, fields: dict, types: dict, phase: str):
    """-> (fields, names the refusal must cite, what was done). Applies one invalid change."""
    names = list(fields)
    name = names[int(rng.integers(len(names)))]
    kind = str(rng.choice(["type", "invalid_type", "length", "null_data", "null_name", "int_range", "float_value",
                           "duplicate", "missing", "cross"]))
    out = dict(fields)
    if kind == "type":
        wrong = [t for t in FIELD_TYPES if t not in (("kFLOAT32", "kFLOAT64") if types[name] == FLOAT
                                                      else ("kINT32", "kINT64"))]
        t = str(rng.choice(wrong))
        values = "x" * int(rng.integers(0, 5)) if t == "kCHAR" else \
            [int(v) for v in rng.integers(-3, 3, int(rng.integers(0, 4)))]
        out[name] = {"raw_type": t, "values": [] if t in ("kDIMS", "kFLOAT16", "kBF16", "kINT4", "kFP4") else values,
                     "length": int(rng.integers(0, 3))}
    elif kind == "invalid_type":
        out[name] = {"raw_type": int(rng.choice(INVALID_TYPE_VALUES)), "values": [], "length": 1}
    elif kind == "length":
        length = int(rng.choice([0, 2, 3, 1000, -1, -(2 ** 31)]))
        t = "kFLOAT32" if types[name] == FLOAT else "kINT32"
        out[name] = {"raw_type": t, "values": [1] * max(0, min(length, 3)), "length": length}
    elif kind == "null_data":
        out[name] = dict(fields[name], null_data=True)
    elif kind == "null_name":
        out[name] = dict(fields[name], null_name=True)
        return out, COLLECTION_WORDS, kind
    elif kind == "int_range":
        int_names = [n for n in names if types[n] != FLOAT]
        name = int_names[int(rng.integers(len(int_names)))]
        out[name] = {"raw_type": "kINT64", "values": [int(rng.choice([2 ** 31, -(2 ** 31) - 1, 2 ** 40, -(2 ** 62)]))]}
    elif kind == "float_value":
        float_names = [n for n in names if types[n] == FLOAT]
        name = float_names[int(rng.integers(len(float_names)))]
        value = rng.choice([np.nan, np.inf, -np.inf, -1.0, -1e-30])
        big = bool(rng.integers(2))
        out[name] = {"raw_type": "kFLOAT64", "values": [1e39 if big else float(value)]} if big or value == -1e-30 \
            else {"raw_type": "kFLOAT32", "values": [float(value)]}
    elif kind == "duplicate":
        # JSON objects hold one value per name, so the duplicate is spelled out in the case text (see case_text)
        return out, (name, "__duplicate__"), kind
    elif kind == "missing":
        required = ["num_q_heads", "num_kv_heads", "head_dim", "page_size", "num_layers", "layer_index"]
        name = names[int(rng.integers(len(names)))] if phase == "runtime" else str(rng.choice(required))
        del out[name]
    else:  # cross: values that are each in range but contradict another field
        rule = int(rng.integers(3))
        if rule == 0:
            kv = int(fields["num_kv_heads"]["values"][0])
            out["num_kv_heads"] = {"raw_type": "kINT32", "values": [kv]}
            out["num_q_heads"] = {"raw_type": "kINT32", "values": [kv * 2 + 1 if kv > 1 else 1]}
            if kv == 1:  # every count is a multiple of 1: contradict with 3 KV heads instead
                out["num_kv_heads"] = {"raw_type": "kINT32", "values": [3]}
                out["num_q_heads"] = {"raw_type": "kINT32", "values": [4]}
            return out, ("num_q_heads", "num_kv_heads"), "cross: heads"
        page = int(fields["page_size"]["values"][0])
        if rule == 1 or page == 1:  # (with one-slot pages every ring length is a page multiple)
            n = int(fields["num_layers"]["values"][0])
            out["layer_index"] = {"raw_type": "kINT32", "values": [n]}
            return out, ("layer_index", "num_layers"), "cross: layer"
        out["cyclic_len"] = {"raw_type": "kINT32", "values": [page * 4 + 1]}  # not a whole number of pages
        return out, ("cyclic_len", "page_size"), "cross: ring"
    return out, (name,), kind


# ---- mutations of a serialized blob (may or may not stay valid) ----------------------------------------------
def mutate_blob(rng, blob: bytes) -> bytes:
    b = bytearray(blob)
    kind = int(rng.integers(6))
    if kind == 0:  # truncated
        return bytes(b[:int(rng.integers(0, len(b)))])
    if kind == 1:  # bit flips
        for _ in range(int(rng.integers(1, 8))):
            i = int(rng.integers(len(b)))
            b[i] ^= 1 << int(rng.integers(8))
        return bytes(b)
    if kind == 2:  # a u32 (a count, a name length, a type, a length) overwritten with an extreme
        i = int(rng.integers(0, max(1, len(b) - 4)))
        b[i:i + 4] = int(rng.choice([0, 1, 0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, 5, 1000])).to_bytes(4, "little")
        return bytes(b)
    if kind == 3:  # bytes removed from the middle
        i = int(rng.integers(len(b)))
        return bytes(b[:i] + b[i + int(rng.integers(1, 16)):])
    if kind == 4:  # a slice repeated
        i = int(rng.integers(len(b)))
        return bytes(b[:i] + b[i:i + int(rng.integers(1, 64))] + b[i:])
    return bytes(rng.integers(0, 256, int(rng.integers(0, 256)), dtype=np.uint8))  # noise


# ---- the run ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def host():
    exe, lib = _lib.find_file(_lib.TESTHOST_NAME), _lib.find_file(_lib.PLUGINS_NAME)
    if exe is None or lib is None:
        pytest.fail(f"{_lib.TESTHOST_NAME} / {_lib.PLUGINS_NAME} not found in {[str(d) for d in _lib.lib_dirs()]}")
    return str(exe), str(lib)


def run_fuzz(host, tmp_path, cases_text: str) -> list[dict]:
    exe, lib = host
    path = tmp_path / "cases.json"
    path.write_text(cases_text)
    proc = subprocess.run([exe, "fuzz", "--lib", lib, "--cases", str(path)], capture_output=True, text=True,
                          timeout=HOST_TIMEOUT_S)
    if proc.returncode < 0:
        pytest.fail(f"the plugin library crashed the test host (signal {-proc.returncode}); stderr: {proc.stderr[-2000:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)["results"]


def case_text(case: dict, duplicate: str | None) -> str:
    text = json.dumps(case)
    if duplicate is None:
        return text
    # the same field twice, the second a valid value too: only the repetition is wrong
    spec = json.dumps(case["attrs"][duplicate])
    return text.replace('"attrs": {', f'"attrs": {{"{duplicate}": {spec}, ', 1)


FIELD_NAMED = re.compile(r"field '(\w+)'|field\(s\) '(\w+)'|'(\w+)' given twice")


def test_fuzzed_fields_and_blobs_never_crash_and_every_refusal_names_the_field(host, tmp_path):
    rng = np.random.default_rng(SEED)
    plugins = [WRITE_PLUGIN_NAME, ATTENTION_PLUGIN_NAME]
    bases = [(p, random_config(rng, p)) for _ in range(NUM_BASES // 2) for p in plugins]

    # 1. the bases: every one accepted in both phases; their serialized blobs seed the blob mutations
    base_cases = [{"plugin": p, "phase": phase, "caller": "direct", "attrs": cfg.to_attributes()}
                  for p, cfg in bases for phase in ("build", "runtime")]
    results = run_fuzz(host, tmp_path, json.dumps(base_cases))
    refused = [(c, r["messages"]) for c, r in zip(base_cases, results) if not r["created"]]
    assert not refused, f"valid configurations refused: {refused[:3]}"
    assert all(r["round_trip"] for r in results)
    blobs = []
    exe, lib = host
    for p, cfg in bases:
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps({"plugin": p, "attrs": cfg.to_attributes(), "caller": "direct"}))
        proc = subprocess.run([exe, "create", "--lib", lib, "--spec", str(spec)], capture_output=True, text=True,
                              timeout=HOST_TIMEOUT_S)
        assert proc.returncode == 0, proc.stderr
        blobs.append((p, bytes.fromhex(json.loads(proc.stdout)["blob"])))

    # 2. the mutations
    cases, expect = [], []  # expect: (must be refused, names the refusal may cite)
    texts = []
    for i in range(NUM_CASES):
        p, cfg = bases[int(rng.integers(len(bases)))]
        types = attribute_types(CLASSES[p])
        phase = str(rng.choice(["build", "runtime"]))
        roll = rng.random()
        duplicate = None
        if roll < 0.55:
            fields, cite, kind = mutate_fields(rng, raw(cfg.to_attributes(), types), types, phase)
            case = {"plugin": p, "phase": phase, "caller": "direct", "attrs": fields, "mutation": kind}
            if cite[-1] == "__duplicate__":
                duplicate, cite = cite[0], (cite[0],)
            must_refuse = True
        elif roll < 0.60:  # the collection or the phase itself
            if rng.random() < 0.5:
                case = {"plugin": p, "phase": phase, "caller": "direct", "attrs": {},
                        "collection": str(rng.choice(["null", "negative_count", "null_fields"]))}
            else:
                case = {"plugin": p, "phase": int(rng.choice([2, -1, 99])), "caller": "direct",
                        "attrs": cfg.to_attributes()}
            cite, must_refuse = COLLECTION_WORDS, True
        elif roll < 0.65:  # an unknown field beside valid ones: a warning, still accepted
            case = {"plugin": p, "phase": phase, "caller": "direct",
                    "attrs": dict(cfg.to_attributes(), **{f"knob_{i}": int(rng.integers(9))})}
            cite, must_refuse = (), False
        else:
            bp, blob = blobs[int(rng.integers(len(blobs)))]
            case = {"plugin": bp, "phase": phase, "blob": mutate_blob(rng, blob).hex()}
            cite, must_refuse = None, False  # any field of the plugin may be the one cited
        cases.append(case)
        expect.append((must_refuse, cite))
        texts.append(case_text(case, duplicate))
    results = run_fuzz(host, tmp_path, "[" + ",".join(texts) + "]")
    assert len(results) == NUM_CASES

    counts = {"refused": 0, "accepted": 0}
    for case, (must_refuse, cite), r in zip(cases, expect, results):
        where = json.dumps(case)[-1500:]
        errors = [m for m in r["messages"] if m.startswith(("ERROR", "INTERNAL_ERROR"))]
        if r["created"]:
            counts["accepted"] += 1
            assert not must_refuse, f"an invalid collection was accepted: {where}"
            assert r["round_trip"], f"accepted, but its serialization does not deserialize or clone: {where}"
            continue
        counts["refused"] += 1
        assert errors, f"refused without a reason: {where}"
        text = " ".join(errors)
        if cite is None:  # a blob: the reason names a field of this plugin, or the collection
            fields = set(attribute_types(CLASSES[case["plugin"]]))
            named = {g for m in FIELD_NAMED.finditer(text) for g in m.groups() if g}
            assert named & fields or any(w in text for w in COLLECTION_WORDS), (where, errors)
        elif cite:
            assert any(name in text for name in cite), (cite, where, errors)
    # the generator reaches both outcomes (blobs: some mutations keep the data valid)
    assert counts["refused"] > NUM_CASES // 2 and counts["accepted"] > NUM_CASES // 50, counts


def test_blob_round_trip_of_every_field_type(host, tmp_path):
    """The blob codec of the test host is exact: a blob decodes to the fields it was made from."""
    cfg = dataclasses.replace(random_config(np.random.default_rng(3), WRITE_PLUGIN_NAME), has_bias=True)
    results = run_fuzz(host, tmp_path, json.dumps([{"plugin": WRITE_PLUGIN_NAME, "phase": "runtime",
                                                    "caller": "direct", "attrs": cfg.to_attributes()}]))
    assert results[0]["created"]
    exe, lib = host
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"plugin": WRITE_PLUGIN_NAME, "attrs": cfg.to_attributes(), "caller": "direct"}))
    proc = subprocess.run([exe, "create", "--lib", lib, "--spec", str(spec)], capture_output=True, text=True,
                          timeout=HOST_TIMEOUT_S)
    blob = json.loads(proc.stdout)["blob"]
    again = run_fuzz(host, tmp_path, json.dumps([{"plugin": WRITE_PLUGIN_NAME, "phase": "runtime", "blob": blob}]))
    assert again[0]["created"] and again[0]["messages"] == []
    truncated = run_fuzz(host, tmp_path, json.dumps([{"plugin": WRITE_PLUGIN_NAME, "phase": "runtime",
                                                      "blob": blob[:len(blob) // 2]}]))
    assert not truncated[0]["created"] and "incomplete" in truncated[0]["messages"][0]
