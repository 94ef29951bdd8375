"""TensorRT build path: engine from a rewritten graph, run step by step, compared with the original.

The ``trt`` tests need TensorRT and a GPU (conftest skips them, naming the reason). The CPU tests check what
works without TensorRT: the CLI says "TensorRT not available" with exit status 2, profiles are validated
and sized from the rewritten graph's engine inputs.
"""

from __future__ import annotations

import pytest
from conftest import TOLERANCES

from pagedkv.builder import build
from pagedkv.builder.rewrite import RewriteOptions, rewrite_model
from pagedkv.runtime import RewrittenGraph
from pagedkv.runtime.trt import TensorRTUnavailable, TrtSession, why_no_tensorrt
from pagedkv.onnx_export.synthetic import SyntheticConfig, export_synthetic

BASE = SyntheticConfig(num_layers=2, hidden=64, vocab=128, intermediate=128)


@pytest.fixture(scope="module")
def rewritten_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("trt")
    orig = export_synthetic(BASE, d / "orig.onnx")
    import onnx

    path = d / "rewritten.onnx"  # fp16: the plugins take 16-bit activations only
    onnx.save(rewrite_model(str(orig), RewriteOptions(dtype="fp16")).model, str(path))
    return orig, path


def test_a_float32_graph_is_refused_before_tensorrt_is_asked(tmp_path):
    import onnx

    orig = export_synthetic(BASE, tmp_path / "orig.onnx")
    path = tmp_path / "float32.onnx"
    onnx.save(rewrite_model(str(orig)).model, str(path))
    with pytest.raises(ValueError, match=r"plugin activations are float32; the plugins take float16 or bfloat16: "
                                         r"rewrite with --dtype fp16\|bf16"):
        build.build_engine(path, tmp_path / "m.engine")
    assert not (tmp_path / "m.engine").exists()


def test_profile_covers_every_engine_input(rewritten_path):
    graph = RewrittenGraph.load(str(rewritten_path[1]))
    shapes = build.ProfileSpec(max_tokens=512, opt_tokens=64, max_seqs=8, opt_seqs=2, max_blocks=32,
                               opt_blocks=4).shapes(graph)
    assert set(shapes) == set(graph.input_names)
    assert shapes["input_ids"] == ((1, 1), (1, 64), (1, 512))
    assert shapes["cu_q_lens"] == ((2,), (3,), (9,))
    assert shapes["block_table_0"] == ((1, 1), (2, 4), (8, 32))
    assert shapes["kv_pools"] == ((1, 4),) * 3


@pytest.mark.parametrize("bad,match", [({"max_tokens": 0}, "max_tokens: must be >= 1"),
                                       ({"opt_seqs": 9, "max_seqs": 8}, "opt_seqs=9 exceeds max_seqs=8")])
def test_profile_errors_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        build.ProfileSpec(**bad)


@pytest.mark.skipif(why_no_tensorrt() is None, reason="TensorRT is installed: the no-TensorRT path cannot be "
                                                      "observed here")
def test_cli_build_says_tensorrt_is_not_available(rewritten_path, tmp_path, capsys):
    from pagedkv.cli import main

    assert main(["build", str(rewritten_path[1]), "-o", str(tmp_path / "m.engine")]) == 2
    assert "TensorRT not available" in capsys.readouterr().out
    with pytest.raises(TensorRTUnavailable, match="TensorRT not available"):
        build.build_engine(rewritten_path[1], tmp_path / "m.engine")


@pytest.mark.trt
@pytest.mark.gpu
def test_engine_matches_the_original(rewritten_path, tmp_path):
    from pagedkv.builder.compare import compare

    orig, rew = rewritten_path
    engine = build.build_engine(rew, tmp_path / "m.engine", profile=build.ProfileSpec(max_tokens=256, max_seqs=8,
                                                                                       max_blocks=16))
    assert engine.stat().st_size > 0
    atol, rtol = TOLERANCES["bfloat16"]
    report = compare(str(orig), str(rew), backend="trt", prompt_lens=[5, 17, 33], decode_steps=8, chunk_size=8,
                     atol=atol, rtol=rtol)
    assert report.logits_passed and report.greedy_passed, str(report)


@pytest.mark.trt
@pytest.mark.gpu
def test_engine_reports_invalid_pages(rewritten_path, tmp_path):
    import numpy as np

    from pagedkv.step import KVWriteError

    _, rew = rewritten_path
    engine = build.build_engine(rew, tmp_path / "m.engine", profile=build.ProfileSpec(max_tokens=128, max_seqs=4,
                                                                                       max_blocks=8))
    with TrtSession(str(rew), engine=engine, num_blocks=2) as sess:
        sess.step([("a", np.arange(20))])  # two pages of 16
        # sabotage: drop the sequence's second page from the manager's table (a -1 inside the live range)
        sess.manager._tables[0][sess.manager.state("a").row, 1] = -1
        with pytest.raises(KVWriteError):
            sess.step([("a", np.arange(5))])
