"""Markers: `gpu` tests skip without a CUDA device and `trt` tests without TensorRT, each naming why.

Tolerances per dtype are stated once, in pagedkv.tolerances (TOLERANCES, re-exported here).
"""

from __future__ import annotations

import importlib.util

import pytest

from pagedkv import cuda

from pagedkv.tolerances import TOLERANCES  # noqa: E402,F401  (stated once, in the package)


def _trt_missing() -> str | None:
    if importlib.util.find_spec("tensorrt") is None:
        return "TensorRT Python runtime not installed (it is not installable in this workplace)"
    return None


def pytest_collection_modifyitems(config, items):
    no_gpu = cuda.why_no_gpu()
    no_trt = _trt_missing()
    for item in items:
        if no_gpu and "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=f"gpu: {no_gpu}"))
        if no_trt and "trt" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=f"trt: {no_trt}"))


# ---- the exporter matrix (tests/test_export_hf.py, tests/test_exporters.py) ---------------------------------
MATRIX_PROMPTS = [5, 17, 33]  # ragged: inside one page, across a page boundary, three pages (page 16)


def rewrite_and_compare(path, label: str):
    """One cell of the exporter matrix: ``rewrite_model`` the exported graph, then ``compare`` it with the original
    on a ragged batch (MATRIX_PROMPTS) in 8-token prefill chunks (steps mix prefill chunks and decodes) and 8 greedy
    decode steps: logits within the fp16-cache tolerance on the logits' scale, every greedy token the same, the
    paged K/V equal to the present K/V. Returns the RewriteResult."""
    import time

    from pagedkv.builder.compare import compare
    from pagedkv.builder.rewrite import RewriteOptions, rewrite_model

    result = rewrite_model(str(path), RewriteOptions())
    start = time.perf_counter()
    fp16 = TOLERANCES["float16"]
    report = compare(str(path), result.model, prompt_lens=MATRIX_PROMPTS, decode_steps=8, chunk_size=8,
                     atol=fp16[0], rtol=fp16[1])
    print(f"{label}: compare {time.perf_counter() - start:.1f} s, max abs {report.max_abs:.2e}")
    assert report.logits_passed, str(report)
    assert report.greedy_passed, str(report)
    assert report.kv and report.kv_passed, str(report)
    assert {"prefill", "decode"} in [{k for _, _, k in s.entries} for s in report.steps]
    assert all(len(t) == 8 for t in report.greedy_tokens.values())
    return result
