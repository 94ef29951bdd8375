"""Real engine builds on this CPU machine (TensorRT-RTX) and ``pagedkv inspect`` on them.

The matrix: every tiny Hugging Face family x {fp16, bf16} activations x {fp16, fp8, int8} cache: export (float32),
``rewrite --dtype`` (explicit K/V scales for the quantized caches), ``pagedkv build`` with TensorRT-RTX's default
targets, then ``inspect``: the engine record, the TensorRT-RTX header and the plugins' own field records agree,
the engine's I/O holds the engine-I/O contract (with the sampling head, float32, and ``logits_rows``: the rewrite's
default), the logits have the activations' dtype and every plugin layer's
fields are those of the rewritten graph's nodes. Beyond it: the header's target bits re-measured one target at a
time, a static ``--max-blocks``, failures that leave nothing behind and name the plugin's reason,
a tampered engine, the CLI, and the TensorRT-RTX facts the plugin libraries rely on (load_library registers, the
self-registering companion stands back, errors are kept).

``trt_builder``: skipped without TensorRT-RTX (or TensorRT on a GPU), naming why. The builds use small limits:
each takes about half a second.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import onnx
import pytest
from conftest import hf_export

from pagedkv import _lib, engine_io, trt_library
from pagedkv.builder import engine_record
from pagedkv.builder.build import BuildLimits, BuildOptions, build, build_engine, preflight
from pagedkv.builder.inspect_engine import inspect_engine
from pagedkv.builder.rewrite import RewriteOptions, rewrite_model
from pagedkv.cli import main
from pagedkv.onnx_export import hf
from pagedkv.onnx_export._hf_families import FAMILIES
from pagedkv.onnx_export.synthetic import SyntheticConfig, export_synthetic
from pagedkv.runtime.graph import RewrittenGraph, node_attributes
from pagedkv.userio import UsageError

pytestmark = pytest.mark.trt_builder

LIMITS = BuildLimits(max_batch=4, max_tokens=64, max_context=256)
SCALES = {"fp16": {}, "fp8": {"k_scale": 0.05, "v_scale": 0.04}, "int8": {"k_scale": 0.02, "v_scale": 0.03}}
DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
NO_EXPORT = hf.why_export_unavailable()
BASE = SyntheticConfig(num_layers=2, hidden=64, vocab=128, intermediate=128)


def rewritten(source, path, dtype="fp16", cache="fp16", **options):
    onnx.save(rewrite_model(str(source), RewriteOptions(dtype=dtype, cache_dtype=cache, **SCALES[cache],
                                                        **options)).model, str(path))
    return path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    d = tmp_path_factory.mktemp("synthetic")
    return export_synthetic(BASE, d / "orig.onnx")


@pytest.fixture(scope="module")
def fp16_graph(synthetic, tmp_path_factory):
    return rewritten(synthetic, tmp_path_factory.mktemp("fp16") / "paged.onnx")


def recorded_plugin_fields(path) -> dict[str, tuple[str, dict]]:
    """node name -> (plugin, fields) of a rewritten graph: what every engine plugin layer must hold."""
    model = onnx.load(str(path))
    out = {}
    for node in model.graph.node:
        if node.op_type in ("PagedKVQKVWrite", "PagedKVAttention"):
            attrs = {k: v for k, v in node_attributes(node).items() if k not in ("plugin_namespace", "plugin_version")}
            out[node.name] = (node.op_type, attrs)
    return out


# ---- the matrix ------------------------------------------------------------------------------------------------
@pytest.mark.skipif(NO_EXPORT is not None, reason=f"export extra missing: {NO_EXPORT}")
@pytest.mark.parametrize("cache", list(SCALES))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_dtype_and_cache_builds_and_inspects(family, dtype, cache, tmp_path, tmp_path_factory):
    exported = hf_export(family, "legacy", tmp_path_factory)
    graph = rewritten(exported.path, tmp_path / "paged.onnx", dtype, cache)
    result = build_engine(graph, tmp_path / "model.engine", limits=LIMITS)
    assert result.flavour == "tensorrt_rtx" and result.engine.stat().st_size == result.engine_bytes > 0
    report = inspect_engine(result.engine)
    assert report.ok, report.contract + report.problems
    assert report.built_with["flavour"] == "tensorrt_rtx" and report.built_with["version"] == result.version
    assert report.header["decoded"] and report.header["plan_bytes"] == report.bytes
    assert sorted(report.header["targets"]) == sorted(result.targets) == sorted(report.targets["compute_capabilities"])
    io = {t["name"]: t for t in report.io}
    assert io["logits"]["dtype"] == DTYPES[dtype]
    # the graph as the rewrite emits it by default: rows gathered at logits_rows, the float32 sampling head on top
    assert {engine_io.LOGITS_ROWS, *engine_io.SAMPLING_INPUTS, *engine_io.SAMPLING_OUTPUTS} <= set(io)
    assert {io[n]["dtype"] for n in (engine_io.SAMPLING_PARAMS, engine_io.PENALTY_COUNTS, engine_io.NEXT_LOGPROBS,
                                     engine_io.TOP_LOGPROBS)} == {"float32"}
    expected = recorded_plugin_fields(graph)
    assert {p["layer"]: (p["plugin"], p["fields"]) for p in report.plugins} == expected
    assert all(p["in_plan"] for p in report.plugins), "every plugin layer's fields are in the plan's own records"
    assert {p["fields"]["cache_dtype"] for p in report.plugins} == {RewrittenGraph.load(str(graph)).groups[0]
                                                                   .cache_dtype.value}


# ---- what the engine says about itself ---------------------------------------------------------------------------
def test_header_target_bits_are_remeasured_one_target_at_a_time(fp16_graph, tmp_path):
    """The header layout inspect decodes (engine_record.RTX_TARGET_BITS) holds for this TensorRT-RTX: a build for
    one target sets exactly that target's bit."""
    from pagedkv.builder.build import _runnable_targets

    runnable = sorted(_runnable_targets())
    assert runnable, "the plugin library runs on no TensorRT-RTX target"
    for cc in runnable:
        result = build_engine(fp16_graph, tmp_path / f"sm{cc}.engine", limits=LIMITS,
                              options=BuildOptions(compute_capabilities=(cc,)))
        header = engine_record.read_rtx_header(result.engine.read_bytes())
        assert header.targets == (f"SM{cc}",) and header.unnamed_target_bits == (), (cc, header)
        assert header.version == result.version


def test_build_record_survives_many_layers_and_chunks():
    """The record splits over the plugin layers' metadata, each string within TensorRT's 4096 bytes, and reads back
    whole; a missing chunk is reported, not guessed."""
    layers = [{"layer": f"/l{i}", "plugin": "PagedKVAttention", "fields": {"num_q_heads": i}} for i in range(6)]
    record = {"io": [[f"kv_write_status_{i}", "output", "int32", [4]] for i in range(300)], "note": 'q"uote\\'}
    texts = engine_record.layer_metadata(layers, record)
    assert all(len(t) <= engine_record.MAX_LAYER_METADATA for t in texts)
    blob = b"\x1e".join(t.encode() for t in texts)
    found = engine_record.read_record(b"junk" + blob + b"\x00more")
    assert found.record == record and [e["layer"] for e in found.layers] == [e["layer"] for e in layers]
    partial = engine_record.read_record(b"\x1e".join(t.encode() for t in texts[1:]))
    assert partial.record is None and "not all of them" in partial.problems[0]
    with pytest.raises(ValueError, match="does not fit"):
        engine_record.layer_metadata(layers[:1], {"io": ["x" * 100] * 200})


# ---- limits ------------------------------------------------------------------------------------------------------
def test_static_max_blocks_is_honoured(synthetic, tmp_path):
    graph = rewritten(synthetic, tmp_path / "static.onnx", max_blocks=8)
    plan = preflight(graph, tmp_path / "m.engine", BuildLimits(max_batch=2, max_tokens=16, max_context=128))
    assert plan.shapes["block_table_0"] == ((1, 8), (2, 8), (2, 8))  # width 8 fixed; 128 tokens = 8 pages of 16
    with pytest.raises(UsageError, match=r"max-context=200: a sequence needs up to 13 pages, but the graph's block "
                                         r"tables are static with max_blocks=8"):
        preflight(graph, tmp_path / "m.engine", BuildLimits(max_batch=2, max_tokens=16, max_context=200))
    result = build(plan)
    report = inspect_engine(result.engine)
    assert report.ok and report.profile["block_table_0"] == [[1, 8], [2, 8], [2, 8]]
    assert next(t for t in report.io if t["name"] == "block_table_0")["shape"] == [-1, 8]


# ---- outputs -----------------------------------------------------------------------------------------------------
def test_timing_cache_is_refused_where_it_would_do_nothing(fp16_graph, tmp_path):
    """TensorRT-RTX's timing cache calls are no-ops (its own deprecation warning says so): asking for one is a
    usage error rather than a file that means nothing. (TensorRT's path: tests/test_build_trt.py, GPU.)"""
    with pytest.raises(UsageError, match="timing-cache: TensorRT-RTX's timing cache operations are no-ops"):
        preflight(fp16_graph, tmp_path / "m.engine", LIMITS, BuildOptions(timing_cache=tmp_path / "t.cache"))


def test_a_failed_build_leaves_nothing_and_names_the_plugins_reason(fp16_graph, tmp_path):
    """The graph passes the pre-flight, then the file the builder parses has a field the plugin refuses: the error
    line carries the plugin's own reason (kept by the library: TensorRT-RTX's logger finder answers nothing), and
    no engine or staging folder is left."""
    plan = preflight(fp16_graph, tmp_path / "out" / "m.engine", LIMITS)
    model = onnx.load(str(fp16_graph))
    for node in model.graph.node:
        if node.op_type == "PagedKVAttention":
            next(a for a in node.attribute if a.name == "head_dim").i = 72  # no kernel for D=72
    plan.source = tmp_path / "broken.onnx"
    onnx.save(model, str(plan.source))
    with pytest.raises(RuntimeError, match=r"ONNX parser refused .*field 'head_dim'=72: expected one of"):
        build(plan)
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("args,words", [
    (["--max-batch", "0"], "max-batch: expected >= 1, got 0"),
    (["--max-context", str(2 ** 31)], "max-context: expected at most 2147483647"),
    (["--timing-cache", "t.cache"], "timing-cache: TensorRT-RTX's timing cache operations are no-ops"),
    (["--max-batch", "9", "--max-tokens", "8"], "max-batch=9 exceeds max-tokens=8"),
    (["--opt-context", "9999"], "opt-context: expected a value in [1, 4096], got 9999"),
    (["--compute-capability", "90"], "compute-capability 90: not a TensorRT-RTX target"),
    (["--compute-capability", "8x"], "compute-capability[0]: expected an integer"),
    (["--serialize-plugins"], "serialize-plugins: TensorRT-RTX engines do not embed plugin libraries"),
    (["--plugins", "/nonexistent/lib.so"], "plugins: '/nonexistent/lib.so' not found"),
    (["--builder", "tensorrt"], "builder tensorrt:"),
])
def test_cli_refuses_bad_limits_and_options_in_one_line(fp16_graph, tmp_path, capsys, args, words):
    if args[:2] == ["--builder", "tensorrt"] and trt_library.why_unavailable(trt_library.TENSORRT) is None:
        pytest.skip("TensorRT is installed: --builder tensorrt is not refused here")
    out = tmp_path / "m.engine"
    assert main(["build", str(fp16_graph), "-o", str(out), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()


def test_float32_and_non_rewritten_graphs_are_refused_before_tensorrt(synthetic, tmp_path):
    """In a fresh process: the pre-flight refusals come before TensorRT(-RTX) is even imported."""
    float32 = tmp_path / "float32.onnx"
    onnx.save(rewrite_model(str(synthetic)).model, str(float32))
    code = textwrap.dedent(f"""
        import sys
        from pagedkv.builder.build import preflight
        from pagedkv.userio import UsageError
        for source in ({str(float32)!r}, {str(synthetic)!r}, {str(tmp_path / "none.onnx")!r}):
            try:
                preflight(source, {str(tmp_path / "m.engine")!r})
            except UsageError as e:
                print(e)
        print(sorted(m for m in ("tensorrt", "tensorrt_rtx") if m in sys.modules))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stderr
    assert "plugin activations are float32; the plugins take float16 or bfloat16" in lines[0]
    assert "is not a rewritten graph" in lines[1] and "does not exist" in lines[2]
    assert lines[3] == "[]", "TensorRT was imported before the pre-flight refused"


def test_build_phases_reach_the_progress_bars(fp16_graph, tmp_path, monkeypatch):
    """TensorRT's IProgressMonitor phases become userio.progress bars (shown on a terminal, not with --quiet)."""
    import pagedkv.userio

    phases, original = [], pagedkv.userio.progress
    monkeypatch.setattr(pagedkv.userio, "progress", lambda *a, **k: phases.append(k["desc"]) or original(*a, **k))
    build_engine(fp16_graph, tmp_path / "m.engine", limits=LIMITS)
    assert phases and phases[0] == "Building engine", phases


# ---- the CLI and a tampered engine --------------------------------------------------------------------------------
def test_cli_build_then_inspect(fp16_graph, tmp_path, capsys):
    engine = tmp_path / "m.engine"
    assert main(["build", str(fp16_graph), "-o", str(engine), "--max-batch", "4", "--max-tokens", "64",
                 "--max-context", "256"]) == 0
    out = capsys.readouterr().out
    assert "with TensorRT-RTX" in out and "equivalent command line" in out
    assert f"tensorrt_rtx --onnx={fp16_graph} --saveEngine={engine} --dynamicPlugins=" in out
    assert "--maxShapes=input_ids:1x64,kv_pools:1x4,cu_q_lens:5,past_lens:4,block_table_0:4x16" in out
    assert main(["inspect", str(engine), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["io_source"] == "engine record" and len(report["plugins"]) == 4
    assert main(["inspect", str(engine)]) == 0
    text = capsys.readouterr().out
    assert "engine I/O contract: holds" in text and "[engine header (TensorRT-RTX 1.7 layout, measured)]" in text


def test_inspect_finds_a_tampered_engine(fp16_graph, tmp_path, capsys):
    engine = build_engine(fp16_graph, tmp_path / "m.engine", limits=LIMITS).engine
    data = engine.read_bytes()
    truncated = tmp_path / "truncated.engine"
    truncated.write_bytes(data[:-1000])
    report = inspect_engine(truncated)
    assert not report.ok and any("truncated or extended" in p for p in report.problems)
    # a plugin's serialized page_size changed in the plan: its record no longer matches what was built
    field = b"\x0a\x00\x00\x00page_size\x00\x05\x00\x00\x00\x01\x00\x00\x00"
    at = data.find(field)
    assert at > 0
    bad = bytearray(data)
    bad[at + len(field):at + len(field) + 4] = (32).to_bytes(4, "little")
    tampered = tmp_path / "tampered.engine"
    tampered.write_bytes(bytes(bad))
    report = inspect_engine(tampered)
    assert not report.ok and report.unrecorded_plugin_records, report.problems
    assert main(["inspect", str(tampered)]) == 1
    assert "problem:" in capsys.readouterr().out
    assert main(["inspect", str(fp16_graph)]) == 2
    assert "is not a pagedkv engine" in capsys.readouterr().err


# ---- TensorRT-RTX and the plugin libraries ------------------------------------------------------------------------
def test_tensorrt_rtx_and_the_two_plugin_libraries():
    """In a process with TensorRT-RTX: the self-registering companion registers nothing (RTX's IPluginRegistry is
    not TensorRT 10's) and says so on stderr without crashing; load_library registers both creators; a createPlugin
    error from the parser is kept by the library (pagedkv_plugin_messages) and shown on stderr."""
    if trt_library.why_unavailable(trt_library.TENSORRT_RTX):
        pytest.skip(trt_library.why_unavailable(trt_library.TENSORRT_RTX))
    code = textwrap.dedent(f"""
        import ctypes
        from pagedkv import trt_library
        trt = trt_library.import_flavour(trt_library.TENSORRT_RTX)
        builder = trt.Builder(trt.Logger(trt.Logger.ERROR))
        registry = trt.get_plugin_registry()
        ctypes.CDLL({str(_lib.selfreg_library_path())!r})
        ours = lambda: sorted(c.name for c in registry.all_creators if c.plugin_namespace == "pagedkv")
        print(ours())
        trt_library.load_plugin_library(trt)
        print(ours())
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["[]", "['PagedKVAttention', 'PagedKVQKVWrite']"]
    assert "libpagedkv_plugins_selfreg.so registers no creators with libtensorrt_rtx.so.1" in run.stderr
    assert "API major 1" in run.stderr


def test_the_unversioned_rtx_library_is_made_or_asked_for(tmp_path, monkeypatch):
    (tmp_path / trt_library.RTX_SONAME).write_bytes(b"not really a library")
    monkeypatch.setattr(trt_library, "rtx_library_dir", lambda: tmp_path)
    trt_library.ensure_rtx_unversioned_library()
    link = tmp_path / trt_library.RTX_UNVERSIONED
    assert link.is_symlink() and link.resolve() == (tmp_path / trt_library.RTX_SONAME).resolve()
    link.unlink()
    monkeypatch.setattr(trt_library.os, "access", lambda path, mode: False)  # a read-only site-packages
    with pytest.raises(trt_library.TensorRTUnavailable, match=rf"ln -s {trt_library.RTX_SONAME} {link}"):
        trt_library.ensure_rtx_unversioned_library()
    assert not link.exists()
