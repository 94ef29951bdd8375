"""Sampling: the float64 spec (``pagedkv.reference.sampling``) against the textbook definitions, the graph's
sampling head against the spec, the seeded uniforms against SplitMix64, and the whole pipeline's distribution.

* Masks: top-k, top-p (Hugging Face's ``TopPLogitsWarper`` algorithm: ascending sort, remove cumulative mass
  <= 1 - top_p, keep one), top-k then top-p (renormalized, HF's warper order), min-p (``MinPLogitsWarper``) and
  the penalties (HF's repetition penalty, OpenAI's presence / frequency) — exact, on logits without ties.
* The graph (ONNX Runtime running what the rewrite emitted, float32) picks exactly the spec's token for
  thousands of random rows (one step: ``logits_rows`` repeats positions, each row has its own parameters and
  uniform), apart from uniforms within float32 rounding of a CDF boundary; top-k/top-p with fewer candidates
  than the vocabulary too; a sweep of u reaches exactly the tokens the spec keeps.
* Distribution: 3000 requests of one prompt with different seeds; the first sampled tokens follow the kept,
  renormalized softmax of the model's logits (chi-square, fixed seeds).
* Reproducibility: a seeded request gives the same tokens alone and batched with others (chunked, mid-stream).
"""

from __future__ import annotations

import numpy as np
import pytest
from runtime_support import SMALL, synthetic_rewritten

from pagedkv import engine_io as io
from pagedkv.reference.sampling import apply_penalties, keep_mask, sample_from, sampling_head
from pagedkv.runtime import Engine, OrtExecutor, SamplingInputs, SamplingParams, SchedulerConfig, StepInputs
from pagedkv.runtime.sampling import U_MAX, derive_seed, uniforms

M64 = (1 << 64) - 1


def _splitmix64(seed: int, n: int) -> list[float]:
    """SplitMix64 (Steele, Lea, Flood 2014) written out in Python integers: n draws in [0, 1)."""
    state, out = seed, []
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & M64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        z ^= z >> 31
        out.append((z >> 11) * 2.0 ** -53)
    return out


@pytest.mark.parametrize("seed", [0, 1, 12345, 2 ** 63 + 7, M64])
def test_uniforms_are_the_splitmix64_stream(seed):
    n = 50
    np.testing.assert_array_equal(uniforms(np.full(n, seed, np.uint64), np.arange(n, dtype=np.uint64)),
                                  _splitmix64(seed, n))


def test_uniforms_are_uniform_and_seeds_independent():
    u = uniforms(np.full(200_000, 99, np.uint64), np.arange(200_000, dtype=np.uint64))
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    chi2 = float(np.sum((counts - 10_000) ** 2 / 10_000))
    assert chi2 < 45.3, chi2  # 19 degrees of freedom, p = 0.001
    a = uniforms(np.full(50_000, 1, np.uint64), np.arange(50_000, dtype=np.uint64))
    b = uniforms(np.full(50_000, 2, np.uint64), np.arange(50_000, dtype=np.uint64))
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.02
    assert derive_seed(0, 1) != derive_seed(0, 2) != derive_seed(1, 1)


# ---- the spec against the textbook definitions ---------------------------------------------------------
def _params(n, **cols) -> np.ndarray:
    p = np.zeros((n, io.SAMPLING_FIELDS), np.float64)
    p[:, io.SAMPLING_TEMPERATURE] = 1.0
    p[:, io.SAMPLING_TOP_P] = 1.0
    p[:, io.SAMPLING_REPETITION] = 1.0
    for name, value in cols.items():
        p[:, io.SAMPLING_COLUMNS[name]] = value
    return p


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _hf_top_p(x, top_p):
    """Hugging Face TopPLogitsWarper, written out: ascending sort, remove where cumulative mass <= 1 - top_p."""
    order = np.argsort(x)
    cum = np.cumsum(_softmax(x[order]))
    remove = cum <= 1 - top_p
    remove[-1] = False  # min_tokens_to_keep = 1
    keep = np.ones_like(x, dtype=bool)
    keep[order[remove]] = False
    return keep


@pytest.mark.parametrize("seed", range(5))
def test_masks_equal_their_textbook_definitions(seed):
    rng = np.random.default_rng(seed)
    V = 97
    x = rng.standard_normal((1, V)) * rng.uniform(0.5, 3)
    for k in (1, 2, 10, 96):
        keep = keep_mask(x, _params(1, top_k=k), V)[0]
        assert set(np.flatnonzero(keep)) == set(np.argsort(-x[0])[:k])
    for p in (0.05, 0.3, 0.9, 0.999):
        np.testing.assert_array_equal(keep_mask(x, _params(1, top_p=p), V)[0], _hf_top_p(x[0], p))
        k = 12  # top-k then top-p, renormalized over the k kept (HF applies the warpers in this order)
        in_k = np.zeros(V, bool)
        in_k[np.argsort(-x[0])[:k]] = True
        masked = np.where(in_k, x[0], -np.inf)
        expect = _hf_top_p(masked, p) & in_k
        np.testing.assert_array_equal(keep_mask(x, _params(1, top_k=k, top_p=p), V)[0], expect)
    for m in (0.01, 0.2, 0.9):
        probs = _softmax(x[0])
        np.testing.assert_array_equal(keep_mask(x, _params(1, min_p=m), V)[0], probs >= m * probs.max())
    assert keep_mask(x, _params(1), V).all()  # everything off: the whole vocabulary


def test_penalties_equal_their_definitions():
    rng = np.random.default_rng(3)
    V, R = 40, 6
    x = rng.standard_normal((R, V))
    tokens = np.full((R, 5), -1)
    counts = np.zeros((R, 5))
    for r in range(R):
        t = rng.choice(V, 4, replace=False)
        tokens[r, :4], counts[r, :4] = t, [0, 1, 2, 5]
    params = _params(R, repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=0.3)
    got = apply_penalties(x, params, tokens, counts)
    expect = x.copy()
    for r in range(R):
        for t, c in zip(tokens[r, :4], counts[r, :4]):
            v = x[r, t]
            v = v * 1.7 if v < 0 else v / 1.7  # HF RepetitionPenaltyLogitsProcessor
            expect[r, t] = v - 0.3 * c - 0.4 * (c > 0)  # OpenAI: frequency * count + presence * (count > 0)
    np.testing.assert_allclose(got, expect, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="distinct"):
        apply_penalties(x[:1], params[:1], np.array([[3, 3]]), np.zeros((1, 2)))


def test_sample_from_is_the_inverse_cdf():
    w = np.array([[0.0, 1.0, 0.0, 3.0]])
    assert [int(sample_from(w, [u])[0]) for u in (0.0, 0.2499, 0.25, 0.9999)] == [1, 1, 3, 3]


# ---- the graph against the spec -----------------------------------------------------------------------
def _one_step(executor, prompt, rows, sampling):
    mgr = executor.manager
    mgr.add_sequence("s")
    mgr.reserve("s", len(prompt))
    batch = mgr.build_step([("s", len(prompt))])
    out = executor.execute(StepInputs(batch, np.asarray(prompt), rows, sampling, want_logits=True))
    mgr.free("s")
    return out


def _random_rows(rng, R, V, W):
    params = _params(R).astype(np.float32)
    params[:, io.SAMPLING_TEMPERATURE] = rng.choice([0, 0.3, 1.0, 2.5], R)
    params[:, io.SAMPLING_TOP_K] = rng.choice([0, 1, 5, 30, 200], R)
    params[:, io.SAMPLING_TOP_P] = rng.choice([1.0, 0.95, 0.5, 0.1], R)
    params[:, io.SAMPLING_MIN_P] = rng.choice([0, 0.05, 0.3], R)
    params[:, io.SAMPLING_REPETITION] = rng.choice([1.0, 1.3, 0.8], R)
    params[:, io.SAMPLING_PRESENCE] = rng.choice([0, 0.5, -0.5], R)
    params[:, io.SAMPLING_FREQUENCY] = rng.choice([0, 0.3], R)
    params[:, io.SAMPLING_UNIFORM] = np.minimum(rng.random(R), U_MAX)
    tokens = np.full((R, W), -1, np.int32)
    counts = np.zeros((R, W), np.float32)
    for r in range(R):
        k = rng.integers(0, W + 1)
        tokens[r, :k] = rng.choice(V, k, replace=False)
        counts[r, :k] = rng.integers(0, 3, k)
    return SamplingInputs(params, tokens, counts)


def _boundary_distance(logits, s: SamplingInputs, candidates) -> np.ndarray:
    """Per row: how far u lies from the nearest CDF boundary of the spec's kept distribution."""
    x = apply_penalties(logits, s.params, s.penalty_tokens, s.penalty_counts)
    t = s.params[:, io.SAMPLING_TEMPERATURE].astype(np.float64)
    xs = x / np.where(t <= 0, 1, t)[:, None]
    w = np.exp(xs - xs.max(axis=1, keepdims=True)) * keep_mask(xs, s.params, candidates)
    cdf = np.cumsum(w, axis=1) / w.sum(axis=1, keepdims=True)
    return np.min(np.abs(cdf - s.params[:, io.SAMPLING_UNIFORM, None].astype(np.float64)), axis=1)


@pytest.mark.parametrize("candidates", [1024, 40], ids=["candidates-all", "candidates-40"])
def test_graph_head_picks_the_spec_token(candidates):
    V = SMALL.vocab
    rng = np.random.default_rng(candidates)
    R, W = 3000, 6
    with OrtExecutor(synthetic_rewritten(SMALL, sampling_candidates=candidates), num_blocks=8) as ex:
        prompt = rng.integers(0, V, 21)
        rows = rng.integers(0, len(prompt), R).astype(np.int32)
        s = _random_rows(rng, R, V, W)
        out = _one_step(ex, prompt, rows, s)
    tokens, lp, top, top_lp = sampling_head(out.logits, s.params, s.penalty_tokens, s.penalty_counts,
                                            candidates=candidates, top_logprobs=ex.graph.num_top_logprobs)
    differ = np.flatnonzero(tokens != out.next_tokens)
    near = _boundary_distance(out.logits, s, candidates)[differ]
    assert np.all(near < 1e-5), f"rows {differ[near >= 1e-5][:5]} differ away from a CDF boundary"
    assert differ.size <= 3, f"{differ.size} of {R} rows differ (all within float32 rounding of a boundary)"
    same = tokens == out.next_tokens
    np.testing.assert_allclose(out.next_logprobs[same], lp[same], atol=2e-5)
    np.testing.assert_array_equal(out.top_tokens, top)  # logits without ties: the same order
    np.testing.assert_allclose(out.top_logprobs, top_lp, atol=2e-5)
    greedy = s.params[:, io.SAMPLING_TEMPERATURE] <= 0
    x = apply_penalties(out.logits, s.params, s.penalty_tokens, s.penalty_counts)
    np.testing.assert_array_equal(out.next_tokens[greedy], np.argmax(x[greedy], axis=1))


@pytest.mark.parametrize("cols", [dict(top_k=7), dict(top_p=0.6), dict(min_p=0.15), dict(top_k=20, top_p=0.8),
                                  dict(temperature=0.5, min_p=0.05)], ids=str)
def test_a_uniform_sweep_reaches_exactly_the_kept_tokens(cols):
    V = SMALL.vocab
    R = 4096
    s = SamplingInputs(_params(R, **cols).astype(np.float32), np.full((R, 1), -1, np.int32),
                       np.zeros((R, 1), np.float32))
    s.params[:, io.SAMPLING_UNIFORM] = (np.arange(R) + 0.5) / R
    with OrtExecutor(synthetic_rewritten(SMALL), num_blocks=8) as ex:
        out = _one_step(ex, np.arange(3, 12), np.full(R, 8, np.int32), s)
    t = s.params[0, io.SAMPLING_TEMPERATURE]
    keep = keep_mask(out.logits[:1].astype(np.float64) / t, s.params[:1], V)[0]
    reached = set(out.next_tokens.tolist())
    assert reached <= set(np.flatnonzero(keep)), "a token outside the mask was sampled"
    weights = np.exp(out.logits[0] / t - (out.logits[0] / t).max()) * keep
    likely = set(np.flatnonzero(weights / weights.sum() > 2.0 / R))  # mass of 2+ sweep steps: must be hit
    assert likely <= reached
    expect = sampling_head(np.repeat(out.logits[:1], R, 0), s.params, s.penalty_tokens, s.penalty_counts,
                           candidates=V, top_logprobs=1)[0]
    assert np.mean(expect == out.next_tokens) > 0.999


# ---- through the engine --------------------------------------------------------------------------------
def test_sampled_distribution_follows_the_kept_softmax():
    params = dict(temperature=0.8, top_p=0.9, max_new_tokens=1)
    prompt = np.arange(5, 17)
    n = 3000
    with OrtExecutor(synthetic_rewritten(SMALL), num_blocks=64, manager_kwargs={"enable_prefix_reuse": True}) as ex:
        logits = ex.step([("probe", prompt)])[0][-1].astype(np.float64)
        ex.free("probe")
        engine = Engine(ex, SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024))
        reqs = [engine.add_request(i, prompt, SamplingParams(seed=1000 + i, **params)) for i in range(n)]
        engine.run()
    first = np.array([r.output[0] for r in reqs])
    xs = logits / 0.8
    keep = keep_mask(xs[None], _params(1, top_p=0.9), len(xs))[0]
    probs = np.exp(xs - xs.max()) * keep
    probs /= probs.sum()
    assert set(first.tolist()) <= set(np.flatnonzero(keep))
    counts = np.bincount(first, minlength=len(xs))[keep]
    expected = probs[keep] * n
    big = expected >= 5  # chi-square cells; the small ones pooled
    observed = np.append(counts[big], counts[~big].sum())
    expect = np.append(expected[big], expected[~big].sum())
    chi2 = float(np.sum((observed - expect) ** 2 / np.maximum(expect, 1e-9)))
    dof = observed.size - 1
    assert chi2 < dof + 4.5 * np.sqrt(2 * dof), (chi2, dof)  # far beyond p = 0.001 only when the law is wrong


def test_a_seeded_request_gives_the_same_tokens_alone_and_batched():
    rng = np.random.default_rng(7)
    target = rng.integers(0, SMALL.vocab, 19)
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=40, seed=42, repetition_penalty=1.2)
    with OrtExecutor(synthetic_rewritten(SMALL), num_blocks=64) as ex:
        engine = Engine(ex, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, chunk_size=8))
        alone = engine.add_request("t", target, sp)
        engine.run()
        others = [engine.add_request(i, rng.integers(0, SMALL.vocab, rng.integers(3, 30)),
                                     SamplingParams(max_new_tokens=6, temperature=0.7, seed=i)) for i in range(5)]
        engine.step()
        engine.step()
        batched = engine.add_request("t2", target, sp)  # arrives mid-stream, chunked among decodes
        engine.run()
    assert batched.output == alone.output and len(alone.output) == 10
    assert all(r.finished for r in others)
