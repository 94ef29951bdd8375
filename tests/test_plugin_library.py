"""The TensorRT plugin library through its public interface, driven by the C++ test host (CPU, no TensorRT).

``pagedkv_testhost`` (plugins/testhost) does what TensorRT does with the library: dlopen + setLoggerFinder +
getCreators, PluginFieldCollections built with the ONNX parser's type rules, createPlugin in both phases,
getOutputShapes with its own IExprBuilder, supportsFormatCombination, configurePlugin, getWorkspaceSize,
serialization round trips, clone / attachToContext, onShapeChange, and the load-time self-registration against
a registry of its own. It reports JSON; the assertions are here. Every host run is a subprocess, so a crash of
the library fails the test instead of the session.

The I/O contract the specs below encode is docs/plugin_io.md; the attribute names come from
``src/pagedkv/config.py`` (``to_attributes``), never restated here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import built_file
from pagedkv import _lib
from pagedkv.capabilities import capabilities
from pagedkv.config import (ATTENTION_PLUGIN_NAME, FLOAT, FLOATS, PLUGIN_NAMESPACE, PLUGIN_VERSION, WRITE_PLUGIN_NAME,
                            AttentionConfig, PoolConfig, RopeConfig, RopeScaling, RopeStyle, WriteConfig,
                            attribute_types)
from pagedkv.layout import CacheDType, PageLayout
from pagedkv.step import POOL_DESC_FIELDS, STATUS_FIELDS

HOST_TIMEOUT_S = 60


# ================================================================================================ host runs
@pytest.fixture(scope="module")
def host():
    """(testhost path, plugin library path); their absence fails: CI builds both (PAGEDKV_BUILD_TESTHOST)."""
    return built_file(_lib.TESTHOST_NAME, _lib.PLUGINS_NAME,
                      how="build them (pip install ., or cmake with PAGEDKV_BUILD_TESTHOST=ON and PAGEDKV_LIB_DIR)")


def run_host(host, command: str, tmp_path, spec=None, spec_text: str | None = None, extra=()):
    """Run the test host; return (exit status, report dict or None, stderr). A signal is a crash: fail."""
    exe, lib = host
    args = [exe, command, "--lib", lib, *extra]
    if spec is not None or spec_text is not None:
        path = tmp_path / f"spec_{command}_{len(list(tmp_path.iterdir()))}.json"
        path.write_text(spec_text if spec_text is not None else json.dumps(spec))
        args += ["--spec", str(path)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=HOST_TIMEOUT_S)
    if proc.returncode < 0:
        pytest.fail(f"the plugin library crashed the test host (signal {-proc.returncode}) on {command} "
                    f"{json.dumps(spec)[:2000] if spec is not None else spec_text}\nstderr: {proc.stderr}")
    if proc.returncode == 2:
        pytest.fail(f"test host error on {command}: {proc.stderr}")
    report = json.loads(proc.stdout) if proc.stdout.strip() else None
    return proc.returncode, report, proc.stderr


def errors(messages) -> list[str]:
    return [m["message"] for m in messages if m["severity"] in ("ERROR", "INTERNAL_ERROR")]


# ================================================================================================ configs
def pool(**kw) -> PoolConfig:
    base = dict(num_kv_heads=2, head_dim=64, page_size=16, num_layers=2, layer_index=1)
    base.update(kw)
    return PoolConfig(**base)


def write_cfg(num_q_heads=4, pool_kw=None, **kw) -> WriteConfig:
    return WriteConfig(num_q_heads=num_q_heads, pool=pool(**(pool_kw or {})), **kw)


def attn_cfg(num_q_heads=4, pool_kw=None, **kw) -> AttentionConfig:
    return AttentionConfig(num_q_heads=num_q_heads, pool=pool(**(pool_kw or {})), **kw)


# LongRoPE on head_dim 64 (32 pairs): both factor lists, an explicit attention factor, a short switch.
LONGROPE = RopeConfig(scaling=RopeScaling.LONGROPE, original_max_positions=12, factor=8.0, attention_factor=1.25,
                      short_factors=tuple(1.0 + 0.03 * i for i in range(32)),
                      long_factors=tuple(2.0 + 0.25 * i for i in range(32)))
YARN = RopeConfig(scaling=RopeScaling.YARN, theta=1e6, factor=4.0, original_max_positions=64, beta_fast=24.0,
                  beta_slow=2.0, truncate=False)


def tensor(name, dtype, dims):
    return {"name": name, "type": dtype, "dims": list(dims)}


BINDINGS = {"T": 7, "B": 3, "B1": 4, "MB": 5, "NP": 2}


def step_inputs():
    """Inputs 1..4, the same in both plugins: kv_pools, block_table, cu_q_lens [B+1], past_lens."""
    return [tensor("kv_pools", "kINT64", ["NP", POOL_DESC_FIELDS]), tensor("block_table", "kINT32", ["B", "MB"]),
            tensor("cu_q_lens", "kINT32", ["B1"]), tensor("past_lens", "kINT32", ["B"])]


def write_inputs(cfg: WriteConfig, io="kHALF"):
    width = (cfg.num_q_heads + 2 * cfg.pool.num_kv_heads) * cfg.pool.head_dim
    inputs = [tensor("qkv", io, ["T", width]), *step_inputs()]
    if cfg.explicit_positions:
        inputs.append(tensor("position_ids", "kINT32", ["T"]))
    if cfg.has_bias:
        inputs.append(tensor("bias", io, [width]))
    return inputs


def attention_inputs(cfg: AttentionConfig, q_type="kHALF"):
    return [tensor("q", q_type, ["T", cfg.num_q_heads * cfg.pool.head_dim]), *step_inputs(),
            tensor("kv_write_status", "kINT32", [STATUS_FIELDS])]


def spec_for(plugin, cfg, inputs, bindings=None, **extra):
    return {"plugin": plugin, "attrs": cfg.to_attributes(), "inputs": inputs, "bindings": bindings or BINDINGS,
            **extra}


def assert_fields_equal(reported: dict, attrs: dict):
    """Serialized fields == the attribute dict: same names, INT -> kINT32, FLOAT -> kFLOAT32, FLOATS -> kFLOAT32
    of that length, same values (empty FLOATS are absent on both sides)."""
    assert set(reported) == set(attrs), f"fields {sorted(set(reported) ^ set(attrs))} differ"
    for name, value in attrs.items():
        field = reported[name]
        if isinstance(value, list):
            assert field["type"] == "kFLOAT32" and field["length"] == len(value), (name, field)
            got = field["value"] if len(value) > 1 else [field["value"]]
            np.testing.assert_array_equal(np.float32(got), np.float32(value), err_msg=name)
            continue
        assert field["length"] == 1, name
        if isinstance(value, float):
            assert field["type"] == "kFLOAT32", name
            assert np.float32(field["value"]) == np.float32(value), (name, field["value"], value)
        else:
            assert field["type"] == "kINT32", name
            assert field["value"] == value, (name, field["value"], value)


# ================================================================================================ loading
def test_library_loads_in_a_plain_python_process(host):
    """ctypes.CDLL without TensorRT: loads, registers nothing, logs nothing, and getCreators still answers."""
    _, lib = host
    code = textwrap.dedent(f"""
        import ctypes
        lib = ctypes.CDLL({lib!r})
        n = ctypes.c_int32(-1)
        lib.getCreators.restype = ctypes.c_void_p
        ptr = lib.getCreators(ctypes.byref(n))
        print(n.value, ptr is not None)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HOST_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["2", "True"]
    assert proc.stderr == ""


def test_creators_identity_and_field_names(host, tmp_path):
    status, report, _ = run_host(host, "info", tmp_path)
    assert status == 0
    creators = {c["name"]: c for c in report["creators"]}
    assert set(creators) == {WRITE_PLUGIN_NAME, ATTENTION_PLUGIN_NAME}
    # configs that carry every attribute (LongRoPE's FLOATS included), for the types
    expected = {WRITE_PLUGIN_NAME: (WriteConfig, write_cfg(rope=LONGROPE).to_attributes()),
                ATTENTION_PLUGIN_NAME: (AttentionConfig, attn_cfg().to_attributes())}
    for name, creator in creators.items():
        assert creator["interface"] == "PLUGIN CREATOR_V3ONE 1.0"
        assert creator["version"] == PLUGIN_VERSION
        assert creator["namespace"] == PLUGIN_NAMESPACE
        fields = {f["name"]: f for f in creator["fields"]}
        config_class, attrs = expected[name]
        assert list(fields) == list(attribute_types(config_class)), "getFieldNames lists config.py's attributes in order"
        assert set(attrs) == set(fields)
        for attr, value in attrs.items():
            assert fields[attr]["type"] == ("kFLOAT32" if isinstance(value, (float, list)) else "kINT32"), attr
    assert report["messages"] == []


# ================================================================================================ exprs
def test_host_expression_builder_follows_tensorrt_semantics(host):
    """The host's own IExprBuilder (what getOutputShapes sees): every DimensionOperation, folded when both
    operands are constants, symbolic otherwise and evaluated later, floor/ceil division toward -inf/+inf."""
    pairs = [(7, 2), (-7, 2), (7, -2), (-7, -2), (6, 3), (0, 5), (3, 3), (2, 5), (5, 0)]
    exe, _ = host
    proc = subprocess.run([exe, "exprs", "--pairs", json.dumps(pairs)], capture_output=True, text=True,
                          timeout=HOST_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    ops = {"+": lambda a, b: a + b, "*": lambda a, b: a * b, "max": max, "min": min, "-": lambda a, b: a - b,
           "==": lambda a, b: int(a == b), "<": lambda a, b: int(a < b),
           "floordiv": lambda a, b: a // b if b else None, "ceildiv": lambda a, b: -(-a // b) if b else None}
    assert len(report["results"]) == len(ops) * len(pairs)
    for r in report["results"]:
        expected = ops[r["op"]](r["a"], r["b"])
        assert r["folded"] == expected, r
        assert r["evaluated"] == expected and not r["symbolic_is_constant"], r
    assert report["bad_op_rejected"]


# ================================================================================================ selfreg
@pytest.fixture(scope="module")
def selfreg_lib():
    lib = _lib.find_file(_lib.SELFREG_NAME)
    if lib is None:
        pytest.fail(f"{_lib.SELFREG_NAME} not found in {[str(d) for d in _lib.lib_dirs()]}")
    return str(lib)


def run_selfreg(host, tmp_path, scenario, library):
    exe, _ = host
    status, report, stderr = run_host((exe, library), "selfreg", tmp_path, extra=["--scenario", scenario])
    assert status == 0, stderr
    if not report["symbol_visible"]:
        pytest.fail("pagedkv_testhost does not export getPluginRegistry, so the libraries cannot find the host's "
                    "registry: see the test host's link options in plugins/CMakeLists.txt")
    assert report["loaded"], report
    return report, stderr


OURS = [{"name": WRITE_PLUGIN_NAME, "version": PLUGIN_VERSION, "namespace": PLUGIN_NAMESPACE},
        {"name": ATTENTION_PLUGIN_NAME, "version": PLUGIN_VERSION, "namespace": PLUGIN_NAMESPACE}]


def test_companion_registers_on_plain_dlopen(host, tmp_path, selfreg_lib):
    """trtexec --staticPlugins / polygraphy --plugins take libpagedkv_plugins_selfreg.so: a dlopen registers both
    creators in the process's registry under namespace 'pagedkv'; unloading it takes them out again."""
    report, stderr = run_selfreg(host, tmp_path, "dlopen", selfreg_lib)
    assert report["entries_after_load"] == OURS
    if report["unloaded"]:
        assert report["entries_after_unload"] == []
    else:  # the loader kept the library mapped: its creators stay valid, so they may stay registered
        assert report["entries_after_unload"] == OURS
    assert stderr == ""


def test_plugin_library_registers_nothing_itself(host, tmp_path):
    """libpagedkv_plugins.so is getCreators-only: a plain dlopen with a registry in the process touches nothing."""
    report, stderr = run_selfreg(host, tmp_path, "dlopen", host[1])
    assert report["entries_after_load"] == [] and report["events"] == []
    assert stderr == ""


def test_load_library_is_the_only_registrar(host, tmp_path):
    """IPluginRegistry::loadLibrary dlopens, calls setLoggerFinder and getCreators and registers each creator: the
    library makes no registry call of its own inside that dlopen (no duplicate, no re-entry)."""
    report, _ = run_selfreg(host, tmp_path, "load_library", host[1])
    assert report["events"] == [f"loadLibrary {host[1]}", f"register {WRITE_PLUGIN_NAME}/1/pagedkv: ok",
                                f"register {ATTENTION_PLUGIN_NAME}/1/pagedkv: ok", "loadLibrary: ok"]
    assert report["entries_after_load"] == OURS


def test_no_registry_in_the_process(host, tmp_path, selfreg_lib):
    """No TensorRT (getPluginRegistry returns null): the companion loads, registers nothing, says nothing."""
    report, stderr = run_selfreg(host, tmp_path, "no_registry", selfreg_lib)
    assert report["entries_after_load"] == [] and report["events"] == []
    assert stderr == ""


def test_companion_skips_names_already_registered(host, tmp_path, selfreg_lib):
    """Another copy of the library already owns PagedKVQKVWrite/1/pagedkv: no duplicate, no error."""
    report, stderr = run_selfreg(host, tmp_path, "preregistered", selfreg_lib)
    names = [(e["name"], e["namespace"]) for e in report["entries_after_load"]]
    assert names == [(WRITE_PLUGIN_NAME, PLUGIN_NAMESPACE), (ATTENTION_PLUGIN_NAME, PLUGIN_NAMESPACE)]
    assert not [e for e in report["events"] if "refused" in e]
    assert stderr == ""


def test_companion_leaves_another_api_alone(host, tmp_path, selfreg_lib):
    """A TensorRT whose API major is not the headers' (TensorRT-RTX 1.x, TensorRT 11): its IPluginRegistry has
    another virtual table, so the companion calls nothing on it and says what to do instead."""
    report, stderr = run_selfreg(host, tmp_path, "api_mismatch", selfreg_lib)
    assert report["entries_after_load"] == [] and report["events"] == []
    assert "registers no creators" in stderr and "API major 1" in stderr and "loadLibrary" in stderr, stderr


@pytest.mark.parametrize("logger", ["finder", "null"])
def test_errors_reach_the_logger_tensorrt_hands_over_and_are_kept(host, tmp_path, logger):
    """A createPlugin error goes to the logger of the finder TensorRT handed over; when the finder answers nullptr
    (TensorRT-RTX 1.7 does, for the parser and the builder) it goes to stderr. Either way the library keeps it for
    the application (pagedkv_plugin_messages, which pagedkv's builder reads)."""
    spec = {"plugin": ATTENTION_PLUGIN_NAME, "attrs": dict(attn_cfg().to_attributes(), head_dim=72), "logger": logger}
    status, report, stderr = run_host(host, "create", tmp_path, spec)
    assert status == 1 and not report["created"]
    text = f"[pagedkv] {ATTENTION_PLUGIN_NAME}::createPlugin: layer 'layer0' (build phase): field 'head_dim'=72"
    if logger == "finder":
        assert any(text in m for m in errors(report["messages"])) and stderr == ""
    else:
        assert report["messages"] == [] and text in stderr
    assert report["kept_messages"].startswith("ERROR: " + text), report["kept_messages"]


# ================================================================================================ check
@dataclasses.dataclass(frozen=True)
class WriteCase:
    id: str
    cfg: WriteConfig
    io: str = "kHALF"

    def expected_types(self):
        types = [[self.io], ["kINT64"], ["kINT32"], ["kINT32"], ["kINT32"]]
        if self.cfg.explicit_positions:
            types.append(["kINT32"])
        if self.cfg.has_bias:
            types.append([self.io])
        types[0] = ["kHALF", "kBF16"]
        return types + [["kFP8"] if self.cfg.q_out_fp8 else [self.io], ["kINT32"]]


WRITE_CASES = [
    WriteCase("fp16-d64-gqa2", write_cfg()),
    WriteCase("bf16-d128-mha-bias", write_cfg(num_q_heads=4, pool_kw=dict(num_kv_heads=4, head_dim=128),
                                              has_bias=True), io="kBF16"),
    WriteCase("fp16-d256-positions", write_cfg(num_q_heads=8, pool_kw=dict(num_kv_heads=1, head_dim=256),
                                               explicit_positions=True)),
    WriteCase("bf16-positions-bias-fp8q-int8cache",
              write_cfg(pool_kw=dict(cache_dtype=CacheDType.INT8, k_scale=0.02, v_scale=0.03, pool_index=1),
                        explicit_positions=True, has_bias=True, q_out_fp8=True, q_scale=0.5), io="kBF16"),
    WriteCase("fp16-gptj-llama3-nhd-cyclic",
              write_cfg(pool_kw=dict(page_layout=PageLayout.NHD, ring_sink_tokens=4, cyclic_len=64, page_size=32),
                        rope=RopeConfig(style=RopeStyle.GPTJ, rotary_dim=32, theta=500000.0,
                                        scaling=RopeScaling.LLAMA3, factor=8.0))),
    WriteCase("fp16-norope-odd-page", write_cfg(pool_kw=dict(page_size=13, cache_dtype=CacheDType.FP8_E4M3),
                                                rope=RopeConfig(style=RopeStyle.NONE), zero_v_tail=False)),
    WriteCase("bf16-yarn-untruncated", write_cfg(rope=YARN, has_bias=True), io="kBF16"),
    WriteCase("fp16-longrope-positions", write_cfg(rope=LONGROPE, explicit_positions=True)),
    WriteCase("fp16-longrope-partial-default-factor",
              write_cfg(pool_kw=dict(head_dim=128), rope=RopeConfig(
                  scaling=RopeScaling.LONGROPE, rotary_dim=96, original_max_positions=4096, factor=32.0,
                  short_factors=(1.0,) * 48, long_factors=tuple(1.0 + i for i in range(48))))),
]


def assert_clean_check(report, n_inputs, n_outputs):
    for key in ("create_messages", "output_types_messages", "output_shapes_messages", "configure_messages",
                "runtime_messages", "on_shape_change_messages"):
        assert report[key] == [], (key, report[key])
    assert report["created"] and report["runtime_created"]
    assert report["capabilities"] == {"core": "PLUGIN_V3ONE_CORE 1.0", "build": "PLUGIN_V3ONE_BUILD 1.0",
                                      "runtime": "PLUGIN_V3ONE_RUNTIME 1.0"}
    assert report["runtime_capabilities"]["core"] == "PLUGIN_V3ONE_CORE 1.0"
    assert report["runtime_capabilities"]["runtime"] == "PLUGIN_V3ONE_RUNTIME 1.0"
    assert report["nb_outputs"] == n_outputs
    assert report["output_types_rc"] == 0 and report["output_shapes_rc"] == 0
    assert report["configure_rc"] == 0 and report["on_shape_change_rc"] == 0
    assert report["formats"]["combination_supported"] == [True] * (n_inputs + n_outputs)
    assert report["formats"]["non_linear_accepted"] == [False] * (n_inputs + n_outputs)
    assert report["runtime_fields_equal"] and report["clone_ok"] and report["clone_fields_equal"]
    assert report["attach_ok"] and report["attach_fields_equal"]


@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: c.id)
def test_write_plugin_build_and_runtime_interface(host, tmp_path, case):
    inputs = write_inputs(case.cfg, case.io)
    status, report, _ = run_host(host, "check", tmp_path, spec_for(WRITE_PLUGIN_NAME, case.cfg, inputs))
    assert status == 0
    assert_clean_check(report, len(inputs), 2)
    assert report["identity"] == {"name": WRITE_PLUGIN_NAME, "version": PLUGIN_VERSION,
                                  "namespace": PLUGIN_NAMESPACE}
    q_type = "kFP8" if case.cfg.q_out_fp8 else case.io
    assert report["output_types"] == [q_type, "kINT32"]
    h, d = case.cfg.num_q_heads, case.cfg.pool.head_dim
    q_shape, status_shape = report["output_shapes"]
    assert q_shape["exprs"] == ["T", str(h * d)] and q_shape["constant"] == [False, True]
    assert q_shape["values"] == [BINDINGS["T"], h * d]
    assert status_shape["exprs"] == [str(STATUS_FIELDS)]
    assert q_shape["owned_by_builder"] and status_shape["owned_by_builder"]
    assert report["formats"]["supported_types"] == case.expected_types()
    assert report["workspace_bytes"] == 0
    assert_fields_equal(report["serialized_fields"], case.cfg.to_attributes())


ATTENTION_CASES = [
    ("fp16-d64", attn_cfg(), "kHALF"),
    ("bf16-d128-window-sinks-softcap", attn_cfg(num_q_heads=8, pool_kw=dict(head_dim=128), window=128,
                                               attention_sinks=4, logit_softcap=30.0, softmax_scale=0.1), "kBF16"),
    ("fp8q-fp8cache-d256-bf16out", attn_cfg(pool_kw=dict(head_dim=256, cache_dtype=CacheDType.FP8_E4M3,
                                                         k_scale=0.5), q_fp8=True, q_scale=0.25, out_dtype=1), "kFP8"),
    ("fp8q-int8cache-fp16out", attn_cfg(pool_kw=dict(cache_dtype=CacheDType.INT8, k_scale=0.5), q_fp8=True,
                                        out_dtype=0), "kFP8"),
    ("bf16-out-dtype-named", attn_cfg(out_dtype=1), "kBF16"),
]
OUT_TYPES = {-1: None, 0: "kHALF", 1: "kBF16"}


@pytest.mark.parametrize("name,cfg,q_type", ATTENTION_CASES, ids=[c[0] for c in ATTENTION_CASES])
def test_attention_plugin_build_and_runtime_interface(host, tmp_path, name, cfg, q_type):
    inputs = attention_inputs(cfg, q_type)
    status, report, _ = run_host(host, "check", tmp_path, spec_for(ATTENTION_PLUGIN_NAME, cfg, inputs))
    assert status == 0
    assert_clean_check(report, len(inputs), 1)
    assert report["identity"]["name"] == ATTENTION_PLUGIN_NAME
    out_type = OUT_TYPES[cfg.out_dtype] or q_type  # out_dtype, else q's type
    assert report["output_types"] == [out_type]
    (out_shape,) = report["output_shapes"]
    h, d = cfg.num_q_heads, cfg.pool.head_dim
    assert out_shape["exprs"] == ["T", str(h * d)] and out_shape["values"] == [BINDINGS["T"], h * d]
    q_types = ["kFP8"] if cfg.q_fp8 else [OUT_TYPES[cfg.out_dtype]] if cfg.out_dtype >= 0 else ["kHALF", "kBF16"]
    assert report["formats"]["supported_types"] == [q_types, ["kINT64"], ["kINT32"], ["kINT32"], ["kINT32"],
                                                    ["kINT32"], [out_type]]
    assert_fields_equal(report["serialized_fields"], cfg.to_attributes())


def profile(t, b, mb):
    return {"T": t, "B": b, "B1": b + 1, "MB": mb, "NP": 1}


def test_attention_workspace_is_sized_by_the_profile_maximum(host, tmp_path):
    """getWorkspaceSize depends on the profile's max (T, B, MB * page_size), not on min/opt."""
    cfg = attn_cfg(pool_kw=dict(page_size=64))
    inputs = attention_inputs(cfg)

    def workspace(min_, opt, max_):
        spec = spec_for(ATTENTION_PLUGIN_NAME, cfg, inputs, bindings=opt,
                        profile={"min": min_, "opt": opt, "max": max_})
        status, report, _ = run_host(host, "check", tmp_path, spec)
        assert status == 0 and report["configure_rc"] == 0 and report["workspace_messages"] == []
        return report["workspace_bytes"]

    long_ctx = workspace(profile(1, 1, 1), profile(4, 4, 16), profile(64, 16, 2048))
    assert long_ctx > 0, "a 131072-position profile must leave room for split-K partials"
    assert workspace(profile(2, 2, 2), profile(8, 2, 64), profile(64, 16, 2048)) == long_ctx
    assert workspace(profile(1, 1, 1), profile(1, 1, 1), profile(64, 16, 4096)) >= long_ctx
    assert workspace(profile(1, 1, 1), profile(1, 1, 1), profile(1, 1, 1)) <= long_ctx


# ================================================================================================ bad shapes
def bad_dims(inputs, name, dims):
    return [dict(t, dims=dims) if t["name"] == name else t for t in inputs]


WRITE_SHAPE_ERRORS = [
    # (id, change(inputs, bindings) -> (inputs, bindings), words the message must contain)
    ("qkv-width", lambda i, b: (bad_dims(i, "qkv", ["T", 500]), b), ["qkv", "500", "expected 512"]),
    ("qkv-rank", lambda i, b: (bad_dims(i, "qkv", ["T", 8, 64]), b), ["qkv", "rank 2"]),
    ("pool-desc-columns", lambda i, b: (bad_dims(i, "kv_pools", ["NP", 3]), b), ["kv_pools", "expected 4"]),
    ("pool-index-past-pools", lambda i, b: (i, dict(b, NP=1)), ["kv_pools", "pool_index", "1 pools"]),
    ("cu-q-lens-not-b-plus-1", lambda i, b: (i, dict(b, B1=3)), ["cu_q_lens", "B = 2", "block_table", "B = 3"]),
    ("past-lens-not-b", lambda i, b: (bad_dims(i, "past_lens", [9]), b), ["past_lens", "B = 9"]),
    ("position-ids-not-t", lambda i, b: (bad_dims(i, "position_ids", [6]), b), ["position_ids", "T = 6"]),
    ("bias-width", lambda i, b: (bad_dims(i, "bias", [511]), b), ["bias", "511", "expected 512"]),
    ("block-table-rank", lambda i, b: (bad_dims(i, "block_table", ["B"]), b), ["block_table", "rank 2"]),
    ("tokens-without-sequences", lambda i, b: (i, dict(b, B=0, B1=1)), ["no sequences", "T = 7"]),
]


@pytest.mark.parametrize("case_id,change,words", WRITE_SHAPE_ERRORS, ids=[c[0] for c in WRITE_SHAPE_ERRORS])
def test_write_plugin_rejects_bad_shapes(host, tmp_path, case_id, change, words):
    cfg = write_cfg(pool_kw=dict(pool_index=1), has_bias=True, explicit_positions=True)
    inputs, bindings = change(write_inputs(cfg), dict(BINDINGS))
    status, report, _ = run_host(host, "check", tmp_path, spec_for(WRITE_PLUGIN_NAME, cfg, inputs, bindings))
    assert status == 0 and report["created"]
    if "on_shape_change_rc" not in report:  # the host stopped before the runtime phase: shapes must have failed
        assert report["output_shapes_rc"] != 0 or report["configure_rc"] != 0, report
        return
    # Build-time dims are wildcards for runtime extents: configurePlugin catches what it can, onShapeChange the rest.
    assert report["on_shape_change_rc"] != 0
    messages = errors(report["configure_messages"]) + errors(report["on_shape_change_messages"])
    assert messages, report
    assert any(all(w in m for w in words) for m in messages), (words, messages)


def test_an_empty_step_is_a_valid_shape(host, tmp_path):
    """T = 0 (nothing scheduled for this engine call) and even B = 0: valid shapes, enqueue does nothing."""
    for bindings in (dict(BINDINGS, T=0), dict(BINDINGS, T=0, B=0, B1=1)):
        for plugin, cfg, inputs in ((WRITE_PLUGIN_NAME, write_cfg(), write_inputs(write_cfg())),
                                    (ATTENTION_PLUGIN_NAME, attn_cfg(), attention_inputs(attn_cfg()))):
            status, report, _ = run_host(host, "check", tmp_path, spec_for(plugin, cfg, inputs, bindings))
            assert status == 0 and report["on_shape_change_rc"] == 0, report["on_shape_change_messages"]


ATTENTION_SHAPE_ERRORS = [
    ("q-width", lambda i, b: (bad_dims(i, "q", ["T", 255]), b), ["q", "255", "expected 256"]),
    ("status-fields", lambda i, b: (bad_dims(i, "kv_write_status", [5]), b), ["kv_write_status", "expected 4"]),
    ("cu-q-lens", lambda i, b: (i, dict(b, B1=7)), ["cu_q_lens", "B = 6"]),
    ("mb-times-page-overflows-int32", lambda i, b: (i, dict(b, MB=2 ** 31 // 16)), ["MB * page_size"]),
]


@pytest.mark.parametrize("case_id,change,words", ATTENTION_SHAPE_ERRORS, ids=[c[0] for c in ATTENTION_SHAPE_ERRORS])
def test_attention_plugin_rejects_bad_shapes(host, tmp_path, case_id, change, words):
    cfg = attn_cfg()
    inputs, bindings = change(attention_inputs(cfg), dict(BINDINGS))
    status, report, _ = run_host(host, "check", tmp_path, spec_for(ATTENTION_PLUGIN_NAME, cfg, inputs, bindings))
    assert status == 0 and report["created"]
    assert report["on_shape_change_rc"] != 0
    messages = errors(report["configure_messages"]) + errors(report["on_shape_change_messages"])
    assert any(all(w in m for w in words) for m in messages), (words, messages)


# ================================================================================================ create
def create(host, tmp_path, plugin, attrs, phase="build", caller="onnx_parser", spec_text=None):
    spec = None if spec_text else {"plugin": plugin, "attrs": attrs, "phase": phase, "caller": caller}
    status, report, stderr = run_host(host, "create", tmp_path, spec, spec_text=spec_text)
    assert status in (0, 1), stderr
    assert (status == 0) == report["created"]
    return report


def assert_rejected(report, *words):
    assert not report["created"], report
    messages = errors(report["messages"])
    assert messages, "a rejected plugin must log why"
    assert any(all(w in m for w in words) for m in messages), (words, messages)


def without(attrs, *names):
    return {k: v for k, v in attrs.items() if k not in names}


BUILD_REJECTIONS = [
    # (id, plugin, attrs, words that name the field and the value)
    ("missing-num_q_heads", WRITE_PLUGIN_NAME, without(write_cfg().to_attributes(), "num_q_heads"),
     ["missing required field", "'num_q_heads'"]),
    ("missing-pool-fields", ATTENTION_PLUGIN_NAME, without(attn_cfg().to_attributes(), "head_dim", "page_size"),
     ["missing required field", "'head_dim'", "'page_size'"]),
    ("head_dim-48", WRITE_PLUGIN_NAME, dict(write_cfg().to_attributes(), head_dim=48),
     ["'head_dim'=48", "one of {32, 64, 80, 96, 128, 256}"]),
    ("head_dim-112", ATTENTION_PLUGIN_NAME, dict(attn_cfg().to_attributes(), head_dim=112),
     ["'head_dim'=112", "one of {32, 64, 80, 96, 128, 256}"]),
    ("heads-not-multiple", ATTENTION_PLUGIN_NAME, dict(attn_cfg().to_attributes(), num_q_heads=5),
     ["'num_q_heads'=5", "multiple of num_kv_heads=2"]),
    ("layer-index-past-layers", WRITE_PLUGIN_NAME, dict(write_cfg().to_attributes(), layer_index=2),
     ["'layer_index'=2", "num_layers=2"]),
    ("cache-dtype-nvfp4-reserved", WRITE_PLUGIN_NAME, dict(write_cfg().to_attributes(), cache_dtype=4),
     ["'cache_dtype'=4", "4 (nvfp4) is reserved"]),
    ("cache-dtype-unknown", ATTENTION_PLUGIN_NAME, dict(attn_cfg().to_attributes(), cache_dtype=9),
     ["'cache_dtype'=9"]),
    ("page-layout-unknown", WRITE_PLUGIN_NAME, dict(write_cfg().to_attributes(), page_layout=2), ["'page_layout'=2"]),
    ("rope-style-unknown", WRITE_PLUGIN_NAME, dict(write_cfg().to_attributes(), rope_style=5), ["'rope_style'=5"]),
    ("rope-scaling-unknown", WRITE_PLUGIN_NAME, dict(write_cfg().to_attributes(), rope_scaling=-1),
     ["'rope_scaling'=-1"]),
    ("rotary-dim-odd", WRITE_PLUGIN_NAME, dict(write_cfg().to_attributes(), rope_rotary_dim=33),
     ["'rope_rotary_dim'=33", "even"]),
    ("rotary-dim-past-head-dim", WRITE_PLUGIN_NAME, dict(write_cfg().to_attributes(), rope_rotary_dim=96),
     ["'rope_rotary_dim'=96", "head_dim=64"]),
    ("rope-theta-zero", WRITE_PLUGIN_NAME, dict(write_cfg().to_attributes(), rope_theta=0.0), ["'rope_theta'=0"]),
    ("llama3-high-not-above-low", WRITE_PLUGIN_NAME,
     dict(write_cfg().to_attributes(), rope_scaling=2, rope_low_freq_factor=4.0, rope_high_freq_factor=4.0),
     ["'rope_high_freq_factor'", "rope_low_freq_factor"]),
    ("k-scale-zero", WRITE_PLUGIN_NAME, dict(write_cfg().to_attributes(), k_scale=0.0), ["'k_scale'=0", "> 0"]),
    ("v-scale-nan", ATTENTION_PLUGIN_NAME, dict(attn_cfg().to_attributes(), v_scale=float("nan")),
     ["'v_scale'=nan"]),
    ("q-scale-negative", WRITE_PLUGIN_NAME, dict(write_cfg().to_attributes(), q_scale=-1.0), ["'q_scale'=-1"]),
    ("flag-not-boolean", WRITE_PLUGIN_NAME, dict(write_cfg().to_attributes(), has_bias=2),
     ["'has_bias'=2", "one of {0, 1}"]),
    ("cyclic-not-whole-pages", WRITE_PLUGIN_NAME, dict(write_cfg().to_attributes(), cyclic_len=40),
     ["'cyclic_len'=40", "page_size=16"]),
    ("ring-sink-tokens-negative", ATTENTION_PLUGIN_NAME, dict(attn_cfg().to_attributes(), ring_sink_tokens=-3),
     ["'ring_sink_tokens'=-3"]),
    ("attention-sinks-negative", ATTENTION_PLUGIN_NAME, dict(attn_cfg().to_attributes(), attention_sinks=-1),
     ["'attention_sinks'=-1"]),
    ("softmax-scale-negative", ATTENTION_PLUGIN_NAME, dict(attn_cfg().to_attributes(), softmax_scale=-0.5),
     ["'softmax_scale'=-0.5"]),
    ("softcap-infinite", ATTENTION_PLUGIN_NAME, dict(attn_cfg().to_attributes(), logit_softcap=float("inf")),
     ["'logit_softcap'=inf"]),
    ("pool-index-negative", WRITE_PLUGIN_NAME, dict(write_cfg().to_attributes(), pool_index=-1),
     ["'pool_index'=-1"]),
    ("page-size-zero", ATTENTION_PLUGIN_NAME, dict(attn_cfg().to_attributes(), page_size=0), ["'page_size'=0"]),
    ("yarn-beta-fast-zero", WRITE_PLUGIN_NAME, dict(write_cfg(rope=YARN).to_attributes(), rope_beta_fast=0.0),
     ["'rope_beta_fast'=0"]),
    ("attention-factor-negative", WRITE_PLUGIN_NAME,
     dict(write_cfg(rope=YARN).to_attributes(), rope_attention_factor=-1.0), ["'rope_attention_factor'=-1"]),
    ("longrope-without-factors", WRITE_PLUGIN_NAME,
     without(write_cfg(rope=LONGROPE).to_attributes(), "rope_short_factors", "rope_long_factors"),
     ["rope_short_factors=0 values", "rope_rotary_dim / 2 = 32"]),
    ("longrope-factor-count", WRITE_PLUGIN_NAME,
     dict(write_cfg(rope=LONGROPE).to_attributes(), rope_short_factors=[1.5] * 31, rope_long_factors=[2.5] * 31),
     ["rope_short_factors=31 values", "rope_rotary_dim / 2 = 32"]),
    ("longrope-lengths-differ", WRITE_PLUGIN_NAME,
     dict(write_cfg(rope=LONGROPE).to_attributes(), rope_long_factors=[2.5] * 31),
     ["'rope_short_factors' (32 values)", "'rope_long_factors' (31 values)", "same length"]),
    ("longrope-factor-zero", WRITE_PLUGIN_NAME,
     dict(write_cfg(rope=LONGROPE).to_attributes(), rope_long_factors=[2.5] * 5 + [0.0] + [2.5] * 26),
     ["'rope_long_factors'[5]=0", "> 0"]),
    ("longrope-too-many-factors", WRITE_PLUGIN_NAME,
     dict(write_cfg(rope=LONGROPE).to_attributes(), rope_short_factors=[1.5] * 129, rope_long_factors=[2.5] * 129),
     ["'rope_short_factors'", "at most 128 values", "length 129"]),
    ("longrope-factors-as-ints", WRITE_PLUGIN_NAME,
     dict(write_cfg(rope=LONGROPE).to_attributes(), rope_short_factors=[1] * 32),
     ["'rope_short_factors'", "expected a float array", "kINT32"]),
    # ONNX type rules: a FLOAT attribute written as INT arrives as kINT32 and the reverse as kFLOAT32.
    ("float-field-as-int", WRITE_PLUGIN_NAME, dict(write_cfg().to_attributes(), rope_theta=10000),
     ["'rope_theta'", "expected a float field", "kINT32"]),
    ("int-field-as-float", ATTENTION_PLUGIN_NAME, dict(attn_cfg().to_attributes(), head_dim=64.0),
     ["'head_dim'", "expected an integer field", "kFLOAT32"]),
]


@pytest.mark.parametrize("case_id,plugin,attrs,words", BUILD_REJECTIONS, ids=[c[0] for c in BUILD_REJECTIONS])
def test_create_rejects_bad_attributes(host, tmp_path, case_id, plugin, attrs, words):
    assert_rejected(create(host, tmp_path, plugin, attrs), *words)


# ---- the capability table (plugins/include/pagedkv/capabilities.h, read through pagedkv.capabilities) --------
def _outside(values, low=1):
    """Values just outside a set: neighbours of each member that are not members, and past both ends."""
    near = {v + d for v in values for d in (-16, -1, 1, 16)} | {low - 1, max(values) * 2}
    return sorted(v for v in near if v not in values)


def test_plugins_accept_exactly_the_head_dims_of_the_capability_table(host, tmp_path):
    head_dims = capabilities().head_dims
    for plugin, make in ((WRITE_PLUGIN_NAME, write_cfg), (ATTENTION_PLUGIN_NAME, attn_cfg)):
        for d in head_dims:
            attrs = make(pool_kw=dict(head_dim=d)).to_attributes()
            assert create(host, tmp_path, plugin, attrs)["created"], (plugin, d)
        for d in _outside(head_dims):
            listed = "one of {" + ", ".join(map(str, head_dims)) + "}"
            assert_rejected(create(host, tmp_path, plugin, dict(make().to_attributes(), head_dim=d)),
                            f"'head_dim'={d}", listed)


def test_plugins_accept_exactly_the_page_sizes_and_cache_dtypes_of_the_capability_table(host, tmp_path):
    caps = capabilities()
    attrs = attn_cfg().to_attributes()
    for page in (caps.min_page_size, 24, caps.max_page_size):
        assert create(host, tmp_path, ATTENTION_PLUGIN_NAME, dict(attrs, page_size=page))["created"], page
    for page in (caps.min_page_size - 1, caps.max_page_size + 1):
        assert_rejected(create(host, tmp_path, ATTENTION_PLUGIN_NAME, dict(attrs, page_size=page)),
                        f"'page_size'={page}", f"[{caps.min_page_size}, {caps.max_page_size}]")
    for cache in CacheDType:
        report = create(host, tmp_path, WRITE_PLUGIN_NAME, dict(write_cfg().to_attributes(), cache_dtype=int(cache)))
        if cache in caps.cache_dtypes:
            assert report["created"], cache
        else:
            assert_rejected(report, f"'cache_dtype'={int(cache)}")
    for heads in (caps.max_heads, caps.max_heads + 1):
        report = create(host, tmp_path, WRITE_PLUGIN_NAME,
                        dict(write_cfg().to_attributes(), num_q_heads=heads, num_kv_heads=1))
        assert report["created"] == (heads <= caps.max_heads), heads
    too_wide = dict(write_cfg(pool_kw=dict(head_dim=max(caps.head_dims))).to_attributes(),
                    rope_rotary_dim=caps.max_rotary_dim + 2)
    assert_rejected(create(host, tmp_path, WRITE_PLUGIN_NAME, too_wide), f"'rope_rotary_dim'={caps.max_rotary_dim + 2}")


def test_defaults_fill_optional_attributes(host, tmp_path):
    """Only the required attributes: the plugin serializes config.py's defaults for everything else."""
    for plugin, cfg in ((WRITE_PLUGIN_NAME, write_cfg()), (ATTENTION_PLUGIN_NAME, attn_cfg())):
        required = {k: v for k, v in cfg.to_attributes().items()
                    if k in ("num_q_heads", "num_kv_heads", "head_dim", "page_size", "num_layers", "layer_index")}
        report = create(host, tmp_path, plugin, required)
        assert report["created"] and report["messages"] == []
        assert_fields_equal(report["fields"], cfg.to_attributes())


# Integral values a user or a model config gives for float fields (Llama 3's rope_theta=500000, factor 8, ...);
# rope_high_freq_factor > rope_low_freq_factor holds with the defaults.
INTEGRAL_FLOATS = {"rope_theta": 500000, "rope_factor": 8, "rope_low_freq_factor": 1, "rope_high_freq_factor": 4,
                   "rope_beta_fast": 32, "rope_beta_slow": 1, "rope_attention_factor": 2, "q_scale": 2, "k_scale": 2,
                   "v_scale": 3, "softmax_scale": 1, "logit_softcap": 30}


def _with_field(plugin: str, name: str, value):
    """A config of ``plugin`` with attribute ``name`` set to ``value`` (rope_* on the RoPE, pool fields on the pool)."""
    cfg = write_cfg() if plugin == WRITE_PLUGIN_NAME else attn_cfg()
    if name.startswith("rope_"):
        return dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, **{name[len("rope_"):]: value}))
    if name in {f.name for f in dataclasses.fields(PoolConfig)}:
        return dataclasses.replace(cfg, pool=dataclasses.replace(cfg.pool, **{name: value}))
    return dataclasses.replace(cfg, **{name: value})


@pytest.mark.parametrize("plugin,cls", [(WRITE_PLUGIN_NAME, WriteConfig), (ATTENTION_PLUGIN_NAME, AttentionConfig)])
def test_every_float_field_is_a_float_attribute_even_for_an_integral_value(host, tmp_path, plugin, cls):
    """config.py emits each attribute by its field's declared type: ``theta=500000`` (an int) is a FLOAT attribute,
    so the parser hands the plugin the kFLOAT32 it expects. As an INT attribute the plugin refuses it, naming the
    field (the bug this guards against)."""
    floats = [name for name, kind in attribute_types(cls).items() if kind == FLOAT]
    assert set(floats) <= set(INTEGRAL_FLOATS), "a new float field needs an integral test value here"
    _, info, _ = run_host(host, "info", tmp_path)
    creator_types = {f["name"]: f["type"] for c in info["creators"] if c["name"] == plugin for f in c["fields"]}
    arrays = {name for name, kind in attribute_types(cls).items() if kind == FLOATS}  # kFLOAT32 of their length
    assert {n for n, t in creator_types.items() if t == "kFLOAT32"} == set(floats) | arrays
    for name in floats:
        attrs = _with_field(plugin, name, INTEGRAL_FLOATS[name]).to_attributes()
        assert type(attrs[name]) is float and attrs[name] == INTEGRAL_FLOATS[name], name
        report = create(host, tmp_path, plugin, attrs)  # json writes 500000.0: an ONNX FLOAT
        assert report["created"] and report["fields_given"][name]["type"] == "kFLOAT32", (name, report["messages"])
        assert_rejected(create(host, tmp_path, plugin, dict(attrs, **{name: INTEGRAL_FLOATS[name]})),
                        f"'{name}'", "expected a float field", "kINT32")


def test_an_integer_field_refuses_a_fractional_value():
    with pytest.raises(ValueError, match="window: an integer attribute, got 64.5"):
        attn_cfg(window=64.5).to_attributes()
    assert attn_cfg(window=64.0).to_attributes()["window"] == 64


def test_onnx_int_attributes_are_truncated_to_int32(host, tmp_path):
    """The ONNX parser casts INT (int64) to kINT32: 2**32 + 4 arrives as 4. The builder must range-check."""
    attrs = dict(write_cfg().to_attributes(), num_q_heads=2 ** 32 + 4)
    report = create(host, tmp_path, WRITE_PLUGIN_NAME, attrs)
    assert report["created"]
    assert report["fields_given"]["num_q_heads"] == {"type": "kINT32", "length": 1, "value": 4}
    assert report["fields"]["num_q_heads"]["value"] == 4


def test_parser_passes_only_listed_fields_and_direct_callers_get_warnings(host, tmp_path):
    attrs = dict(attn_cfg().to_attributes(), plugin_version="1", plugin_namespace="pagedkv", extra_knob=3)
    parsed = create(host, tmp_path, ATTENTION_PLUGIN_NAME, attrs)  # the parser drops unlisted names
    assert parsed["created"] and parsed["messages"] == []
    assert "extra_knob" not in parsed["fields_given"] and "plugin_version" not in parsed["fields_given"]
    direct = create(host, tmp_path, ATTENTION_PLUGIN_NAME, attrs, caller="direct")
    assert direct["fields_given"]["plugin_version"] == {"type": "kCHAR", "length": 2, "value": "1"}
    assert direct["created"]
    assert [m["message"] for m in direct["messages"]] == [
        f"[pagedkv] {ATTENTION_PLUGIN_NAME}: ignoring unknown field 'extra_knob'"]


# ================================================================================================ corrupt
@pytest.fixture(scope="module")
def serialized(host, tmp_path_factory):
    """What getFieldsToSerialize gives for one write and one attention plugin, as raw field specs."""
    tmp = tmp_path_factory.mktemp("serialized")
    out = {}
    for plugin, cfg in ((WRITE_PLUGIN_NAME, write_cfg(has_bias=True, rope=LONGROPE)),
                        (ATTENTION_PLUGIN_NAME, attn_cfg(window=64))):
        report = create(host, tmp, plugin, cfg.to_attributes())
        assert report["created"]
        out[plugin] = {name: {"raw_type": f["type"], "values": f["value"] if f["length"] > 1 else [f["value"]]}
                       for name, f in report["fields"].items()}
    return out


def test_serialized_fields_deserialize(host, tmp_path, serialized):
    for plugin, fields in serialized.items():
        report = create(host, tmp_path, plugin, fields, phase="runtime", caller="direct")
        assert report["created"] and report["messages"] == []


CORRUPTIONS = [
    # (id, plugin, mutate(fields) -> fields, words)
    ("truncated-last-field", WRITE_PLUGIN_NAME, lambda f: dict(list(f.items())[:-1]),
     ["incomplete", "missing field(s) 'v_scale'"]),
    ("truncated-to-half", ATTENTION_PLUGIN_NAME, lambda f: dict(list(f.items())[:len(f) // 2]), ["incomplete"]),
    ("empty", ATTENTION_PLUGIN_NAME, lambda f: {}, ["incomplete", "'num_q_heads'"]),
    ("int-as-float", WRITE_PLUGIN_NAME, lambda f: dict(f, num_kv_heads={"raw_type": "kFLOAT32", "values": [2.0]}),
     ["'num_kv_heads'", "expected an integer field", "kFLOAT32"]),
    ("float-as-int", ATTENTION_PLUGIN_NAME, lambda f: dict(f, k_scale={"raw_type": "kINT32", "values": [1]}),
     ["'k_scale'", "expected a float field", "kINT32"]),
    ("blob-instead-of-int", WRITE_PLUGIN_NAME,
     lambda f: dict(f, head_dim={"raw_type": "kUNKNOWN", "values": [0x13, 0x37, 0, 1, 2, 3, 4, 5]}),
     ["'head_dim'", "kUNKNOWN"]),
    ("string-instead-of-int", ATTENTION_PLUGIN_NAME, lambda f: dict(f, window={"raw_type": "kCHAR", "values": "64"}),
     ["'window'", "kCHAR"]),
    ("length-zero", WRITE_PLUGIN_NAME, lambda f: dict(f, page_size={"raw_type": "kINT32", "values": [], "length": 0}),
     ["'page_size'", "length 0"]),
    ("length-two", ATTENTION_PLUGIN_NAME,
     lambda f: dict(f, num_layers={"raw_type": "kINT32", "values": [2, 2]}), ["'num_layers'", "length 2"]),
    ("length-claims-more", WRITE_PLUGIN_NAME,
     lambda f: dict(f, q_scale={"raw_type": "kFLOAT32", "values": [1.0], "length": 1000}),
     ["'q_scale'", "length 1000"]),
    ("negative-length", WRITE_PLUGIN_NAME,
     lambda f: dict(f, layer_index={"raw_type": "kINT32", "values": [1], "length": -5}), ["'layer_index'", "-5"]),
    ("null-data", ATTENTION_PLUGIN_NAME,
     lambda f: dict(f, head_dim={"raw_type": "kINT32", "values": [64], "null_data": True}), ["'head_dim'", "null"]),
    ("out-of-range-head-dim", WRITE_PLUGIN_NAME, lambda f: dict(f, head_dim={"raw_type": "kINT32", "values": [48]}),
     ["'head_dim'=48"]),
    ("unknown-cache-dtype", ATTENTION_PLUGIN_NAME,
     lambda f: dict(f, cache_dtype={"raw_type": "kINT32", "values": [7]}), ["'cache_dtype'=7"]),
    ("unknown-rope-style", WRITE_PLUGIN_NAME, lambda f: dict(f, rope_style={"raw_type": "kINT32", "values": [9]}),
     ["'rope_style'=9"]),
    ("int64-out-of-int32", WRITE_PLUGIN_NAME,
     lambda f: dict(f, num_q_heads={"raw_type": "kINT64", "values": [2 ** 40]}), ["'num_q_heads'", "int32"]),
    ("scale-nan", ATTENTION_PLUGIN_NAME, lambda f: dict(f, q_scale={"raw_type": "kFLOAT32", "values": [math.nan]}),
     ["'q_scale'=nan"]),
    ("float64-overflows-float32", WRITE_PLUGIN_NAME,
     lambda f: dict(f, rope_theta={"raw_type": "kFLOAT64", "values": [1e300]}), ["'rope_theta'", "overflows"]),
    ("factors-claim-more", WRITE_PLUGIN_NAME,
     lambda f: dict(f, rope_short_factors={"raw_type": "kFLOAT32", "values": [1.0], "length": 1000}),
     ["'rope_short_factors'", "at most 128 values", "length 1000"]),
    ("factors-null-data", WRITE_PLUGIN_NAME,
     lambda f: dict(f, rope_long_factors={"raw_type": "kFLOAT32", "values": [2.0] * 32, "null_data": True}),
     ["'rope_long_factors'", "null"]),
    ("factors-nan", WRITE_PLUGIN_NAME,
     lambda f: dict(f, rope_short_factors={"raw_type": "kFLOAT32", "values": [1.0] * 31 + [math.nan]}),
     ["'rope_short_factors'[31]=nan"]),
    # positive as a double, 0 as the float32 the plugin computes with: refused, not zero after a round trip
    ("float64-underflows-to-zero", ATTENTION_PLUGIN_NAME,
     lambda f: dict(f, k_scale={"raw_type": "kFLOAT64", "values": [1e-46]}), ["'k_scale'=0", "> 0"]),
    ("inconsistent-heads", ATTENTION_PLUGIN_NAME,
     lambda f: dict(f, num_kv_heads={"raw_type": "kINT32", "values": [3]}), ["'num_q_heads'=4", "num_kv_heads=3"]),
]


@pytest.mark.parametrize("case_id,plugin,mutate,words", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_corrupt_serialized_fields_fail_with_a_message(host, tmp_path, serialized, case_id, plugin, mutate, words):
    fields = mutate(dict(serialized[plugin]))
    report = create(host, tmp_path, plugin, fields, phase="runtime", caller="direct")
    assert_rejected(report, *words)


def test_a_garbage_field_name_is_escaped_in_the_warning(host, tmp_path, serialized):
    """A name from corrupt data can hold any bytes: the warning shows them escaped and cut, never raw."""
    fields = dict(serialized[WRITE_PLUGIN_NAME], **{"\u00ff\u0001" + "x" * 100: {"raw_type": "kINT32", "values": [1]}})
    report = create(host, tmp_path, WRITE_PLUGIN_NAME, fields, phase="runtime", caller="direct")
    assert report["created"]
    (warning,) = [m["message"] for m in report["messages"]]
    assert warning.endswith("ignoring unknown field '\\xc3\\xbf\\x01" + "x" * 61 + "...'"), warning


def test_duplicate_field_is_rejected(host, tmp_path, serialized):
    fields = serialized[WRITE_PLUGIN_NAME]
    body = ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in fields.items())
    text = ('{"plugin": "%s", "phase": "runtime", "caller": "direct", "attrs": {%s, "head_dim": '
            '{"raw_type": "kINT32", "values": [128]}}}' % (WRITE_PLUGIN_NAME, body))
    report = create(host, tmp_path, WRITE_PLUGIN_NAME, None, spec_text=text)
    assert_rejected(report, "'head_dim' given twice")


def test_build_phase_values_also_checked_at_run_time(host, tmp_path, serialized):
    """A runtime-phase blob goes through the same validation as build-time attributes (one parser)."""
    fields = dict(serialized[ATTENTION_PLUGIN_NAME], layer_index={"raw_type": "kINT32", "values": [5]})
    assert_rejected(create(host, tmp_path, ATTENTION_PLUGIN_NAME, fields, phase="runtime", caller="direct"),
                    "'layer_index'=5", "num_layers=2")


# ================================================================================================ docs
REQUIRED = ("num_q_heads", "num_kv_heads", "head_dim", "page_size", "num_layers", "layer_index")


def readme_attribute_table(folder: str) -> dict[str, list[str]]:
    """The attribute table of plugins/plugins/<folder>/README.md: {name: [ONNX, field, default, range, meaning]}
    (the plugin's "## Attributes" section, or the whole file for the shared table in common/)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "plugins" / "plugins" / folder / "README.md").read_text()
    if "\n## Attributes\n" in text:
        text = text.split("\n## Attributes\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_docs_attribute_tables_match_the_plugins(host, tmp_path):
    """The plugins' README attribute tables cannot drift: names, ONNX/field types and defaults against config.py
    and against what the creators report."""
    shared = readme_attribute_table("common")
    own = {WRITE_PLUGIN_NAME: readme_attribute_table("qkvWritePlugin"),
           ATTENTION_PLUGIN_NAME: readme_attribute_table("attentionPlugin")}
    _, info, _ = run_host(host, "info", tmp_path)
    fields = {c["name"]: {f["name"]: f["type"] for f in c["fields"]} for c in info["creators"]}
    for plugin, cfg, full in ((WRITE_PLUGIN_NAME, write_cfg(), write_cfg(rope=LONGROPE)),
                              (ATTENTION_PLUGIN_NAME, attn_cfg(), attn_cfg())):
        assert not set(shared) & set(own[plugin]), "an attribute is in two tables"
        rows = {**shared, **own[plugin]}
        defaults, types = cfg.to_attributes(), full.to_attributes()  # defaults (empty FLOATS absent); every type
        assert set(rows) == set(attribute_types(type(cfg))) == set(types), sorted(set(rows) ^ set(types))
        for name, (onnx, field, default, *_rest) in rows.items():
            kind = "FLOATS" if isinstance(types[name], list) else "FLOAT" if isinstance(types[name], float) else "INT"
            assert onnx == kind, name
            assert field == fields[plugin][name], name
            if name in REQUIRED:
                assert default == "required", name
            elif kind == "FLOATS":
                assert default == "empty" and name not in defaults, (name, default)
            else:
                assert float(default) == defaults[name], (name, default, defaults[name])
    # The tables state today's capability sets and name the table they come from.
    caps = capabilities()
    assert "kSupportedHeadDims" in shared["head_dim"][3]
    assert ", ".join(map(str, caps.head_dims)) in shared["head_dim"][3]
    assert f"[{caps.min_page_size}, {caps.max_page_size}]" in shared["page_size"][3]
