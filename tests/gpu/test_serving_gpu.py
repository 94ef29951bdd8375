"""Serving on the GPU (the lead runs these): ``pagedkv demo`` and ``pagedkv bench`` on the CUDA-kernel backend, the
kernel timer of ``benchmarks/bench_serving.py`` (device time of every launch, the launches counted), and the CUDA
graph of ``benchmarks/bench_runtime.py``'s decode step (capturable, and its replay gives the eager launches'
output bit for bit).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from runtime_support import SMALL, synthetic_rewritten

from pagedkv.cli import main

pytestmark = pytest.mark.gpu
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_demo_on_the_cuda_kernels(tmp_path, capsys):
    assert main(["demo", "-o", str(tmp_path), "--backend", "cuda"]) == 0, capsys.readouterr().out
    report = json.loads((tmp_path / "summary.json").read_text())
    assert report["backend"] == "cuda" and report["passed"] and report["prefix_tokens_reused"] >= 32
    assert (tmp_path / "pagemap.png").stat().st_size > 0


def test_bench_on_the_cuda_kernels(tmp_path, capsys):
    model = tmp_path / "model.paged.onnx"
    model.write_bytes(synthetic_rewritten(SMALL))
    assert main(["bench", str(model), "--backend", "cuda", "--num-blocks", "256", "--num-prompts", "8",
                 "--input-len", "40", "--output-len", "6", "--request-rate", "inf,50", "--json", "--quiet"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    for run in runs:
        assert run["completed"] == 8 and run["output_tokens"] == 48 and run["ttft_ms"]["p50"] > 0


@pytest.fixture
def benchmarks_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    yield
    for name in ("bench_serving", "bench_runtime"):
        sys.modules.pop(name, None)


def test_bench_serving_times_every_kernel_launch(benchmarks_path):
    import bench_serving

    r = bench_serving.measure("tiny", "cuda", 4, 40, 6, 64, 2048)
    layers = r["model"]["num_layers"]
    launches = r["time_s"]["kernel_launches"]
    assert launches == {"qkv_write": r["steps"] * layers, "attention": r["steps"] * layers}
    assert 0 < r["kernel_share"] < 1 and r["time_s"]["kernels"] < r["time_s"]["execute"]


def test_bench_runtime_decode_step_graph_equals_eager(benchmarks_path):
    import bench_runtime

    from pagedkv import cuda

    step = bench_runtime.DeviceDecodeStep("llama3-8b", 8, 100)
    try:
        step.launch()
        eager = step.output()
        assert np.isfinite(eager.astype(np.float32)).all()
        step.out.fill_bytes(0, step.stream)
        rt = cuda._rt()
        cuda.check(rt.cudaStreamBeginCapture(step.stream.raw, rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal),
                   "cudaStreamBeginCapture")
        step.launch()
        graph = cuda.check(rt.cudaStreamEndCapture(step.stream.raw), "cudaStreamEndCapture")
        instance = cuda.check(rt.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
        assert not step.output().any()  # capturing ran nothing
        cuda.check(rt.cudaGraphLaunch(instance, step.stream.raw), "cudaGraphLaunch")
        np.testing.assert_array_equal(step.output(), eager)
        cuda.check(rt.cudaGraphExecDestroy(instance), "cudaGraphExecDestroy")
        cuda.check(rt.cudaGraphDestroy(graph), "cudaGraphDestroy")
    finally:
        step.close()
    row = bench_runtime.measure_device("llama3-8b", 8, 100, 5)
    assert row["graph_error"] is None and row["eager_step_ms"] > 0 and row["graph_step_ms"] > 0
