"""Rotary position embedding in float64: inverse frequencies (with scaling) and the rotation itself.

    D head_dim, R rotary dims (even, <= D; dims >= R pass through), T tokens

The kernel takes a table of R/2 inverse frequencies and a multiplier (``RopeParams`` in qkv_write.h), not a
formula: every scaling rule only changes the table (and, for YaRN-like rules, the multiplier). This module
keeps the same split: ``_INV_FREQ_RULES`` maps a ``RopeScaling`` to a table rule, ``_attention_factor`` gives
the multiplier. A new rule (YaRN, LongRoPE) is one function plus one entry in each.
"""

from __future__ import annotations

import math

import numpy as np

from pagedkv.config import RopeConfig, RopeScaling, RopeStyle


def _base_inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """theta ** (-2i / R), i in [0, R/2)."""
    if not (math.isfinite(theta) and theta > 0):
        raise ValueError(f"rope_theta: must be finite and > 0, got {theta}")
    return theta ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


def _check_factor(rope: RopeConfig) -> float:
    if not (math.isfinite(rope.factor) and rope.factor > 0):
        raise ValueError(f"rope_factor: must be finite and > 0, got {rope.factor}")
    return float(rope.factor)


def _no_scaling(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    return inv_freq


def _linear_scaling(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    """Position interpolation: angle(p) = (p / factor) * inv_freq."""
    return inv_freq / _check_factor(rope)


def _llama3_scaling(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    """Llama 3.1's rule (Meta's ``apply_scaling``, Hugging Face's ``rope_type="llama3"``).

    By wavelength 2*pi/f against the original context N = original_max_positions:
      wavelength < N / high_freq_factor  -> f unchanged (high frequencies carry local order)
      wavelength > N / low_freq_factor   -> f / factor (low frequencies are interpolated)
      in between                         -> (1 - s) * f / factor + s * f,
                                            s = (N / wavelength - low_freq_factor) / (high - low)
    """
    factor = _check_factor(rope)
    low, high, n_orig = float(rope.low_freq_factor), float(rope.high_freq_factor), rope.original_max_positions
    if not (low > 0 and high > low):
        raise ValueError(f"rope_low_freq_factor / rope_high_freq_factor: need 0 < low < high, got "
                         f"low={rope.low_freq_factor}, high={rope.high_freq_factor}")
    if n_orig <= 0:
        raise ValueError(f"rope_original_max_positions: must be > 0, got {n_orig}")
    wavelength = 2.0 * math.pi / inv_freq
    smooth = (n_orig / wavelength - low) / (high - low)
    blended = (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
    return np.select([wavelength < n_orig / high, wavelength > n_orig / low],
                     [inv_freq, inv_freq / factor], default=blended)


_INV_FREQ_RULES = {
    RopeScaling.NONE: _no_scaling,
    RopeScaling.LINEAR: _linear_scaling,
    RopeScaling.LLAMA3: _llama3_scaling,
}


def _scaling_rule(rope: RopeConfig):
    try:
        return _INV_FREQ_RULES[RopeScaling(rope.scaling)]
    except (ValueError, KeyError):
        known = ", ".join(f"{s.name}={int(s)}" for s in _INV_FREQ_RULES)
        raise NotImplementedError(f"rope_scaling: {rope.scaling!r} has no reference yet (known: {known}; "
                                  "YaRN / LongRoPE are not implemented)") from None


def _attention_factor(rope: RopeConfig) -> float:
    """Multiplier of cos and sin (``RopeParams::mscale``): 1 for every rule implemented so far."""
    _scaling_rule(rope)
    return 1.0


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> np.ndarray:
    """float64 [R/2]: the angle of pair i at position p is ``p * inv_freq[i]``.

    Computed in float64 and rounded ONCE to float32, as the contract's ``RopeParams::invFreq`` (and Hugging
    Face's ``inv_freq`` buffer) holds it: at position 128K a float64-vs-float32 frequency differs by about
    4e-3 rad, more than an fp16 output tolerates, so the reference must use the frequencies the model uses.
    The angle ``p * inv_freq`` itself is then exact (float64), which is what the kernels approximate.
    """
    rotary_dim = rope.resolved_rotary_dim(head_dim)
    rule = _scaling_rule(rope)
    exact = rule(_base_inv_freq(rotary_dim, float(rope.theta)), rope)
    return exact.astype(np.float32).astype(np.float64)


def _pair_indices(style: RopeStyle, rotary_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Dims (first, second) of each rotated pair: NEOX (i, i + R/2), GPTJ (2i, 2i + 1)."""
    half = rotary_dim // 2
    if style == RopeStyle.NEOX:
        return np.arange(half), np.arange(half, rotary_dim)
    if style == RopeStyle.GPTJ:
        return np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2)
    raise ValueError(f"rope_style: expected one of {[s.name for s in RopeStyle]}, got {style!r}")


def apply_rope(x, positions, head_dim: int, rope: RopeConfig) -> np.ndarray:
    """Rotate ``x`` [T, heads, D] at ``positions`` [T]; returns a new float64 array.

    Pair (a, b) with angle phi = position * inv_freq[i] becomes
    (a cos phi - b sin phi, b cos phi + a sin phi). Dims >= R and ``RopeStyle.NONE`` pass through.
    """
    out = np.array(x, dtype=np.float64)  # a copy: callers keep their input
    if out.ndim != 3 or out.shape[2] != head_dim:
        raise ValueError(f"x: expected [tokens, heads, head_dim={head_dim}], got shape {out.shape}")
    positions = np.asarray(positions)
    if positions.shape != (out.shape[0],):
        raise ValueError(f"positions: expected shape ({out.shape[0]},), got {positions.shape}")
    style = RopeStyle(rope.style)
    if style == RopeStyle.NONE:
        return out
    inv_freq = rope_inv_freq(head_dim, rope)
    first, second = _pair_indices(style, rope.resolved_rotary_dim(head_dim))
    angle = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, R/2]
    mscale = _attention_factor(rope)
    cos = (mscale * np.cos(angle))[:, None, :]  # broadcast over heads
    sin = (mscale * np.sin(angle))[:, None, :]
    a, b = out[:, :, first], out[:, :, second]
    out[:, :, first] = a * cos - b * sin
    out[:, :, second] = b * cos + a * sin
    return out
