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
