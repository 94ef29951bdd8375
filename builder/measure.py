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


@dataclass
class RopeMeasurement:
    style: RopeStyle
    rotary_dim: int
    inv_freq: np.ndarray  # [R/2] measured
    max_position: int  # largest position measured
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


def measure_rope(view: GraphView, region: Region, step: ProbeStep, heads_map: np.ndarray,
                 chain: ProjectionChain | None = None) -> RopeMeasurement:
    """Run the RoPE region on unit vectors at positions 0 and LADDER; read pairs, rotary dim, frequencies.

    ``heads_map`` [heads, D] gives, for each (head, dim), the index into the region input's flattened
    feature axes. ``chain`` (the projection chain the region sits on): its hidden-state input is fed as zeros
    too, so that a Shape read inside the region (the sin/cos or the reshape taking the batch from q) stops at
    this layer's input instead of pulling in every layer before it (ORT's graph optimizations share such reads;
    the earlier layers would then run at the ladder's long positions on past caches of that length)."""
    layout = region.layout
    heads, D = heads_map.shape
    feat_shape = layout.colmap.shape
    perm_to_tokens = layout.tokens_first()
    inverse = np.argsort(perm_to_tokens)
    hidden_feed = {}
    if chain is not None:
        weight = view.constant(chain.weight)
        hidden_feed[chain.hidden] = np.zeros((D, 1, weight.shape[0]), dtype=weight.dtype)

    def run(position: int) -> np.ndarray:  # -> M [D out, D in] per head: [heads, D, D]
        x = np.zeros((D, 1, int(np.prod(feat_shape))), dtype=np.float32)  # [basis, seq, features]
        for d in range(D):
            x[d, 0, heads_map[:, d]] = 1.0
        x = x.reshape((D, 1) + feat_shape).transpose(inverse)
        dtype = _np_dtype(view.elem_type(region.input))
        (y,) = view.evaluate([region.output], {region.input: x.astype(dtype), **hidden_feed},
                             step.at(D, position, 1))
        y = np.asarray(y, dtype=np.float64).transpose(perm_to_tokens).reshape(D, -1)  # [basis, features]
        return np.stack([y[:, heads_map[h]].T for h in range(heads)])  # [heads, out d, in d]

    node = region.nodes[-1]
    dtype = np.dtype(_np_dtype(view.elem_type(region.output) or view.elem_type(region.input)))
    atol, norm_tol = _value_tolerance(dtype)
    zero = run(0)
    if not np.allclose(zero, np.eye(D), atol=atol):
        raise RewriteError(f"{describe(node)}: expected RoPE (identity at position 0); the region from "
                           f"{region.input!r} to {region.output!r} is not")
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
    candidates = {RopeStyle.NEOX: (np.arange(R // 2), np.arange(R // 2, R)),
                  RopeStyle.GPTJ: (np.arange(0, R, 2), np.arange(1, R, 2))}
    for style, (first, second) in candidates.items():
        sin = np.stack([m[second, first] for m in mats])  # x = e_a -> b gets sin
        cos = np.stack([m[first, first] for m in mats])
        ok = all(np.allclose(m[first, second], -m[second, first], atol=atol) and
                 np.allclose(m[second, second], m[first, first], atol=atol) for m in mats)
        if ok and np.allclose(sin ** 2 + cos ** 2, 1.0, atol=norm_tol):
            angles = np.arctan2(sin, cos)
            return RopeMeasurement(style, R, _unwrap_inv_freq(positions, angles), positions[-1], dtype)
    raise RewriteError(f"{describe(node)}: expected a rotate-half (NeoX) or interleaved (GPT-J) rotation of "
                       f"unit scale on the first {R} dims")


def rope_from_tables(cos: np.ndarray, sin: np.ndarray, style: RopeStyle) -> RopeMeasurement:
    """Measure from position-indexed cos/sin caches [max_positions, R/2]."""
    positions = [p for p in LADDER if p < cos.shape[0]]
    angles = np.arctan2(sin[positions].astype(np.float64), cos[positions].astype(np.float64))
    return RopeMeasurement(style, 2 * cos.shape[1], _unwrap_inv_freq(positions, angles), positions[-1], cos.dtype)


def _snap(theta: float, rel: float = 1e-5) -> float:
    r = round(theta)
    return float(r) if r > 0 and abs(theta - r) <= rel * theta else theta


def fit_rope_config(m: RopeMeasurement, head_dim: int, where: str) -> RopeConfig:
    """A RopeConfig whose inverse frequencies reproduce the measured ones (NONE, LINEAR, then LLAMA3).

    A 16-bit graph may hold its frequencies rounded to its dtype (transformers' ``model.to(float16)`` rounds the
    ``inv_freq`` buffer): those match too, and the plugin then computes the exact ones, as the float32 model does."""
    from pagedkv.reference.rope import rope_inv_freq

    f = m.inv_freq
    R = m.rotary_dim
    x = np.arange(0, R, 2) / R
    rotary_dim = 0 if R == head_dim else R
    # 2e-6 relative: the graph's float32 frequencies and angles; plus what a 1e-3 rad drift at max_position allows,
    # and the rounding of one cos/sin value to the graph's dtype (an angle error of up to eps rad)
    tol = 2e-6 * f + (1e-3 + m.eps) / m.max_position
    rounded = m.dtype != np.float32
    snap_rel = max(1e-5, m.eps) if rounded else 1e-5  # a 16-bit graph's frequencies fit theta to about eps

    def snap(value: float) -> float:
        return _snap(value, snap_rel)

    def matches(cfg: RopeConfig) -> bool:
        exact = rope_inv_freq(head_dim, cfg)
        if np.all(np.abs(exact - f) <= tol):
            return True
        return rounded and bool(np.all(np.abs(exact.astype(m.dtype).astype(np.float64) - f) <= tol))

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
    raise RewriteError(f"{where}: the measured RoPE frequencies match no supported scaling (none, linear, llama3); "
                       f"inv_freq[:4]={f[:4].tolist()}, inv_freq[-2:]={f[-2:].tolist()}")


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
