"""Markers, each skip naming why: `gpu` tests skip without a CUDA device, `trt` tests without a TensorRT that can
run an engine on this GPU (pagedkv.runtime.trt.why_no_engine_runtime), `trt_builder` tests without a TensorRT
builder (TensorRT on a GPU, or TensorRT-RTX, which builds without one).

Tolerances per dtype are stated once, in pagedkv.tolerances (TOLERANCES, re-exported here).
"""

from __future__ import annotations

import pytest

from pagedkv import cuda

from pagedkv.tolerances import TOLERANCES  # noqa: E402,F401  (stated once, in the package)


def why_no_trt_builder() -> str | None:
    """None when an engine can be built here: TensorRT-RTX installed, or TensorRT and a GPU."""
    from pagedkv import trt_library

    if trt_library.why_unavailable(trt_library.TENSORRT_RTX) is None:
        return None
    if trt_library.why_unavailable(trt_library.TENSORRT) is None and cuda.why_no_gpu() is None:
        return None
    return (f"no TensorRT builder: {trt_library.why_unavailable(trt_library.TENSORRT_RTX)}; TensorRT needs a GPU as "
            "well")


_hf_exports: dict = {}


def hf_export(family: str, exporter: str, tmp_path_factory, attn: str = "eager"):
    """The family's tiny Hugging Face model (random weights) exported once per test session, shared by the modules
    that start from it (test_export_hf, test_engine_build)."""
    from pagedkv.onnx_export import hf

    key = (family, exporter, attn)
    if key not in _hf_exports:
        path = tmp_path_factory.mktemp("hf") / f"{family}_{exporter}_{attn}.onnx"
        _hf_exports[key] = hf.export_hf(family, path, exporter=exporter, seed=0, attn_implementation=attn)
    return _hf_exports[key]


def pytest_collection_modifyitems(config, items):
    from pagedkv.runtime.trt import why_no_engine_runtime

    no_gpu = cuda.why_no_gpu()
    no_trt = why_no_engine_runtime()
    no_builder = why_no_trt_builder()
    for item in items:  # markers, not keywords: a parameter id "trt" is a keyword too
        if no_gpu and item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason=f"gpu: {no_gpu}"))
        if no_trt and item.get_closest_marker("trt"):
            item.add_marker(pytest.mark.skip(reason=f"trt: {no_trt}"))
        if no_builder and item.get_closest_marker("trt_builder"):
            item.add_marker(pytest.mark.skip(reason=f"trt_builder: {no_builder}"))
