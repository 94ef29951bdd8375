"""samples/cpp/generate.cpp (``pagedkv_generate``) on a machine without TensorRT or a GPU: --help, and one clear line
with exit status 1 for a missing engine, a wrong plugin library, bad prompts and no TensorRT (2 for bad
arguments). The TensorRT path itself needs a GPU and TensorRT (docs/deploy-cpp.md)."""

from __future__ import annotations

import ctypes
import json
import re
import subprocess
from pathlib import Path

import onnx
import pytest

from conftest import built_file
from pagedkv import _lib
from pagedkv.builder.rewrite import RewriteOptions, rewrite_model
from pagedkv.onnx_export.synthetic import SyntheticConfig, make_synthetic_model
from pagedkv.runtime.graph import RewrittenGraph


@pytest.fixture(scope="module")
def exe():
    """CI builds the sample: its absence fails, it is not skipped."""
    return built_file(_lib.GENERATE_NAME)


@pytest.fixture
def inputs(tmp_path):
    groups = tmp_path / "groups.json"
    groups.write_text(json.dumps([{"name": "g0", "num_layers": 2, "num_kv_heads": 2, "page_size": 16,
                                   "head_dim": 64, "page_layout": "HND", "cache_dtype": "fp16"}]))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": 1, "input_ids": [5, 6, 7]}\n\n{"input_ids": [8]}\n')
    engine = tmp_path / "model.engine"
    engine.write_bytes(b"not an engine, but a file" * 4)
    return {"--engine": engine, "--plugins": _lib.plugin_library_path(), "--groups": groups, "--prompts": prompts}


def run(exe, args: dict, *extra) -> subprocess.CompletedProcess:
    argv = [str(exe)] + [str(x) for kv in args.items() for x in kv] + list(extra)
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def one_line_error(p: subprocess.CompletedProcess, rc: int, start: str) -> str:
    assert p.returncode == rc, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("error: " + start), lines[0]
    return lines[0]


def test_help(exe):
    p = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    assert p.stdout.startswith("usage: pagedkv_generate --engine FILE --plugins FILE --groups FILE --prompts FILE")
    for flag in ("--max-new-tokens", "--kv-fraction", "--blocks", "--no-cuda-graphs"):
        assert flag in p.stdout


def test_missing_engine(exe, inputs, tmp_path):
    missing = tmp_path / "nothere.engine"
    one_line_error(run(exe, {**inputs, "--engine": missing}), 1, f"engine {missing}: cannot open it")


def test_wrong_plugin_library(exe, inputs, tmp_path):
    capi = _lib.require_file(_lib.CAPI_NAME)
    one_line_error(run(exe, {**inputs, "--plugins": capi}), 1,
                   f"plugin library {capi}: not a TensorRT plugin library (no getCreators)")
    missing = tmp_path / "libnothere.so"
    one_line_error(run(exe, {**inputs, "--plugins": missing}), 1, f"plugin library {missing}: cannot load it")


def test_bad_prompts_and_groups(exe, inputs, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "input_ids": [1]}\n{"id": 2, "input_ids": [-3]}\n')
    one_line_error(run(exe, {**inputs, "--prompts": bad}), 1,
                   f"prompts {bad}:2: input_ids must be a non-empty list of token ids >= 0")
    groups = tmp_path / "g.json"
    groups.write_text('[{"name": "g0", "num_layers": 2, "num_kv_heads": 2, "page_size": 16}]')
    one_line_error(run(exe, {**inputs, "--groups": groups}), 1, f"groups {groups}: a group lacks 'head_dim'")


def test_bad_arguments(exe, inputs):
    one_line_error(run(exe, inputs, "--max-new-tokens", "many"), 2,
                   "--max-new-tokens: expected an integer >= 1, got 'many'")
    one_line_error(run(exe, {"--engine": inputs["--engine"]}), 2, "--plugins: required")
    one_line_error(run(exe, inputs, "--kv-fraction", "2"), 2, "--kv-fraction: expected a number in (0, 1]")


def test_without_tensorrt_one_line(exe, inputs):
    try:
        ctypes.CDLL("libnvinfer.so.10")
        have_tensorrt = True
    except OSError:
        have_tensorrt = False
    p = run(exe, inputs)
    if have_tensorrt:  # then the file is not an engine TensorRT can deserialize
        one_line_error(p, 1, f"engine {inputs['--engine']}")
    else:
        one_line_error(p, 1, "TensorRT not found: cannot load libnvinfer.so.10")
        assert "LD_LIBRARY_PATH" in p.stderr
        assert p.stdout == ""


DOC = Path(__file__).resolve().parents[1] / "docs" / "deploy-cpp.md"


def test_the_docs_pool_groups_and_prompts_feed_the_sample(exe, inputs, tmp_path, monkeypatch):
    """docs/deploy-cpp.md's Python snippet writes groups.json from a rewritten graph and its prompt lines are a
    prompts file: the sample accepts both and stops only for want of TensorRT (or at the fake engine)."""
    text = DOC.read_text()
    snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    prompts = re.search(r"## 3\. Prompts.*?```\n(.*?)```", text, re.S).group(1)
    cfg = SyntheticConfig(num_layers=2, hidden=64, vocab=96, intermediate=128)
    rewritten = tmp_path / "qwen2.paged.onnx"
    onnx.save(rewrite_model(make_synthetic_model(cfg), RewriteOptions(pool_grouping="per_layer")).model, rewritten)
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, str(DOC), "exec"), {})  # noqa: S102  (the doc's own example)
    groups = json.loads((tmp_path / "groups.json").read_text())
    assert [g["name"] for g in groups] == [g.name for g in RewrittenGraph.load(str(rewritten)).groups]
    assert len(groups) == 2 and all(g["page_layout"] in ("HND", "NHD") for g in groups)
    (tmp_path / "prompts.jsonl").write_text(prompts)
    p = run(exe, {**inputs, "--groups": tmp_path / "groups.json", "--prompts": tmp_path / "prompts.jsonl"})
    assert p.returncode == 1 and len(p.stderr.splitlines()) == 1, p.stderr
    assert p.stderr.startswith(("error: TensorRT not found", f"error: engine {inputs['--engine']}")), p.stderr
