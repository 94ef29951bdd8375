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
from pagedkv.runtime.trt import TensorRTUnavailable, TrtExecutor, why_no_tensorrt
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
    with TrtExecutor(str(rew), engine=engine, num_blocks=2) as sess:
        sess.step([("a", np.arange(20))])  # two pages of 16
        # sabotage: drop the sequence's second page from the manager's table (a -1 inside the live range)
        sess.manager._tables[0][sess.manager.state("a").row, 1] = -1
        with pytest.raises(KVWriteError):
            sess.step([("a", np.arange(5))])


@pytest.mark.trt
@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["cuda-graphs", "eager"])
def test_trt_engine_generates_what_the_reference_does(rewritten_path, tmp_path, cuda_graphs):
    """The engine over a TensorRT executor: greedy and seeded tokens follow the reference executor (16-bit
    kernels may flip near-ties, so most, not all, requests must agree), decode steps replay captured CUDA
    graphs (one per bucket of sequences and block-table width), and nothing stays allocated."""
    import numpy as np

    from pagedkv.runtime import Engine, OrtExecutor, SamplingParams, SchedulerConfig
    from pagedkv.runtime.executor import PAD_SEQUENCE
    from pagedkv.runtime.trt import TrtExecutor

    _, rew = rewritten_path
    engine_path = build.build_engine(rew, tmp_path / "m.engine", profile=build.ProfileSpec(max_tokens=256, max_seqs=8,
                                                                                            max_blocks=16))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, BASE.vocab, n) for n in (5, 17, 33, 12, 3)]
    params = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, seed=9)]
    outs = {}
    for name in ("reference", "trt"):
        ex = (OrtExecutor(str(rew), num_blocks=64) if name == "reference" else
              TrtExecutor(str(rew), engine=engine_path, num_blocks=64, cuda_graphs=cuda_graphs))
        with ex:
            engine = Engine(ex, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, chunk_size=8))
            reqs = [engine.add_request((i, j), p, sp) for i, p in enumerate(prompts) for j, sp in enumerate(params)]
            engine.run()
            outs[name] = [r.output for r in reqs]
            if name == "trt":
                assert (ex.num_graphs > 0) == cuda_graphs
                assert set(ex.manager.sequences) <= {PAD_SEQUENCE}  # only the padding rows' blocks stay held
    same = sum(a == b for a, b in zip(outs["reference"], outs["trt"]))
    assert same >= len(outs["trt"]) // 2, outs


@pytest.mark.trt
@pytest.mark.gpu
def test_trt_executor_refuses_an_engine_of_another_graph(rewritten_path, tmp_path):
    from pagedkv.runtime.graph import GraphError
    from pagedkv.runtime.trt import TrtExecutor

    _, rew = rewritten_path
    engine_path = build.build_engine(rew, tmp_path / "m.engine", profile=build.ProfileSpec(max_tokens=64, max_seqs=4,
                                                                                            max_blocks=8))
    other = tmp_path / "other.onnx"
    import onnx

    onnx.save(rewrite_model(str(rewritten_path[0]), RewriteOptions(sampling=False)).model, str(other))
    with pytest.raises(GraphError, match="differ from the rewritten graph's"):
        TrtExecutor(str(other), engine=engine_path, num_blocks=4)
