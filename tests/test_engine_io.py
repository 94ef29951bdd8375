"""The engine-I/O contract (``pagedkv.engine_io``): the rewrite emits exactly its tensors, and the C++ header,
the JSON description and the docs' table are generated from it and up to date."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from pagedkv import engine_io, step
from pagedkv.builder.build import ProfileSpec
from pagedkv.builder.rewrite import RewriteOptions, rewrite_model
from pagedkv.onnx_export.synthetic import SyntheticConfig, make_synthetic_model
from pagedkv.runtime.graph import RewrittenGraph

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "plugins" / "include" / "pagedkv" / "engine_io.h"


def _dims(value_info) -> tuple:
    return tuple(d.dim_param if d.HasField("dim_param") else d.dim_value for d in value_info.type.tensor_type.shape.dim)


@pytest.mark.parametrize("options,num_groups", [
    (RewriteOptions(), 1),
    (RewriteOptions(pool_grouping="per_layer", explicit_positions=True, max_blocks=24), 3),
], ids=["one-group", "per-layer-explicit-static-width"])
def test_the_rewrite_emits_exactly_the_contract(options, num_groups):
    cfg = SyntheticConfig(num_layers=3, hidden=64, vocab=96, intermediate=128)
    model = rewrite_model(make_synthetic_model(cfg), options).model
    explicit = bool(options.explicit_positions)
    dims = {engine_io.NUM_POOL_GROUPS: num_groups, engine_io.VOCAB: cfg.vocab,
            engine_io.NUM_TOP_LOGPROBS: min(options.top_logprobs, cfg.vocab)}
    if options.max_blocks:
        dims[engine_io.MAX_BLOCKS] = options.max_blocks
    for values, expected in ((model.graph.input, engine_io.engine_inputs(num_groups, explicit)),
                             (model.graph.output, engine_io.engine_outputs(cfg.num_layers))):
        assert [v.name for v in values] == [name for name, _ in expected]
        for v, (name, spec) in zip(values, expected):
            assert _dims(v) == engine_io.resolve_shape(spec, dims), name
            dtype = onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)
            assert dtype == (spec.dtype if spec.dtype is not None else np.float32), name
    graph = RewrittenGraph.load(model)
    assert graph.status_outputs == tuple(engine_io.status_name(i) for i in range(cfg.num_layers))
    # the build profile sizes every one of them, from the same symbolic dims
    shapes = ProfileSpec(max_tokens=64, opt_tokens=8, max_seqs=4, opt_seqs=2, max_blocks=16, opt_blocks=4).shapes(graph)
    assert list(shapes) == [name for name, _ in engine_io.engine_inputs(num_groups, explicit)]
    assert shapes[engine_io.KV_POOLS] == ((num_groups, step.POOL_DESC_FIELDS),) * 3


def test_names_and_indices_round_trip():
    assert engine_io.block_table_name(3) == "block_table_3"
    assert engine_io.status_name(12) == "kv_write_status_12" and engine_io.status_layer("kv_write_status_12") == 12
    for name in ("kv_write_status_", "kv_write_status_x", "kv_pools", "kv_write_status_1b", "xkv_write_status_1"):
        assert engine_io.status_layer(name) is None
    assert engine_io.REQUIRED_INPUTS == ("input_ids", "kv_pools", "cu_q_lens", "past_lens", "logits_rows")
    spec = engine_io.SPECS[engine_io.BLOCK_TABLE]
    assert engine_io.resolve_shape(spec, {engine_io.BATCH: 5}) == (5, engine_io.MAX_BLOCKS)


def test_checked_in_header_is_generated_from_the_module():
    assert HEADER.read_text() == engine_io.render_header(), (
        f"{HEADER.relative_to(ROOT)} is stale: regenerate it with `python -m pagedkv.engine_io --header > "
        f"{HEADER.relative_to(ROOT)}`")


def test_header_compiles_and_agrees_with_step_metadata(tmp_path):
    """The header's static_asserts hold pagedkv.step's record layout against step_metadata.h's enums."""
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH (c++, g++, clang++): the header cannot be compiled here")
    source = tmp_path / "engine_io_check.cpp"
    source.write_text('#include "pagedkv/engine_io.h"\n'
                      "namespace io = pagedkv::engine_io;\n"
                      'static_assert(io::kTensors[0].shape[1].dim == io::Dim::kNumTokens, "input_ids is [1, T]");\n'
                      "int main() { return io::kNumTensors == 16 ? 0 : 1; }\n")
    run = subprocess.run([compiler, "-std=c++17", "-Wall", "-Wextra", "-Werror", "-fsyntax-only",
                          f"-I{ROOT / 'plugins' / 'include'}", str(source)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_json_description(capsys):
    assert engine_io.main(["--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described == engine_io.describe()
    assert [t["name"] for t in described["inputs"]] == ["input_ids", "kv_pools", "cu_q_lens", "past_lens",
                                                        "block_table_{g}", "position_ids", "logits_rows",
                                                        "sampling_params", "penalty_tokens", "penalty_counts"]
    assert [t["name"] for t in described["outputs"]] == ["logits", "next_tokens", "next_logprobs", "top_tokens",
                                                         "top_logprobs", "kv_write_status_{i}"]
    sampling = described["records"]["sampling_params"]
    assert sampling["fields"] == engine_io.SAMPLING_FIELDS == len(sampling["columns"])
    assert sorted(sampling["columns"].values()) == list(range(engine_io.SAMPLING_FIELDS))
    status = described["records"]["kv_write_status"]
    assert status["fields"] == step.STATUS_FIELDS and status["columns"]["entry"] == step.STATUS_ENTRY
    cli = subprocess.run([sys.executable, "-m", "pagedkv.engine_io", "--json"], capture_output=True, text=True)
    assert cli.returncode == 0 and json.loads(cli.stdout) == described


def test_docs_table_is_the_module_table():
    doc = (ROOT / "docs" / "engine_io.md").read_text()
    assert engine_io.render_markdown() in doc, "docs/engine_io.md: paste `python -m pagedkv.engine_io --markdown`"
