"""The engine-I/O contract (``pagedkv.engine_io``): the rewrite emits exactly its tensors, and the C++ header,
the JSON description and the docs' table are generated from it and up to date."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest

from pagedkv import engine_io, step
from pagedkv.builder.build import BuildLimits
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
    (RewriteOptions(dtype="fp16"), 1),
    (RewriteOptions(dtype="bf16", explicit_positions=True), 1),
], ids=["one-group", "per-layer-explicit-static-width", "fp16", "bf16-explicit"])
def test_the_rewrite_emits_exactly_the_contract(options, num_groups):
    """Also under ``--dtype``: the model-dtype tensors move to it, the sampling head's float32 inputs and outputs
    stay float32 as the contract fixes them (the conversion keeps the head in float32)."""
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
            model_dtype = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}.get(options.dtype, np.float32)
            assert dtype == (spec.dtype if spec.dtype is not None else model_dtype), name
    graph = RewrittenGraph.load(model)
    assert graph.status_outputs == tuple(engine_io.status_name(i) for i in range(cfg.num_layers))
    # the build profile sizes every one of them, from the same symbolic dims
    shapes = BuildLimits(max_batch=4, max_tokens=64, max_context=256, opt_batch=2, opt_tokens=8,
                         opt_context=64).profile(graph)
    assert list(shapes) == [name for name, _ in engine_io.engine_inputs(num_groups, explicit)]
    assert shapes[engine_io.KV_POOLS] == ((num_groups, step.POOL_DESC_FIELDS),) * 3
    # ...and the graph's I/O with that profile is what the contract check accepts
    tensors = [(v.name, is_input, onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name,
                [d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim])
               for values, is_input in ((model.graph.input, True), (model.graph.output, False)) for v in values]
    assert engine_io.check_engine_io(tensors, shapes) == []


def _contract_io(num_groups=1, layers=2, sampling=True):
    """A valid engine's I/O as TensorRT reports it (-1 for dynamic dims) and a profile for it: T <= 64, B <= 4,
    MB <= 16, R <= 64, W <= 100, vocab 96, 5 top logprobs."""
    tensors = [("input_ids", True, "int64", [1, -1]), ("kv_pools", True, "int64", [num_groups, 4]),
               ("cu_q_lens", True, "int32", [-1]), ("past_lens", True, "int32", [-1])]
    tensors += [(f"block_table_{g}", True, "int32", [-1, -1]) for g in range(num_groups)]
    tensors += [("logits_rows", True, "int32", [-1])]
    profile = {"input_ids": ((1, 1), (1, 8), (1, 64)), "kv_pools": ((num_groups, 4),) * 3,
               "cu_q_lens": ((2,), (3,), (5,)), "past_lens": ((1,), (2,), (4,)), "logits_rows": ((1,), (2,), (64,))}
    profile.update({f"block_table_{g}": ((1, 1), (2, 4), (4, 16)) for g in range(num_groups)})
    if sampling:
        tensors += [("sampling_params", True, "float32", [-1, engine_io.SAMPLING_FIELDS]),
                    ("penalty_tokens", True, "int32", [-1, -1]), ("penalty_counts", True, "float32", [-1, -1])]
        profile.update({"sampling_params": tuple((r, engine_io.SAMPLING_FIELDS) for r in (1, 2, 64)),
                        "penalty_tokens": ((1, 1), (2, 1), (64, 100)), "penalty_counts": ((1, 1), (2, 1), (64, 100))})
    tensors += [("logits", False, "bfloat16", [1, -1, 96])]
    if sampling:
        tensors += [("next_tokens", False, "int32", [-1]), ("next_logprobs", False, "float32", [-1]),
                    ("top_tokens", False, "int32", [-1, 5]), ("top_logprobs", False, "float32", [-1, 5])]
    tensors += [(f"kv_write_status_{i}", False, "int32", [4]) for i in range(layers)]
    return tensors, profile


def _replace(tensors, name, **change):
    keys = ("name", "is_input", "dtype", "shape")
    return [tuple(change.get(k, v) for k, v in zip(keys, t)) if t[0] == name else t for t in tensors]


@pytest.mark.parametrize("change,words", [
    (lambda t, p: (_replace(t, "past_lens", dtype="int64"), p), ["past_lens (input): dtype int64, expected int32"]),
    (lambda t, p: (_replace(t, "logits", is_input=True), p), ["logits (input): the contract has it as an output"]),
    (lambda t, p: (_replace(t, "kv_pools", shape=[1, 3]), p), ["kv_pools (input): dim 1 is 3, expected 4"]),
    (lambda t, p: (_replace(t, "block_table_0", shape=[-1]), p), ["block_table_0 (input): rank 1"]),
    (lambda t, p: ([x for x in t if x[0] != "kv_write_status_0"], p), ["kv_write_status_{i}: the engine has indices [1]"]),
    (lambda t, p: ([x for x in t if x[0] != "cu_q_lens"], {k: v for k, v in p.items() if k != "cu_q_lens"}),
     ["cu_q_lens: missing"]),
    (lambda t, p: (t + [("scratch", True, "float32", [2])], p), ["scratch: not an engine tensor"]),
    (lambda t, p: (_replace(t, "logits", dtype="int32"), p), ["logits (output): dtype int32, expected the model's"]),
    (lambda t, p: (t, dict(p, cu_q_lens=((2,), (3,), (6,)))), ["profile max: batch is bound to different values"]),
    (lambda t, p: (t, dict(p, past_lens=((1,), (5,), (4,)))), ["past_lens: profile [1] / [5] / [4] is not min <= opt"]),
    (lambda t, p: (t, {k: v for k, v in p.items() if k != "past_lens"}), ["past_lens: no optimization-profile shapes"]),
], ids=["dtype", "direction", "static-dim", "rank", "status-numbering", "missing-input", "stranger",
        "model-dtype", "profile-binding", "profile-order", "profile-missing"])
def test_contract_check_names_each_problem(change, words):
    tensors, profile = _contract_io()
    assert engine_io.check_engine_io(tensors, profile) == []
    problems = engine_io.check_engine_io(*change(tensors, profile))
    assert problems and all(any(w in p for p in problems) for w in words), problems


def test_contract_check_counts_block_tables_against_pool_groups():
    tensors, profile = _contract_io(num_groups=2)
    tensors = [t for t in tensors if t[0] != "block_table_1"]
    problems = engine_io.check_engine_io(tensors, {k: v for k, v in profile.items() if k != "block_table_1"})
    assert any("kv_pools: 2 pool-group rows but 1 block tables" in p for p in problems), problems


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
