"""Measurements on the graph's own ops: RoPE (style, rotary dim, frequencies fitted to a ``RopeConfig``), the
mask (window and sink positions), the cache's way to attention (the GQA head mapping, transposes) and guards. Each runs a slice of the graph with
``GraphView.evaluate`` at chosen ``ProbeStep``s and checks what it finds; nothing changes the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx

from pagedkv.builder.graph_view import GraphView, ProbeStep, RewriteError, describe
from pagedkv.builder.patterns import CachePath
from pagedkv.builder.projection import ProjectionChain, Region
from pagedkv.config import RopeConfig, RopeScaling, RopeStyle


# ---- RoPE measurement ---------------------------------------------------------------------------------
LADDER = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)  # positions: each at most 4x the last (unwrapping)
CONTIGUOUS_PROBE = 256  # RoPE probes hold every position of their step up to this many tokens


@dataclass
class RopeMeasurement:
    style: RopeStyle
    rotary_dim: int
    inv_freq: np.ndarray  # [R/2] measured (with a switch: the table up to long_above)
    max_position: int  # largest position measured
    mscale: float = 1.0  # multiplier of cos and sin (an attention factor)
    long_inv_freq: np.ndarray | None = None  # [R/2] the table of sequences longer than long_above (LongRoPE)
    long_above: int = 0  # > 0: the kv length past which long_inv_freq applies; 0: one table
    long_max_position: int = 0  # largest position measured with the long table
    dtype: np.dtype = np.dtype(np.float32)  # of the measured cos/sin values (the graph's)

    @property
    def eps(self) -> float:
        """Relative precision of one measured cos/sin value: the graph dtype's machine epsilon."""
        return float(_finfo(self.dtype).eps)


def _finfo(dtype):
    import ml_dtypes

    return ml_dtypes.finfo(dtype)


def _value_tolerance(dtype) -> tuple[float, float]:
    """(entry, norm) tolerances of a measured rotation: float32's, or one ulp of a 16-bit graph (its cos/sin are
    rounded once to its dtype)."""
    eps = float(_finfo(dtype).eps)
    return max(1e-5, eps), max(1e-4, 2 * eps)


def _unwrap_inv_freq(positions: list[int], angles: np.ndarray) -> np.ndarray:
    """angles [len(positions), R/2] in (-pi, pi] -> inverse frequencies, unwrapping 2*pi turns
    from each position to the next (each position at most 4x the previous one)."""
    freq = angles[0] / positions[0]
    for p, a in zip(positions[1:], angles[1:]):
        predicted = freq * p
        turns = np.round((predicted - a) / (2 * np.pi))
        freq = (a + 2 * np.pi * turns) / p
    return freq


def _consistent(positions: list[int], angles: np.ndarray, freq: np.ndarray, eps: float) -> bool:
    """Whether one frequency per pair explains every measured angle (to the angle precision of float32 angles
    whose cos/sin carry a relative error ``eps``, the graph dtype's): false when the frequencies change with the
    position or the step (dynamic scaling)."""
    for p, a in zip(positions, angles):
        residual = np.angle(np.exp(1j * (a - freq * p)))
        if np.any(np.abs(residual) > 1e-4 + eps + 4e-7 * p * np.maximum(freq, 1.0)):
            return False
    return True


def measure_rope(view: GraphView, region: Region, step: ProbeStep, heads_map: np.ndarray,
                 chain: ProjectionChain | None = None) -> RopeMeasurement:
    """Run the RoPE region on unit vectors at positions 0 and LADDER; read pairs, rotary dim, frequencies and the
    multiplier of cos and sin (an attention factor, YaRN / LongRoPE); then look for a table that depends on the
    sequence's length (LongRoPE: one table up to a kv length N, another past it). The checks allow for the
    graph's dtype: a 16-bit graph rounds each cos/sin value once (``_value_tolerance``).

    ``heads_map`` [heads, D] gives, for each (head, dim), the index into the region input's flattened
    feature axes. ``chain`` (the projection chain the region sits on): its hidden-state input is fed as zeros
    too, so that a Shape read inside the region (the sin/cos or the reshape taking the batch from q) stops at
    this layer's input instead of pulling in every layer before it (ORT's graph optimizations share such reads;
    the earlier layers would then run at the ladder's long positions on past caches of that length)."""
    layout, out_layout = region.layout, region.output_layout or region.layout
    heads, D = heads_map.shape
    feat_shape = layout.colmap.shape
    inverse = np.argsort(layout.tokens_first())
    out_to_tokens = out_layout.tokens_first()
    weight = chain.weight_matrix(view) if chain is not None else None
    feed_dtype = _np_dtype(view.elem_type(region.input))
    dtype = np.dtype(_np_dtype(view.elem_type(region.output) or view.elem_type(region.input)))  # of the values

    def evaluate(x: np.ndarray, probe: ProbeStep) -> np.ndarray:  # x [batch, seq, features] -> the same
        batch, seq = x.shape[:2]
        feeds = {region.input: x.reshape((batch, seq) + feat_shape).transpose(inverse).astype(feed_dtype)}
        if weight is not None:
            feeds[chain.hidden] = np.zeros((batch, seq, weight.shape[0]), dtype=weight.dtype)
        (y,) = view.evaluate([region.output], feeds, probe)
        return np.asarray(y, dtype=np.float64).transpose(out_to_tokens).reshape(batch, seq, -1)

    def run(position: int) -> np.ndarray:  # -> M [D out, D in] per head: [heads, D, D]
        x = np.zeros((D, 1, int(np.prod(feat_shape))), dtype=np.float32)  # [basis, seq, features]
        for d in range(D):
            x[d, 0, heads_map[:, d]] = 1.0
        y = evaluate(x, step.at(D, position, 1))[:, 0]  # [basis, features]
        return np.stack([y[:, heads_map[h]].T for h in range(heads)])  # [heads, out d, in d]

    node = region.nodes[-1]
    atol, norm_tol = _value_tolerance(dtype)
    eps = float(_finfo(dtype).eps)
    zero = run(0)[0]
    scale_at_zero = np.diag(zero)
    if not (np.allclose(zero, np.diag(scale_at_zero), atol=atol) and np.all(scale_at_zero > 0)):
        raise RewriteError(f"{describe(node)}: expected RoPE (a positive diagonal at position 0: the identity, or "
                           f"an attention factor on the rotated dims); the region from {region.input!r} to "
                           f"{region.output!r} is not")
    positions, mats = [], []
    for p in LADDER:
        try:
            m = run(p)
        except RewriteError:
            raise
        except Exception:  # noqa: BLE001 - a finite sin/cos table ends the ladder
            if not positions:
                raise
            break
        if not np.allclose(m, m[:1], atol=atol):
            raise RewriteError(f"{describe(node)}: expected the same rotation for every head")
        positions.append(p)
        mats.append(m[0])
    # Dims past the rotary dim are copied: exactly the identity. Rotated dims move at some position, however
    # slowly (a llama3-scaled low frequency turns by ~1e-4 rad at position 1024: exact comparison sees it).
    moving = np.zeros(D, dtype=bool)
    for m in mats:
        off = m - np.diag(np.diag(m))
        moving |= (np.diag(m) != 1.0) | np.any(off != 0, axis=0) | np.any(off != 0, axis=1)
    R = int(moving.sum())
    if R == 0 or R % 2 or not moving[:R].all():
        raise RewriteError(f"{describe(node)}: expected RoPE on the leading dims of each head, rotated dims "
                           f"are {np.flatnonzero(moving).tolist()}")
    mscale = float(np.mean(scale_at_zero[:R]))
    if not (np.allclose(scale_at_zero[:R], mscale, rtol=atol, atol=0) and np.all(scale_at_zero[R:] == 1.0)):
        raise RewriteError(f"{describe(node)}: expected one factor on every rotated dim at position 0 (an attention "
                           f"factor), got {scale_at_zero[:R][:8].tolist()}...")
    # Entries are cos and sin times the factor, each rounded once (relative to the factor); dividing by the
    # measured factor, itself rounded, adds its relative error twice to the norm.
    entry_tol, unit_tol = atol * max(1.0, mscale), norm_tol + 2 * eps
    candidates = {RopeStyle.NEOX: (np.arange(R // 2), np.arange(R // 2, R)),
                  RopeStyle.GPTJ: (np.arange(0, R, 2), np.arange(1, R, 2))}
    for style, (first, second) in candidates.items():
        sin = np.stack([m[second, first] for m in mats]) / mscale  # x = e_a -> b gets sin
        cos = np.stack([m[first, first] for m in mats]) / mscale
        ok = all(np.allclose(m[first, second], -m[second, first], atol=entry_tol) and
                 np.allclose(m[second, second], m[first, first], atol=entry_tol) for m in mats)
        if ok and np.allclose(sin ** 2 + cos ** 2, 1.0, atol=unit_tol):
            break
    else:
        raise RewriteError(f"{describe(node)}: expected a rotate-half (NeoX) or interleaved (GPT-J) rotation of "
                           f"one scale on the first {R} dims")

    def pair_angles(position: int, kv_len: int) -> np.ndarray:
        """[R/2] angles of ``position`` in a step whose kv length is ``kv_len`` (>= position + 1), read off the
        step's first token, at ``position``; the step's length is the positions' maximum + 1 and past + seq (a
        step-dependent table reads either). The step holds every position from ``position`` to kv_len - 1
        (past = position) where the graph derives positions from the past length (no position_ids input, as in
        some Optimum exports: the only probe it reads right, kv_len - position tokens long) or the step is at most
        CONTIGUOUS_PROBE tokens; else a second token at kv_len - 1 alone sets the length. One unit vector per
        pair suffices: the rotation acts on each pair alone."""
        contiguous = "position_ids" not in step.roles.values() or kv_len - position <= CONTIGUOUS_PROBE
        seq = kv_len - position if contiguous else 2
        x = np.zeros((1, seq, int(np.prod(feat_shape))), dtype=np.float32)
        x[0, :, heads_map[:, first].ravel()] = 1.0
        positions = list(range(position, kv_len)) if contiguous else [position, kv_len - 1]
        probe = step.at(1, kv_len - seq, seq, positions=positions)
        y = evaluate(x, probe)[0, 0]
        c, s = y[heads_map[:, first]], y[heads_map[:, second]]  # [heads, R/2]
        if not (np.allclose(c, c[:1], atol=entry_tol) and np.allclose(s, s[:1], atol=entry_tol)):
            raise RewriteError(f"{describe(node)}: expected the same rotation for every head")
        if not np.allclose(np.hypot(c[0], s[0]), mscale, rtol=norm_tol, atol=0):
            raise RewriteError(f"{describe(node)}: expected the factor {mscale:.6g} on cos and sin at every step, "
                               f"found {np.hypot(c[0], s[0])[:4].tolist()}... at kv length {kv_len}")
        return np.arctan2(s[0], c[0])

    angles = np.arctan2(sin, cos)
    freq = _unwrap_inv_freq(positions, angles)
    long_above = _table_switch(pair_angles, positions[-1], node, atol)
    if long_above == 0:
        if not _consistent(positions, angles, freq, eps):
            raise RewriteError(f"{describe(node)}: expected RoPE with fixed frequencies; the measured angles at "
                               f"positions {positions} fit no single frequency table (dynamic scaling?)")
        return RopeMeasurement(style, R, freq, positions[-1], mscale, dtype=dtype)
    # Two tables: positions below the switch with kv length position + 1, the long one at kv length > N.
    short_pos = [p for p in positions if p < long_above] or [max(1, long_above - 1)]
    short = np.stack([pair_angles(p, p + 1) for p in short_pos])
    long_pos = positions
    long = np.stack([pair_angles(p, max(p + 1, long_above + 1)) for p in long_pos])
    short_freq, long_freq = _unwrap_inv_freq(short_pos, short), _unwrap_inv_freq(long_pos, long)
    if not (_consistent(short_pos, short, short_freq, eps) and _consistent(long_pos, long, long_freq, eps)):
        raise RewriteError(f"{describe(node)}: expected two fixed frequency tables, switching past kv length "
                           f"{long_above}; the angles fit no such pair (dynamic scaling?)")
    return RopeMeasurement(style, R, short_freq, short_pos[-1], mscale, long_freq, long_above, long_pos[-1], dtype)


def _table_switch(pair_angles, max_position: int, node, atol: float) -> int:
    """The largest kv length N whose steps rotate position 1 like a step of kv length 2, when longer steps rotate
    it otherwise (LongRoPE's switch); 0 when every step up to ``max_position`` + 1 rotates it alike. ``atol``:
    the angle precision of the graph's dtype (one table gives the same rounded values at every step)."""
    reference = pair_angles(1, 2)

    def same(kv_len: int) -> bool:
        return bool(np.allclose(pair_angles(1, kv_len), reference, rtol=0, atol=atol))

    lengths = [2] + [p + 1 for p in LADDER if 2 < p + 1 <= max_position + 1]
    for short, longer in zip(lengths, lengths[1:]):
        if not same(longer):
            break
    else:
        return 0
    while longer - short > 1:  # same(short), not same(longer)
        mid = (short + longer) // 2
        short, longer = (mid, longer) if same(mid) else (short, mid)
    if any(same(n) for n in (longer + 1, 2 * longer, max_position + 1)):
        raise RewriteError(f"{describe(node)}: the RoPE table changes past kv length {short} and changes back "
                           "later; expected one switch (LongRoPE)")
    return short


def rope_from_tables(cos: np.ndarray, sin: np.ndarray, style: RopeStyle) -> RopeMeasurement:
    """Measure from position-indexed cos/sin caches [max_positions, R/2] (scaled by an attention factor or not)."""
    positions = [p for p in LADDER if p < cos.shape[0]]
    cos64, sin64 = cos.astype(np.float64), sin.astype(np.float64)
    mscale = float(np.mean(np.hypot(cos64[0], sin64[0])))
    angles = np.arctan2(sin64[positions], cos64[positions])
    return RopeMeasurement(style, 2 * cos.shape[1], _unwrap_inv_freq(positions, angles), positions[-1], mscale,
                           dtype=np.dtype(cos.dtype))


def _snap(theta: float, rel: float = 1e-5) -> float:
    r = round(theta)
    return float(r) if r > 0 and abs(theta - r) <= rel * theta else theta


def _fit_tolerance(f: np.ndarray, max_position: int, eps: float) -> np.ndarray:
    # 2e-6 relative: the graph's float32 frequencies and angles; plus what a 1e-3 rad drift at max_position allows,
    # and the rounding of one cos/sin value to the graph's dtype (an angle error of up to eps rad)
    return 2e-6 * f + (1e-3 + eps) / max(max_position, 1)


def fit_rope_config(m: RopeMeasurement, head_dim: int, where: str) -> RopeConfig:
    """A RopeConfig whose tables and attention factor reproduce the measured ones: one table (NONE, LINEAR,
    LLAMA3, then YARN: with factor 1 it is any base table times an attention factor), or two (LONGROPE).

    A 16-bit graph may hold its frequencies rounded to its dtype (transformers' ``model.to(float16)`` rounds the
    ``inv_freq`` buffer): those match too, and the plugin then computes the exact ones, as the float32 model does.
    Its measured attention factor is the rounded one: it matches a config's to the dtype's precision."""
    from pagedkv.reference.rope import attention_factor, rope_inv_freq

    f = m.inv_freq
    R = m.rotary_dim
    x = np.arange(0, R, 2) / R
    rotary_dim = 0 if R == head_dim else R
    rounded = m.dtype != np.float32
    snap_rel = max(1e-5, m.eps) if rounded else 1e-5  # a 16-bit graph's frequencies fit theta to about eps
    factor_rtol = max(1e-5, m.eps)

    def snap(value: float) -> float:
        return _snap(value, snap_rel)

    def close(exact: np.ndarray, measured: np.ndarray, max_position: int) -> bool:
        tol = _fit_tolerance(measured, max_position, m.eps)
        if np.all(np.abs(exact - measured) <= tol):
            return True
        return rounded and bool(np.all(np.abs(exact.astype(m.dtype).astype(np.float64) - measured) <= tol))

    def matches(cfg: RopeConfig) -> bool:
        try:
            if not np.isclose(attention_factor(cfg), m.mscale, rtol=factor_rtol, atol=0):
                return False
            if not close(rope_inv_freq(head_dim, cfg), f, m.max_position):
                return False
            return m.long_inv_freq is None or close(rope_inv_freq(head_dim, cfg, long=True), m.long_inv_freq,
                                                    m.long_max_position)
        except ValueError:  # a candidate outside the config's ranges
            return False

    if m.long_above:
        cfg = _fit_longrope(m, rotary_dim, head_dim)
        if matches(cfg):
            return cfg
        raise RewriteError(f"{where}: two RoPE tables switching past kv length {m.long_above}, but no LongRoPE config "
                           f"reproduces them")

    def fit_theta(values) -> float:
        y = -np.log(values)
        return snap(float(np.exp((x[1:] @ y[1:]) / (x[1:] @ x[1:])))) if len(x) > 1 else 10000.0

    # theta by a least-squares fit over every frequency, or from the two highest (best measured: a 16-bit
    # sin/cos table leaves the lowest ones noisy at its few positions)
    thetas = [fit_theta(f)] + ([snap(float((f[0] / f[1]) ** (R / 2)))] if len(f) > 1 else [])
    for theta in dict.fromkeys(thetas):
        base = RopeConfig(style=m.style, rotary_dim=rotary_dim, theta=theta)
        if matches(base):
            return base
    factor = float(1.0 / f[0])
    linear = RopeConfig(style=m.style, rotary_dim=rotary_dim, theta=fit_theta(f * factor),
                        scaling=RopeScaling.LINEAR, factor=snap(factor))
    if matches(linear):
        return linear
    if len(f) > 2 and abs(f[0] - 1.0) < 1e-6:
        theta = snap(float((f[0] / f[1]) ** (R / 2)))
        unscaled = theta ** (-x)
        factor = snap(float(unscaled[-1] / f[-1]))
        llama3 = RopeConfig(style=m.style, rotary_dim=rotary_dim, theta=theta, scaling=RopeScaling.LLAMA3,
                            factor=factor)
        if matches(llama3):
            return llama3
        # other (low, high, original) triples: smooth = a * inv_freq + b on the blended band
        ratio = f / unscaled
        smooth = (ratio - 1.0 / factor) / (1.0 - 1.0 / factor)
        band = (smooth > 1e-4) & (smooth < 1 - 1e-4)
        if band.sum() >= 2:
            a, b = np.polyfit(unscaled[band], smooth[band], 1)
            low = 1.0
            high = low - low / b
            original = int(round(a * 2 * math.pi * (high - low)))
            llama3 = RopeConfig(style=m.style, rotary_dim=rotary_dim, theta=theta, scaling=RopeScaling.LLAMA3,
                                factor=factor, low_freq_factor=low, high_freq_factor=float(high),
                                original_max_positions=original)
            if matches(llama3):
                return llama3
    for yarn in _yarn_candidates(m, rotary_dim, fit_theta, snap):
        if matches(yarn):
            return yarn
    raise RewriteError(f"{where}: the measured RoPE frequencies match no supported scaling (none, linear, llama3, "
                       f"yarn){'' if m.mscale == 1.0 else f' with the attention factor {m.mscale:.6g}'}; "
                       f"inv_freq[:4]={f[:4].tolist()}, inv_freq[-2:]={f[-2:].tolist()}")


def _attention_factor_field(scaling: RopeScaling, factor: float, original: int, mscale: float,
                            rtol: float) -> float:
    """0 (the default) when Hugging Face's default attention factor for (scaling, factor) is the measured one (to
    ``rtol``: the measured one is rounded to the graph's dtype), else the measured one (DeepSeek's mscale ratio, a
    configured attention_factor)."""
    from pagedkv.reference.rope import attention_factor

    default = attention_factor(RopeConfig(scaling=scaling, factor=factor, original_max_positions=original))
    return 0.0 if np.isclose(default, mscale, rtol=rtol, atol=0) else float(np.float32(mscale))


def _yarn_candidates(m: RopeMeasurement, rotary_dim: int, fit_theta, snap):
    """YaRN configs that may reproduce the measured table: theta from the unchanged or the fully interpolated
    pairs (consecutive pairs there differ by theta^(-2/R)), factor from the last pair, the ramp's bounds from
    where f / base moves between 1 and 1 / factor, then (beta_fast, beta_slow, original) that give those
    bounds: Hugging Face's defaults 32 / 1 when an original context fits both, else that original with betas
    placed inside the bounds' rounding intervals. ``snap``: rounds a value near an integer to it (to the graph
    dtype's precision)."""
    f, R = m.inv_freq, m.rotary_dim
    pairs = np.arange(R // 2, dtype=np.float64)
    estimates = [fit_theta(f)]
    if len(f) > 2:
        estimates += [float((f[-2] / f[-1]) ** (R / 2)), float((f[0] / f[1]) ** (R / 2))]
    thetas = []  # the round values near each estimate first (configs say 1e6, not 1000001.3)
    for digits in (2, 3, 4):
        thetas += [float(f"{t:.{digits - 1}e}") for t in estimates]
    thetas += [snap(t) for t in estimates]
    for theta in dict.fromkeys(thetas):
        base = theta ** (-pairs * 2 / R)
        factor = snap(float(base[-1] / f[-1]))
        if not (math.isfinite(factor) and factor > 0):
            continue
        if abs(factor - 1.0) < 1e-6:  # an unscaled table with an attention factor
            yield RopeConfig(style=m.style, rotary_dim=rotary_dim, theta=theta, scaling=RopeScaling.YARN,
                             factor=1.0, attention_factor=float(np.float32(m.mscale)))
            continue
        ramp = (1.0 - f / base) / (1.0 - 1.0 / factor)
        inside = (ramp > 1e-4) & (ramp < 1 - 1e-4)
        if inside.sum() >= 2:
            slope, offset = np.polyfit(pairs[inside], ramp[inside], 1)
            low, high = -offset / slope, (1.0 - offset) / slope
        else:  # a step from 0 to 1 between two pairs
            below = np.flatnonzero(ramp <= 1e-4)
            low = float(below[-1]) if below.size else 0.0
            high = low + 1.0
        truncate = bool(abs(low - round(low)) < 1e-3 and abs(high - round(high)) < 1e-3)
        if truncate:
            low, high = float(round(low)), float(round(high))
        yield from _yarn_from_bounds(m, rotary_dim, theta, factor, low, high, truncate)


def _yarn_from_bounds(m: RopeMeasurement, rotary_dim: int, theta: float, factor: float, low: float, high: float,
                      truncate: bool):
    R = m.rotary_dim
    log_theta = 2 * math.log(theta) / R

    def config(original: float, beta_fast: float, beta_slow: float) -> RopeConfig:
        original = max(1, int(round(original)))
        return RopeConfig(style=m.style, rotary_dim=rotary_dim, theta=theta, scaling=RopeScaling.YARN,
                          factor=factor, original_max_positions=original, beta_fast=float(beta_fast),
                          beta_slow=float(beta_slow), truncate=truncate,
                          attention_factor=_attention_factor_field(RopeScaling.YARN, factor, original, m.mscale,
                                                                   max(1e-6, m.eps)))

    # d(b) = (ln N - ln(2 pi b)) / log_theta: ln N for the default betas from each bound (mid-interval if rounded)
    shift = 0.5 if truncate else 0.0
    from_low = (low + shift) * log_theta + math.log(2 * math.pi * 32.0)
    from_high = (high - shift) * log_theta + math.log(2 * math.pi * 1.0)
    for log_n in (from_high, from_low, (from_low + from_high) / 2):
        for nice in (2.0 ** round(log_n / math.log(2)), 1024.0 * round(math.exp(log_n) / 1024), math.exp(log_n)):
            if nice >= 1:
                yield config(nice, 32.0, 1.0)
    original = 2.0 ** round(from_high / math.log(2))
    yield config(original, original / (2 * math.pi * math.exp((low + shift) * log_theta)),
                 original / (2 * math.pi * math.exp((high - shift) * log_theta)))


def _fit_longrope(m: RopeMeasurement, rotary_dim: int, head_dim: int) -> RopeConfig:
    """LongRoPE from its two tables: factors = base / table. The base's theta is not identifiable (any theta
    with matching factors gives the same tables): Hugging Face's default 10000 is taken. The attention factor is
    the measured one."""
    R = m.rotary_dim
    base = 10000.0 ** (-np.arange(0, R, 2, dtype=np.float64) / R)
    return RopeConfig(style=m.style, rotary_dim=rotary_dim, theta=10000.0, scaling=RopeScaling.LONGROPE,
                      original_max_positions=int(m.long_above),
                      attention_factor=0.0 if m.mscale == 1.0 else float(np.float32(m.mscale)),
                      short_factors=tuple(base / m.inv_freq), long_factors=tuple(base / m.long_inv_freq))


def _np_dtype(elem_type: int | None):
    if elem_type is None:
        return np.float32
    return onnx.helper.tensor_dtype_to_np_dtype(elem_type)


# ---- mask measurement ---------------------------------------------------------------------------------
@dataclass
class MaskMeasurement:
    window: int  # 0: full causal
    sinks: int


def _visible(mask: np.ndarray, boolean_true_visible: bool, node) -> np.ndarray:
    m = np.asarray(mask)
    while m.ndim > 2:
        m = m[0]
    if m.dtype == np.bool_:
        return m if boolean_true_visible else ~m
    m = m.astype(np.float64)
    visible, hidden = m == 0, m <= -1e4
    if not np.all(visible | hidden):
        bad = m[~(visible | hidden)][:3].tolist()
        raise RewriteError(f"{describe(node)}: expected the mask to add 0 (visible) or a large negative value "
                           f"(masked), it adds {bad} (a position bias such as ALiBi is not supported)")
    return visible


def measure_mask(view: GraphView, mask: str, step: ProbeStep, node, true_is_visible: bool = True,
                 ladder=(8, 64, 512, 4096, 32768)) -> MaskMeasurement:
    """Evaluate the in-graph mask at decode steps of growing length (the window; up to the model's own length limit,
    where the graph stops running), then check it against ``attends`` at prefill and chunked steps."""
    from pagedkv.layout import attends

    window, sinks = 0, 0
    for total in ladder:
        try:
            (m,) = view.evaluate([mask], {}, step.at(1, total - 1, 1))
        except Exception:  # noqa: BLE001 - a model's own length limit (a mask buffer of n_positions) ends the ladder
            if total == ladder[0]:
                raise
            break
        row = _visible(m, true_is_visible, node)[-1]
        if row.shape[0] != total:
            raise RewriteError(f"{describe(node)}: expected a mask row over {total} positions, got {row.shape[0]}")
        if not row.all():
            visible = np.flatnonzero(row)
            tail = visible[visible >= total - visible.size]
            window = int(len(tail)) if tail.size and tail[-1] == total - 1 else 0
            sinks = int(visible.size - tail.size)
            if window == 0 or not np.array_equal(visible[:sinks], np.arange(sinks)):
                raise RewriteError(f"{describe(node)}: expected a causal mask with an optional window and sink "
                                   f"positions; the last query of {total} sees {visible.tolist()[:16]}...")
            break
    checks = [(0, 7), (5, 4), (window + 3, 5)] if window else [(0, 7), (5, 4)]
    for past, seq in checks:
        (m,) = view.evaluate([mask], {}, step.at(1, past, seq))
        got = _visible(m, true_is_visible, node)
        q_pos = np.arange(past, past + seq)[:, None]
        kv_pos = np.arange(past + seq)[None, :]
        want = attends(q_pos, kv_pos, window, sinks)
        if got.shape != want.shape or not np.array_equal(got, want):
            raise RewriteError(f"{describe(node)}: expected a causal mask (window={window}, sinks={sinks}); at "
                               f"past={past}, seq={seq} it differs:\n{got.astype(int)}")
    return MaskMeasurement(window, sinks)


CACHE_PROBE = (2, 3)  # (past, seq) of the cache-path probe: 5 positions, none equal to a head count or dim


def measure_cache_path(view: GraphView, path: CachePath, kv_heads: int, heads: int, head_dim: int, step: ProbeStep,
                       node, feeds: dict | None = None) -> None:
    """Check what the ops between a present cache [1, KVH, L, D] and the attention input do (``CachePath``): run them
    on three encodings of the cache, its KV-head index, its position index l and its dim index d (small integers,
    at most 255: exact in fp16 and bf16, where a joint code l * D + d would round), and compare with the GQA repeat
    (query head h reads KV head h // (H / KVH), as the plugin does) and the expected transposition. ``feeds``: extra tensors (the layer's hidden state) that cut the probe short."""
    past, seq = CACHE_PROBE
    length = past + seq
    dtype = _np_dtype(view.elem_type(path.start))
    cache_shape = (1, kv_heads, length, head_dim)
    codes = [np.broadcast_to(np.arange(n, dtype=np.float64).reshape(view_shape), cache_shape) for n, view_shape in
             ((kv_heads, (1, kv_heads, 1, 1)), (length, (1, 1, length, 1)), (head_dim, (1, 1, 1, head_dim)))]
    group = heads // kv_heads if kv_heads and heads % kv_heads == 0 else 0
    layouts = [("repeated", np.arange(heads) // group)] if group else []
    if path.kv_heads_ok:
        layouts.append(("kept", np.arange(kv_heads)))
    got = []
    for code in codes:
        (y,) = view.evaluate([path.end], {path.start: np.ascontiguousarray(code.astype(dtype)), **(feeds or {})},
                             step.at(1, past, seq))
        got.append(np.asarray(y, dtype=np.float64) / path.scale)
    for _, index in layouts:
        want = [code[:, index] for code in codes]
        if path.transposed:
            want = [w.swapaxes(-1, -2) for w in want]
        if all(g.shape == w.shape and np.allclose(g, w, rtol=0, atol=0.5) for g, w in zip(got, want)):
            return
    shape = [1, heads, head_dim, length] if path.transposed else [1, heads, length, head_dim]
    heads_got = got[0][0, :, 0, 0].tolist() if got[0].ndim == 4 else list(got[0].shape)
    raise RewriteError(f"{describe(node)}: expected the cache {path.start!r} to reach {path.end!r} as {shape} "
                       f"({'K transposed, ' if path.transposed else ''}query head h reading KV head h // "
                       f"{group or '?'}), got shape {list(got[0].shape)}, heads {heads_got}")


GUARD_STEPS = ((0, 7), (5, 4), (40, 1))  # (past, seq): prefill, a chunk over a cached prefix, a long decode


def measure_guard(view: GraphView, condition: str, step: ProbeStep, node) -> None:
    """Check that the condition of a ``Where(condition, 0, attention)`` guard is false for every query at prefill,
    chunked and decode steps (it zeroes the rows of queries that see no key; under a causal mask every query sees
    itself), so dropping the guard changes nothing."""
    for past, seq in GUARD_STEPS:
        (value,) = view.evaluate([condition], {}, step.at(1, past, seq))
        if np.any(np.asarray(value)):
            raise RewriteError(f"{describe(node)}: expected the guard condition {condition!r} on its output to be "
                               f"false for every query, it is true at past={past}, seq={seq} for "
                               f"{int(np.count_nonzero(value))} element(s)")
