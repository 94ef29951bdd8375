"""Pool element conversions in float64: the convention of ``plugins/kernels/cache_convert.cuh``.

    fp16 / bf16 : stored = round-to-nearest-even(x)                      scale unused
    fp8 e4m3    : stored = round-to-nearest-even(clip(x / scale, -448, 448))
    int8        : stored = clip(rint(x / scale), -128, 127)              rint: half to even
    x ~= float(stored) * scale

Every rounding here rounds the float64 value ONCE. ``ml_dtypes`` casts float64 through float32 (two roundings:
``1 + 2**-4 + 2**-40`` becomes e4m3 1.0 instead of 1.125), so the float formats are rounded here first, onto
the target grid, and the final cast only re-encodes an exactly representable value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pagedkv.layout import CacheDType

FP8_E4M3_MAX = 448.0  # largest finite e4m3fn value; the kernels saturate to it (__NV_SATFINITE)
INT8_MIN, INT8_MAX = -128, 127


@dataclass(frozen=True)
class _FloatFormat:
    """Binary float format: ``precision`` significand bits (implicit bit included), ``min_exponent`` of the
    smallest normal number (subnormals share its quantum)."""

    precision: int
    min_exponent: int


_FLOAT_FORMATS = {
    CacheDType.FP16: _FloatFormat(precision=11, min_exponent=-14),
    CacheDType.BF16: _FloatFormat(precision=8, min_exponent=-126),
    CacheDType.FP8_E4M3: _FloatFormat(precision=4, min_exponent=-6),
}


def round_to_format(x: np.ndarray, fmt: _FloatFormat) -> np.ndarray:
    """Round float64 ``x`` to the nearest value of ``fmt`` (ties to even), staying in float64.

    The quantum of |x| in [2**e, 2**(e+1)) is 2**(e - precision + 1); below the smallest normal number it is
    the subnormal quantum. Dividing by a power of two is exact, so ``np.rint`` does the one rounding.
    Overflow is left to the caller (fp16/bf16 become inf on the cast, fp8 is clipped before).
    """
    x = np.asarray(x, dtype=np.float64)
    _, exp = np.frexp(x)  # x = m * 2**exp, 0.5 <= |m| < 1  ->  floor(log2|x|) = exp - 1
    exponent = np.maximum(exp.astype(np.int64) - 1, fmt.min_exponent)
    quantum = np.ldexp(1.0, exponent - (fmt.precision - 1))
    with np.errstate(invalid="ignore"):  # inf / quantum and NaN pass through unchanged
        return np.rint(x / quantum) * quantum


def _check_scale(cache_dtype: CacheDType, scale) -> float:
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise ValueError(f"scale: a {cache_dtype.name} cache needs a finite scale > 0, got {scale!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"scale: a {cache_dtype.name} cache needs a finite scale > 0, got {scale!r}")
    return value


def _supported(cache_dtype) -> CacheDType:
    cache_dtype = CacheDType.parse(cache_dtype)
    if cache_dtype not in (CacheDType.FP16, CacheDType.BF16, CacheDType.FP8_E4M3, CacheDType.INT8):
        raise NotImplementedError(f"cache_dtype: {cache_dtype.name} ({int(cache_dtype)}) has no reference yet")
    return cache_dtype


def quantize(x, cache_dtype, scale=1.0) -> np.ndarray:
    """float values -> stored pool elements (``CacheDType.numpy_dtype``), computed in float64.

    ``scale`` is used by fp8/int8 only (finite, > 0). NaN stays NaN in the float formats; in int8 it becomes
    -128, as the kernel's NaN-ignoring ``fmaxf(r, -128)`` makes it. fp16/bf16 overflow to inf like
    ``__float2half_rn``; fp8 saturates to +-448 (inf included) like ``__NV_SATFINITE``.
    """
    cache_dtype = _supported(cache_dtype)
    x = np.asarray(x, dtype=np.float64)
    if cache_dtype in (CacheDType.FP16, CacheDType.BF16):
        rounded = round_to_format(x, _FLOAT_FORMATS[cache_dtype])
        with np.errstate(over="ignore"):  # values past the format's max become inf, as in CUDA
            return rounded.astype(cache_dtype.numpy_dtype)
    inv = x / _check_scale(cache_dtype, scale)
    if cache_dtype == CacheDType.FP8_E4M3:
        saturated = np.clip(inv, -FP8_E4M3_MAX, FP8_E4M3_MAX)  # NaN passes through np.clip
        return round_to_format(saturated, _FLOAT_FORMATS[cache_dtype]).astype(cache_dtype.numpy_dtype)
    # int8: fmax/fmin drop a NaN operand exactly like CUDA's fmaxf/fminf, so NaN -> -128 as on the device.
    with np.errstate(invalid="ignore"):
        clipped = np.fmin(np.fmax(np.rint(inv), INT8_MIN), INT8_MAX)
    return clipped.astype(np.int8)


def dequantize(stored, cache_dtype, scale=1.0) -> np.ndarray:
    """Stored pool elements -> float64 values (``float(stored) * scale`` for fp8/int8)."""
    cache_dtype = _supported(cache_dtype)
    stored = np.asarray(stored)
    if stored.dtype != cache_dtype.numpy_dtype:
        raise TypeError(f"stored: a {cache_dtype.name} pool holds {cache_dtype.numpy_dtype}, got {stored.dtype}")
    values = stored.astype(np.float64)
    if cache_dtype.quantized:
        values = values * _check_scale(cache_dtype, scale)
    return values
