"""The serving benchmarks run as documented (a CPU check of the scripts; the figures come from the GPU machine):
``benchmarks/bench_serving.py --backend reference --config tiny`` and ``benchmarks/bench_runtime.py`` write sane
JSON, and ``--backend cuda`` without a GPU says why in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv import cuda

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, expect: int = 0) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert run.returncode == expect, run.stdout + run.stderr
    return run


def test_bench_serving_on_the_references(tmp_path):
    out = tmp_path / "serving.json"
    run = _run("bench_serving.py", "--backend", "reference", "--config", "tiny", "--num-prompts", "4",
               "--input-len", "24", "--output-len", "5", "--ort-threads", "1", "--json", str(out))
    r = json.loads(out.read_text())
    assert r["output_tokens"] == 4 * 5 and r["steps"] == 5 and r["ort_threads"] == 1
    assert r["output_tokens_per_s"] > 0 and 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p90"]
    t = r["time_s"]
    assert t["kernels"] is None and r["kernel_share"] is None  # the references have no device kernels to time
    assert t["execute_rest"] == pytest.approx(t["execute"])
    assert 0 < t["host"] < t["execute"] < r["wall_s"]
    assert "# bench_serving: tiny" in run.stdout and "# reproduce:" in run.stdout


def test_bench_runtime_host_json(tmp_path):
    out = tmp_path / "runtime.json"
    _run("bench_runtime.py", "--seqs", "4,8", "--context", "40", "--steps", "5", "--json", str(out))
    r = json.loads(out.read_text())
    assert [row["seqs"] for row in r["host"]] == [4, 8] and r["device"] == []
    assert all(row["host"] > 0 and row["p90_host"] >= row["host"] for row in r["host"])


@pytest.mark.skipif(cuda.why_no_gpu() is None, reason="a GPU is present: tests/gpu runs the cuda variants")
@pytest.mark.parametrize("script", ["bench_serving.py", "bench_runtime.py"])
def test_cuda_variants_say_why_without_a_gpu(script):
    run = _run(script, "--backend", "cuda", expect=2)
    assert "--backend cuda needs a GPU" in run.stderr and run.stderr.count("\n") == 1
