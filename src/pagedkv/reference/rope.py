"""Rotary position embedding in float64: inverse frequencies (with scaling) and the rotation itself.

    D head_dim, R rotary dims (even, <= D; dims >= R pass through), T tokens

The kernel takes tables of R/2 inverse frequencies and a multiplier (``RopeParams`` in qkv_write.h), not a
formula: every scaling rule only changes the table (LongRoPE: two tables, chosen per sequence) and, for YaRN and
LongRoPE, the multiplier of cos and sin (the attention factor). This module keeps the same split:
``_INV_FREQ_RULES`` maps a ``RopeScaling`` to a table rule, ``attention_factor`` gives the multiplier and
``long_table_above`` the kv length past which a sequence takes the long table. The formulas are Hugging Face
transformers' (``modeling_rope_utils``), evaluated in float64 and rounded once to float32.
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


def _check_original(rope: RopeConfig) -> int:
    if rope.original_max_positions <= 0:
        raise ValueError(f"rope_original_max_positions: must be > 0, got {rope.original_max_positions}")
    return int(rope.original_max_positions)


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
    low, high, n_orig = float(rope.low_freq_factor), float(rope.high_freq_factor), _check_original(rope)
    if not (low > 0 and high > low):
        raise ValueError(f"rope_low_freq_factor / rope_high_freq_factor: need 0 < low < high, got "
                         f"low={rope.low_freq_factor}, high={rope.high_freq_factor}")
    wavelength = 2.0 * math.pi / inv_freq
    smooth = (n_orig / wavelength - low) / (high - low)
    blended = (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
    return np.select([wavelength < n_orig / high, wavelength > n_orig / low],
                     [inv_freq, inv_freq / factor], default=blended)


def yarn_ramp_bounds(rope: RopeConfig, rotary_dim: int) -> tuple[float, float]:
    """(low, high) of YaRN's ramp over the pair index, as Hugging Face's ``find_correction_range``.

    d(b) = R * ln(N / (2 pi b)) / (2 ln theta) is the dim whose frequency turns b times over the original
    context N; low = d(beta_fast), high = d(beta_slow), floored / ceiled when ``truncate``, clamped to
    [0, R - 1] (R, not R/2: Hugging Face's bound), and high += 0.001 when they meet.
    """
    n_orig, theta = _check_original(rope), float(rope.theta)
    for name in ("beta_fast", "beta_slow"):
        v = getattr(rope, name)
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"rope_{name}: must be finite and > 0, got {v}")

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(n_orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(float(rope.beta_fast)), correction_dim(float(rope.beta_slow))
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0.0), min(high, float(rotary_dim - 1))
    return (low, high + 0.001) if low == high else (low, high)


def _yarn_scaling(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    """YaRN (Hugging Face ``rope_type="yarn"``): ramp(i) = clamp((i - low) / (high - low), 0, 1) over pair i
    (``yarn_ramp_bounds``); f(i) = f * (1 - ramp) + (f / factor) * ramp: pairs below low keep their frequency
    (extrapolation), pairs above high are interpolated like linear scaling."""
    factor = _check_factor(rope)
    low, high = yarn_ramp_bounds(rope, 2 * inv_freq.size)
    ramp = np.clip((np.arange(inv_freq.size, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return inv_freq * (1.0 - ramp) + inv_freq / factor * ramp


def _longrope_factors(rope: RopeConfig, pairs: int, long: bool) -> np.ndarray:
    _check_original(rope)
    for name in ("short_factors", "long_factors"):
        values = np.asarray(getattr(rope, name), dtype=np.float64)
        if values.shape != (pairs,):
            raise ValueError(f"rope_{name}: expected rotary_dim / 2 = {pairs} values, got {values.size}")
        bad = np.flatnonzero(~(np.isfinite(values) & (values > 0)))
        if bad.size:
            raise ValueError(f"rope_{name}[{bad[0]}]: must be finite and > 0, got {values[bad[0]]}")
    # as the FLOATS attributes carry them: float32
    return np.asarray(rope.long_factors if long else rope.short_factors, dtype=np.float32).astype(np.float64)


def _longrope_scaling(inv_freq: np.ndarray, rope: RopeConfig, long: bool = False) -> np.ndarray:
    """LongRoPE (Hugging Face ``rope_type="longrope"``): f(i) / short_factors[i], or / long_factors[i] for the
    sequences past original_max_positions (``long_table_above``)."""
    return inv_freq / _longrope_factors(rope, inv_freq.size, long)


_INV_FREQ_RULES = {
    RopeScaling.NONE: _no_scaling,
    RopeScaling.LINEAR: _linear_scaling,
    RopeScaling.LLAMA3: _llama3_scaling,
    RopeScaling.YARN: _yarn_scaling,
    RopeScaling.LONGROPE: _longrope_scaling,
}


def _scaling_rule(rope: RopeConfig):
    try:
        return _INV_FREQ_RULES[RopeScaling(rope.scaling)]
    except (ValueError, KeyError):
        known = ", ".join(f"{s.name}={int(s)}" for s in _INV_FREQ_RULES)
        raise ValueError(f"rope_scaling: expected one of {known}, got {rope.scaling!r}") from None


def attention_factor(rope: RopeConfig) -> float:
    """Multiplier of cos and sin (``RopeParams::mscale``): 1 except for YaRN and LongRoPE, where it is
    ``attention_factor`` or, when that is 0, Hugging Face's default from ``factor`` (1 when factor <= 1):
    YaRN 0.1 ln(factor) + 1, LongRoPE sqrt(1 + ln(factor) / ln(original_max_positions))."""
    _scaling_rule(rope)  # names an unknown scaling
    scaling = RopeScaling(rope.scaling)
    if scaling not in (RopeScaling.YARN, RopeScaling.LONGROPE):
        return 1.0
    if not (math.isfinite(rope.attention_factor) and rope.attention_factor >= 0):
        raise ValueError(f"rope_attention_factor: must be finite and >= 0 (0: the default), got {rope.attention_factor}")
    if rope.attention_factor > 0:
        return float(np.float32(rope.attention_factor))  # the plugin attribute is a float32
    factor = _check_factor(rope)
    if factor <= 1.0:
        return 1.0
    if scaling == RopeScaling.YARN:
        exact = 0.1 * math.log(factor) + 1.0
    else:
        n_orig = _check_original(rope)
        if n_orig == 1:
            raise ValueError("rope_attention_factor: the LongRoPE default needs rope_original_max_positions > 1")
        exact = math.sqrt(1.0 + math.log(factor) / math.log(n_orig))
    return float(np.float32(exact))  # RopeParams::mscale is a float, rounded once


def long_table_above(rope: RopeConfig) -> int:
    """LongRoPE: a sequence whose kv length after the step (past_len + its new tokens) exceeds this rotates its
    new tokens with the long table (``RopeParams::longAboveKVLen``); 0 for every other scaling (one table).

    Hugging Face's ``longrope_frequency_update`` picks the table once per forward call from
    ``max(position_ids) + 1`` (the kv length when positions are past_len + i) and never re-rotates cached keys:
    the keys of the steps before the switch keep the short table's rotation, and so do ours."""
    return int(rope.original_max_positions) if RopeScaling(rope.scaling) == RopeScaling.LONGROPE else 0


def rope_inv_freq(head_dim: int, rope: RopeConfig, long: bool = False) -> np.ndarray:
    """float64 [R/2]: the angle of pair i at position p is ``p * inv_freq[i]`` (``long``: LongRoPE's long table).

    Computed in float64 and rounded ONCE to float32, as the contract's ``RopeParams::invFreq`` (and Hugging
    Face's ``inv_freq`` buffer) holds it: at position 128K a float64-vs-float32 frequency differs by about
    4e-3 rad, more than an fp16 output tolerates, so the reference must use the frequencies the model uses.
    The angle ``p * inv_freq`` itself is then exact (float64), which is what the kernels approximate.
    """
    rotary_dim = rope.resolved_rotary_dim(head_dim)
    rule = _scaling_rule(rope)
    base = _base_inv_freq(rotary_dim, float(rope.theta))
    if long:
        if rule is not _longrope_scaling:
            raise ValueError(f"rope_scaling: only LONGROPE has a long table, got {RopeScaling(rope.scaling).name}")
        exact = _longrope_scaling(base, rope, long=True)
    else:
        exact = rule(base, rope)
    return exact.astype(np.float32).astype(np.float64)


def _pair_indices(style: RopeStyle, rotary_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Dims (first, second) of each rotated pair: NEOX (i, i + R/2), GPTJ (2i, 2i + 1)."""
    half = rotary_dim // 2
    if style == RopeStyle.NEOX:
        return np.arange(half), np.arange(half, rotary_dim)
    if style == RopeStyle.GPTJ:
        return np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2)
    raise ValueError(f"rope_style: expected one of {[s.name for s in RopeStyle]}, got {style!r}")


def apply_rope(x, positions, head_dim: int, rope: RopeConfig, kv_lens=None) -> np.ndarray:
    """Rotate ``x`` [T, heads, D] at ``positions`` [T]; returns a new float64 array.

    Pair (a, b) with angle phi = position * inv_freq[i] becomes
    m * (a cos phi - b sin phi, b cos phi + a sin phi), m = ``attention_factor(rope)``. Dims >= R and
    ``RopeStyle.NONE`` pass through. ``kv_lens`` [T]: the kv length after the step of each token's sequence;
    LongRoPE needs it (tokens with kv_lens > ``long_table_above(rope)`` use the long table), the others ignore it.
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
    inv_freq = np.broadcast_to(rope_inv_freq(head_dim, rope), (out.shape[0], rope.resolved_rotary_dim(head_dim) // 2))
    switch = long_table_above(rope)
    if switch:
        if kv_lens is None or np.shape(kv_lens) != (out.shape[0],):
            raise ValueError(f"kv_lens: LongRoPE picks its table by each token's kv length: expected shape "
                             f"({out.shape[0]},), got {None if kv_lens is None else np.shape(kv_lens)}")
        long = (np.asarray(kv_lens) > switch)[:, None]
        inv_freq = np.where(long, rope_inv_freq(head_dim, rope, long=True)[None, :], inv_freq)
    first, second = _pair_indices(style, rope.resolved_rotary_dim(head_dim))
    angle = positions.astype(np.float64)[:, None] * inv_freq  # [T, R/2]
    mscale = attention_factor(rope)
    cos = (mscale * np.cos(angle))[:, None, :]  # broadcast over heads
    sin = (mscale * np.sin(angle))[:, None, :]
    a, b = out[:, :, first], out[:, :, second]
    out[:, :, first] = a * cos - b * sin
    out[:, :, second] = b * cos + a * sin
    return out
