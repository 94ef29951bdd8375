"""The sampling head in float64: the executable spec of what ``pagedkv.builder.logits_head`` emits.

    R logits rows, V vocabulary, W penalty tokens per row, K candidates (min(candidates, V)), N top logprobs
    logits          [R, V]   the model's logits of the rows
    params          [R, SAMPLING_FIELDS]  pagedkv.engine_io.SAMPLING_* columns (temperature, top_k, top_p, min_p,
                             repetition / presence / frequency penalties, the uniform u)
    penalty_tokens  [R, W]   distinct prompt and output tokens of the row, -1 padded
    penalty_counts  [R, W]   occurrences of each in the row's output

The steps (``logits_head``'s docstring has the same list): penalties on the penalty tokens, greedy = argmax
when temperature <= 0, else scale by 1 / temperature, keep the tokens at or above one threshold (the k-th
candidate for top-k; the last candidate of the shortest prefix whose mass reaches top_p, renormalized over the
top-k set when top-k is on; max + log(min_p) for min-p), and return the first kept token whose cumulative
weight exceeds u times the kept mass. Logprobs are of the raw logits (before penalties and temperature).

``keep_mask`` is separate so that the masks can be checked against their textbook definitions and the
sampled distribution against the kept, renormalized softmax.
"""

from __future__ import annotations

import numpy as np

from pagedkv import engine_io as io


def _column(params: np.ndarray, index: int) -> np.ndarray:
    return np.asarray(params, dtype=np.float64)[:, index]


def apply_penalties(logits, params, penalty_tokens, penalty_counts) -> np.ndarray:
    """float64 [R, V]: the logits after repetition (x / p if x > 0 else x * p), presence and frequency penalties
    on each row's penalty tokens."""
    x = np.array(logits, dtype=np.float64)
    rep, pres, freq = (_column(params, c) for c in (io.SAMPLING_REPETITION, io.SAMPLING_PRESENCE,
                                                    io.SAMPLING_FREQUENCY))
    tokens = np.asarray(penalty_tokens)
    counts = np.asarray(penalty_counts, dtype=np.float64)
    for r in range(x.shape[0]):
        valid = tokens[r] >= 0
        t, c = tokens[r][valid], counts[r][valid]
        if len(np.unique(t)) != t.size:
            raise ValueError(f"penalty_tokens[{r}]: tokens must be distinct, got {t.tolist()}")
        v = x[r, t]
        v = np.where(v > 0, v / rep[r], v * rep[r])
        x[r, t] = v - pres[r] * (c > 0) - freq[r] * c
    return x


def keep_mask(scaled: np.ndarray, params, candidates: int) -> np.ndarray:
    """bool [R, V]: the tokens top-k, top-p and min-p keep, for temperature-scaled logits ``scaled``."""
    xs = np.asarray(scaled, dtype=np.float64)
    R, V = xs.shape
    K = min(int(candidates), V)
    top_k, top_p, min_p = (_column(params, c) for c in (io.SAMPLING_TOP_K, io.SAMPLING_TOP_P, io.SAMPLING_MIN_P))
    keep = np.zeros((R, V), dtype=bool)
    for r in range(R):
        vals = np.sort(xs[r])[::-1][:K]
        m = vals[0]
        k_on = 0 < top_k[r] < K
        k_eff = int(top_k[r]) if k_on else K
        e = np.exp(vals - m)
        e[k_eff:] = 0.0
        z = e.sum() if k_on else np.exp(xs[r] - m).sum()
        p = e / z
        mass_before = np.cumsum(p) - p
        p_on = top_p[r] < 1.0
        in_p = (mass_before < top_p[r]) | (not p_on)
        kept = int(np.sum(in_p[:k_eff]))
        threshold = vals[max(kept, 1) - 1] if (k_on or p_on) else -np.inf
        with np.errstate(divide="ignore"):
            threshold = max(threshold, m + np.log(min_p[r]))
        keep[r] = xs[r] >= threshold
    return keep


def sample_from(weights_kept: np.ndarray, u) -> np.ndarray:
    """int64 [R]: for each row the first token whose cumulative weight exceeds u * (total weight)."""
    w = np.asarray(weights_kept, dtype=np.float64)
    cum = np.cumsum(w, axis=1)
    target = np.asarray(u, dtype=np.float64) * cum[:, -1]
    return np.argmax(cum > target[:, None], axis=1).astype(np.int64)


def sampling_head(logits, params, penalty_tokens, penalty_counts, *, candidates: int, top_logprobs: int):
    """(next_tokens int64 [R], next_logprobs [R], top_tokens int64 [R, N], top_logprobs [R, N]), float64."""
    raw = np.asarray(logits, dtype=np.float64)
    shifted = raw - raw.max(axis=1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    x = apply_penalties(raw, params, penalty_tokens, penalty_counts)
    temperature = _column(params, io.SAMPLING_TEMPERATURE)
    greedy = temperature <= 0
    xs = x / np.where(greedy, 1.0, temperature)[:, None]
    keep = keep_mask(xs, params, candidates)
    weights = np.exp(xs - xs.max(axis=1, keepdims=True)) * keep
    tokens = np.where(greedy, np.argmax(x, axis=1), sample_from(weights, _column(params, io.SAMPLING_UNIFORM)))
    n = min(int(top_logprobs), raw.shape[1])
    top = np.argsort(-logprobs, axis=1, kind="stable")[:, :n]
    rows = np.arange(raw.shape[0])
    return tokens, logprobs[rows, tokens], top, np.take_along_axis(logprobs, top, axis=1)
