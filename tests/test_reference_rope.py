"""pagedkv.reference.rope against independent formulations: the rotate-half formula (NEOX), complex
multiplication on interleaved pairs (GPTJ), Meta's published Llama 3.1 loop, Hugging Face's own rotary embeddings
for YaRN (Qwen2.5, DeepSeek, untruncated) and LongRoPE (Phi-3, on both sides of its switch), and the positions
the write reference takes (past_len + i vs explicit position_ids)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from pagedkv.config import PoolConfig, RopeConfig, RopeScaling, RopeStyle, WriteConfig
from pagedkv.layout import CacheDType
from pagedkv.reference import apply_rope, qkv_write, rope_inv_freq
from pagedkv.reference.rope import attention_factor, yarn_ramp_bounds
from pagedkv.step import StepMetadata

EXACT_FLOAT64 = dict(rtol=1e-12, atol=1e-12)  # two float64 formulations of the same formula
# Frequencies are stored as float32: one rounding (2^-24) apart, which llama3's smooth band (a function of
# 1/f) can amplify up to ~2x when the rule is applied to an already-rounded base.
FLOAT32_STORED = dict(rtol=4e-7, atol=0.0)


def angle_tol(positions, x) -> dict:
    """Two float64 formulations of an angle p * f differ by a few ulp of the angle, so the rotated values
    may differ by ~ max|p * f| * eps * |x| (f <= 1): 3e-11 at position 131071."""
    bound = 8 * np.finfo(np.float64).eps * float(np.max(np.abs(positions))) * float(np.max(np.abs(x)))
    return dict(rtol=1e-12, atol=1e-12 + bound)


def plain_inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    # Stored as float32, the way Hugging Face's inv_freq buffer and the contract's RopeParams hold it.
    return np.array([1.0 / theta ** (2 * i / rotary_dim) for i in range(rotary_dim // 2)]).astype(np.float32).astype(np.float64)


def rotate_half_neox(x, positions, rotary_dim, theta):
    """Hugging Face's formulation: x * cos + rotate_half(x) * sin with cos/sin over duplicated halves."""
    freqs = positions[:, None].astype(np.float64) * plain_inv_freq(rotary_dim, theta)[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [T, 1, R]
    rot = x[..., :rotary_dim]
    half = rotary_dim // 2
    rotated = np.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    out = x.copy()
    out[..., :rotary_dim] = rot * np.cos(emb) + rotated * np.sin(emb)
    return out


def complex_gptj(x, positions, rotary_dim, theta):
    """GPT-J: interleaved pairs (2i, 2i+1) as complex numbers times exp(i * angle)."""
    freqs = positions[:, None].astype(np.float64) * plain_inv_freq(rotary_dim, theta)[None, :]
    z = x[..., 0:rotary_dim:2] + 1j * x[..., 1:rotary_dim:2]
    z = z * np.exp(1j * freqs)[:, None, :]
    out = x.copy()
    out[..., 0:rotary_dim:2] = z.real
    out[..., 1:rotary_dim:2] = z.imag
    return out


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (128, 128), (128, 64), (256, 96), (64, 2), (80, 32),
                                                   (96, 96), (32, 32)])
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_neox_is_rotate_half(rng, head_dim, rotary_dim, theta):
    x = rng.standard_normal((9, 3, head_dim))
    positions = np.array([0, 1, 2, 15, 16, 17, 1023, 4097, 131071])
    rope = RopeConfig(style=RopeStyle.NEOX, rotary_dim=rotary_dim, theta=theta)
    got = apply_rope(x, positions, head_dim, rope)
    np.testing.assert_allclose(got, rotate_half_neox(x, positions, rotary_dim, theta), **angle_tol(positions, x))
    np.testing.assert_array_equal(got[..., rotary_dim:], x[..., rotary_dim:])  # partial rotary: untouched


@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (128, 32), (256, 256), (80, 80), (96, 40)])
def test_gptj_is_complex_multiplication(rng, head_dim, rotary_dim):
    x = rng.standard_normal((7, 2, head_dim))
    positions = np.array([0, 3, 64, 65, 999, 8191, 70000])
    rope = RopeConfig(style=RopeStyle.GPTJ, rotary_dim=rotary_dim)
    got = apply_rope(x, positions, head_dim, rope)
    np.testing.assert_allclose(got, complex_gptj(x, positions, rotary_dim, 10000.0), **angle_tol(positions, x))
    np.testing.assert_array_equal(got[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("style", [RopeStyle.NEOX, RopeStyle.GPTJ])
def test_partial_rotary_rotates_the_leading_dims_as_a_full_head_of_that_size(rng, style):
    x = rng.standard_normal((5, 4, 128))
    positions = np.array([1, 7, 100, 2048, 9999])
    partial = apply_rope(x, positions, 128, RopeConfig(style=style, rotary_dim=48))
    full_small = apply_rope(x[..., :48], positions, 48, RopeConfig(style=style))
    np.testing.assert_array_equal(partial[..., :48], full_small)
    np.testing.assert_array_equal(partial[..., 48:], x[..., 48:])


def test_neox_and_gptj_differ(rng):
    """The two pairings are different rotations (a test that confused them would notice)."""
    x = rng.standard_normal((3, 1, 64))
    pos = np.array([5, 6, 7])
    assert not np.allclose(apply_rope(x, pos, 64, RopeConfig(style=RopeStyle.NEOX)),
                           apply_rope(x, pos, 64, RopeConfig(style=RopeStyle.GPTJ)))


def test_style_none_returns_x_unchanged(rng):
    x = rng.standard_normal((4, 2, 64))
    out = apply_rope(x, np.arange(4), 64, RopeConfig(style=RopeStyle.NONE))
    np.testing.assert_array_equal(out, x)
    assert out is not x


def test_rotation_preserves_pair_norms(rng):
    x = rng.standard_normal((6, 3, 64))
    out = apply_rope(x, np.array([0, 1, 50, 500, 5000, 50000]), 64, RopeConfig())
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), **EXACT_FLOAT64)
    np.testing.assert_array_equal(apply_rope(x[:1], np.array([0]), 64, RopeConfig()), x[:1])  # position 0


@pytest.mark.parametrize("factor", [2.0, 4.0, 8.0])
def test_linear_scaling_equals_positions_over_factor(rng, factor):
    rope = RopeConfig(scaling=RopeScaling.LINEAR, factor=factor)
    np.testing.assert_allclose(rope_inv_freq(128, rope), rope_inv_freq(128, RopeConfig()) / factor, **EXACT_FLOAT64)
    x = rng.standard_normal((6, 2, 128))
    positions = np.array([0, 1, 3, 17, 1000, 32767])
    np.testing.assert_allclose(apply_rope(x, positions, 128, rope),
                               apply_rope(x, positions / factor, 128, RopeConfig()), **angle_tol(positions, x))


def meta_llama3_apply_scaling(freqs, scale_factor, low_freq_factor, high_freq_factor, old_context_len):
    """Transcription of the rule Meta published with Llama 3.1 (llama-models ``apply_scaling``)."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / scale_factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new_freqs.append((1 - smooth) * freq / scale_factor + smooth * freq)
    return np.array(new_freqs)


LLAMA31 = RopeConfig(style=RopeStyle.NEOX, theta=500000.0, scaling=RopeScaling.LLAMA3, factor=8.0,
                     low_freq_factor=1.0, high_freq_factor=4.0, original_max_positions=8192)


@pytest.mark.parametrize("rope", [
    LLAMA31,
    RopeConfig(theta=10000.0, scaling=RopeScaling.LLAMA3, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_positions=8192),  # Llama 3.2-like factor
    RopeConfig(theta=500000.0, scaling=RopeScaling.LLAMA3, factor=4.0, low_freq_factor=2.0, high_freq_factor=8.0,
               original_max_positions=4096),
], ids=["llama3.1", "factor32", "other-bands"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_llama3_inv_freq_matches_meta_rule(rope, head_dim):
    base = plain_inv_freq(head_dim, rope.theta)
    want = meta_llama3_apply_scaling(base, rope.factor, rope.low_freq_factor, rope.high_freq_factor,
                                     rope.original_max_positions)
    got = rope_inv_freq(head_dim, rope)
    np.testing.assert_allclose(got, want, **FLOAT32_STORED)
    # all three bands are exercised, so the test would notice a wrong band
    assert np.any(got == base) and np.any(np.isclose(got, base / rope.factor, rtol=1e-14, atol=0))
    assert np.any((got != base) & ~np.isclose(got, base / rope.factor, rtol=1e-14, atol=0))


def test_llama3_hand_checked_values():
    """Llama 3.1 (theta 5e5, head_dim 128, factor 8, bands 1/4, N 8192), worked out by hand:
    i = 0:  f = 1, wavelength 2*pi < 2048 -> unchanged.
    i = 63: f = 5e5**(-126/128) = 2.45514e-6, wavelength 2.559e6 > 8192 -> f / 8 = 3.06893e-7.
    i = 32: f = 5e5**(-1/2) = 1/707.1068 = 1.41421356e-3, wavelength 4442.883 in [2048, 8192]:
            s = (8192 / 4442.883 - 1) / 3 = 0.2812826, f' = f * ((1 - s) / 8 + s) = 5.24846e-4."""
    got = rope_inv_freq(128, LLAMA31)
    assert got[0] == 1.0
    assert got[63] == pytest.approx(500000.0 ** (-126 / 128) / 8, rel=1.2e-7)
    assert got[63] == pytest.approx(3.06893e-7, rel=1e-5)
    assert got[32] == pytest.approx(5.24846e-4, rel=1e-5)
    f32 = 1 / math.sqrt(500000.0)
    s = (8192 * f32 / (2 * math.pi) - 1) / 3
    assert got[32] == pytest.approx(f32 * ((1 - s) / 8 + s), rel=1.2e-7)
    assert np.all(got.astype(np.float32).astype(np.float64) == got)  # stored as float32


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="rope_rotary_dim"):
        rope_inv_freq(64, RopeConfig(rotary_dim=33))
    with pytest.raises(ValueError, match="rope_rotary_dim"):
        rope_inv_freq(64, RopeConfig(rotary_dim=128))
    with pytest.raises(ValueError, match="rope_theta"):
        rope_inv_freq(64, RopeConfig(theta=0.0))
    with pytest.raises(ValueError, match="rope_factor"):
        rope_inv_freq(64, RopeConfig(scaling=RopeScaling.LINEAR, factor=0.0))
    with pytest.raises(ValueError, match="rope_low_freq_factor"):
        rope_inv_freq(64, RopeConfig(scaling=RopeScaling.LLAMA3, factor=8.0, low_freq_factor=4.0,
                                     high_freq_factor=4.0))
    with pytest.raises(ValueError, match="positions"):
        apply_rope(np.zeros((3, 1, 64)), np.arange(4), 64, RopeConfig())
    with pytest.raises(ValueError, match="head_dim=128"):
        apply_rope(np.zeros((3, 1, 64)), np.arange(3), 128, RopeConfig())


def test_unknown_scaling_names_the_value():
    with pytest.raises(ValueError, match="rope_scaling: expected one of .*LONGROPE=4.*, got 9"):
        rope_inv_freq(64, RopeConfig(scaling=9))
    with pytest.raises(ValueError, match="rope_scaling"):
        apply_rope(np.ones((1, 1, 64)), np.array([1]), 64, RopeConfig(scaling=9))


# ---- YaRN and LongRoPE against Hugging Face's own rotary embeddings -----------------------------------------
# transformers (the export extra) computes its tables in float32 with several roundings, ours in float64 rounded
# once: a few float32 steps apart. Its cos/sin come from a float32 product position * inv_freq.
HF_INV_FREQ = dict(rtol=1e-6, atol=0.0)
NO_TRANSFORMERS = None
try:
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - the export extra is installed in CI
    NO_TRANSFORMERS = f"transformers not installed ({exc}): pip install '.[export]'"
needs_transformers = pytest.mark.skipif(NO_TRANSFORMERS is not None, reason=str(NO_TRANSFORMERS))


def hf_rope_config(params: dict, max_positions: int) -> RopeConfig:
    """Our RopeConfig of a transformers ``rope_parameters`` dict (yarn / longrope), as a model's config holds it."""
    kind = params["rope_type"]
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_positions / original
    attention = params.get("attention_factor")
    if kind == "yarn":
        if attention is None and params.get("mscale") and params.get("mscale_all_dim"):
            def get_mscale(m):
                return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0
            attention = get_mscale(params["mscale"]) / get_mscale(params["mscale_all_dim"])
        return RopeConfig(theta=params["rope_theta"], scaling=RopeScaling.YARN, factor=factor,
                          original_max_positions=original, beta_fast=params.get("beta_fast") or 32.0,
                          beta_slow=params.get("beta_slow") or 1.0, truncate=params.get("truncate", True),
                          attention_factor=attention or 0.0)
    return RopeConfig(theta=params["rope_theta"], scaling=RopeScaling.LONGROPE, factor=factor,
                      original_max_positions=original, attention_factor=attention or 0.0,
                      short_factors=params["short_factor"], long_factors=params["long_factor"])


def hf_rotate(cos, sin, x):
    """transformers' apply_rotary_pos_emb on one tensor [T, heads, D] (rotate-half, cos/sin [T, D])."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


YARN_CASES = {
    # Qwen2.5-7B-Instruct's long-context recipe: rope_scaling {"type": "yarn", "factor": 4.0, ...}
    "qwen2.5": (128, 131072, {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                              "original_max_position_embeddings": 32768}),
    # DeepSeek-V2/V3: factor 40 on 4096, beta 32/1, mscale / mscale_all_dim (attention factor their ratio)
    "deepseek": (64, 163840, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                              "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                              "mscale": 0.707, "mscale_all_dim": 1.0}),
    # gpt-oss: untruncated ramp bounds
    "untruncated": (64, 131072, {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                 "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False}),
    # the test family's: a ramp inside a 64-dim head, explicit attention factor
    "tiny-explicit-factor": (64, 512, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                       "original_max_position_embeddings": 64, "attention_factor": 1.3}),
}


@needs_transformers
@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_matches_transformers_rotary_embedding(rng, case):
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head_dim, max_positions, params = YARN_CASES[case]
    config = LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
                         max_position_embeddings=max_positions, rope_parameters=dict(params))
    hf = LlamaRotaryEmbedding(config)
    rope = hf_rope_config(params, max_positions)
    ours = rope_inv_freq(head_dim, rope)
    np.testing.assert_allclose(ours, hf.inv_freq.double().numpy(), **HF_INV_FREQ)
    base = rope_inv_freq(head_dim, RopeConfig(theta=params["rope_theta"]))
    assert np.any(ours == base) and np.any(np.isclose(ours, base / rope.factor, rtol=1e-6, atol=0)), \
        "the case must reach both ends of the ramp"
    assert attention_factor(rope) == pytest.approx(hf.attention_scaling, rel=1e-7)
    assert case != "deepseek" or attention_factor(rope) != 1.0

    positions = np.array([0, 1, 5, 63, 64, 200, 1000, 4095])
    with torch.no_grad():
        cos, sin = hf(torch.zeros(1, dtype=torch.float64), torch.as_tensor(positions)[None])
    x = rng.standard_normal((positions.size, 3, head_dim))
    want = hf_rotate(cos[0].double().numpy(), sin[0].double().numpy(), x)
    tol = 1e-5 + 2e-7 * positions.max() * np.abs(x).max()  # float32 angles and frequencies in transformers
    np.testing.assert_allclose(apply_rope(x, positions, head_dim, rope), want, rtol=0, atol=tol)


def test_yarn_hand_checked_ramp():
    """head_dim 64, theta 10000, N = 64, beta 32/1: d(b) = 64 ln(64 / (2 pi b)) / (2 ln 10000) gives
    d(32) = -3.98 -> floor -4 -> clamped 0, d(1) = 8.07 -> ceil 9: pair i has ramp i / 9 up to i = 9."""
    rope = RopeConfig(scaling=RopeScaling.YARN, factor=4.0, original_max_positions=64)
    low, high = yarn_ramp_bounds(rope, 64)
    assert (low, high) == (0.0, 9.0)
    base = rope_inv_freq(64, RopeConfig())
    got = rope_inv_freq(64, rope)
    assert got[0] == base[0] == 1.0  # ramp 0: unchanged
    i = 4
    assert got[i] == pytest.approx(base[i] * (1 - i / 9) + base[i] / 4 * (i / 9), rel=1e-7)
    np.testing.assert_allclose(got[9:], base[9:] / 4, rtol=1e-7)
    assert attention_factor(rope) == pytest.approx(0.1 * math.log(4.0) + 1.0, rel=1e-7)
    untruncated = dataclasses.replace(rope, truncate=False)
    assert yarn_ramp_bounds(untruncated, 64) == pytest.approx((0.0, 64 * math.log(64 / (2 * math.pi)) /
                                                                (2 * math.log(10000.0))))


PHI3_PARAMS = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 12,
               "short_factor": [1.0 + 0.05 * i for i in range(16)], "long_factor": [1.5 + 0.4 * i for i in range(16)]}


def _phi3_rotary(params=PHI3_PARAMS, max_positions=512):
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = Phi3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                        max_position_embeddings=max_positions,
                        original_max_position_embeddings=params["original_max_position_embeddings"],
                        rope_parameters=dict(params))
    return Phi3RotaryEmbedding(config)


@needs_transformers
def test_longrope_switches_where_transformers_does(rng):
    """Phi3RotaryEmbedding's longrope update: one table per forward call, the long one iff max(position_ids) + 1
    exceeds original_max_position_embeddings (12 here); a later call below it is short again. Ours per token by
    the kv length of its sequence: for a call of one sequence at positions past_len + i that is the same rule."""
    import torch

    hf = _phi3_rotary()
    rope = hf_rope_config(PHI3_PARAMS, 512)
    assert attention_factor(rope) == pytest.approx(math.sqrt(1 + math.log(512 / 12) / math.log(12)), rel=1e-7)
    assert attention_factor(rope) == pytest.approx(hf.attention_scaling, rel=1e-7)
    # (past, new): a prefill below the switch, the decode that crosses it, a chunk past it, a short one again
    for past, new in [(0, 7), (11, 1), (7, 5), (12, 1), (3, 10), (40, 1), (0, 12), (0, 33)]:
        positions = np.arange(past, past + new)
        with torch.no_grad():
            cos, sin = hf(torch.zeros(1, dtype=torch.float64), torch.as_tensor(positions)[None])
        x = rng.standard_normal((new, 2, 32))
        want = hf_rotate(cos[0].double().numpy(), sin[0].double().numpy(), x)
        kv_lens = np.full(new, past + new)
        got = apply_rope(x, positions, 32, rope, kv_lens)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5, err_msg=f"past={past}, new={new}")
        other = apply_rope(x, positions, 32, rope, np.full(new, 1 if past + new > 12 else 13))
        assert not np.allclose(other, want, atol=1e-3), "the other table must give other values"
    np.testing.assert_allclose(rope_inv_freq(32, rope), hf.original_inv_freq.double().numpy(), **HF_INV_FREQ)
    np.testing.assert_allclose(rope_inv_freq(32, rope, long=True), hf.long_inv_freq.double().numpy(), **HF_INV_FREQ)


def test_longrope_picks_the_table_per_sequence():
    """Two sequences in one step: the one past the switch rotates with the long factors, the other with the short
    ones; the cache position does not matter, only the sequence's kv length after the step."""
    rope = RopeConfig(scaling=RopeScaling.LONGROPE, original_max_positions=12, factor=4.0,
                      short_factors=(1.0,) * 32, long_factors=(2.0,) * 32)
    x = np.random.default_rng(3).standard_normal((3, 1, 64))
    got = apply_rope(x, np.array([5, 5, 5]), 64, rope, np.array([6, 13, 12]))
    short = apply_rope(x, np.array([5, 5, 5]), 64, dataclasses.replace(rope, long_factors=(1.0,) * 32),
                       np.array([6, 13, 12]))
    np.testing.assert_array_equal(got[[0, 2]], short[[0, 2]])
    assert not np.allclose(got[1], short[1])
    half = dataclasses.replace(rope, scaling=RopeScaling.LINEAR, factor=2.0)  # long factor 2 == positions / 2
    np.testing.assert_allclose(got[1] / attention_factor(rope), apply_rope(x[1:2], np.array([5]), 64, half)[0],
                               rtol=1e-12, atol=1e-12)


def test_yarn_and_longrope_errors_name_the_field():
    longrope = RopeConfig(scaling=RopeScaling.LONGROPE, short_factors=(1.0,) * 32, long_factors=(1.0,) * 32)
    with pytest.raises(ValueError, match="kv_lens"):
        apply_rope(np.ones((2, 1, 64)), np.arange(2), 64, longrope)
    with pytest.raises(ValueError, match=r"rope_short_factors: expected rotary_dim / 2 = 16 values, got 32"):
        rope_inv_freq(32, longrope)
    with pytest.raises(ValueError, match=r"rope_long_factors\[3\]: must be finite and > 0"):
        rope_inv_freq(64, dataclasses.replace(longrope, long_factors=(1.0,) * 3 + (0.0,) + (1.0,) * 28))
    with pytest.raises(ValueError, match="rope_beta_slow"):
        rope_inv_freq(64, RopeConfig(scaling=RopeScaling.YARN, factor=4.0, beta_slow=0.0))
    with pytest.raises(ValueError, match="rope_attention_factor"):
        attention_factor(RopeConfig(scaling=RopeScaling.YARN, attention_factor=-1.0))
    with pytest.raises(ValueError, match="only LONGROPE has a long table"):
        rope_inv_freq(64, RopeConfig(), long=True)


# ---- positions of the write reference ----------------------------------------------------------------------
def _write_setup(explicit: bool, position_ids=None, style=RopeStyle.NEOX):
    pool_cfg = PoolConfig(num_kv_heads=2, head_dim=64, page_size=16, num_layers=1, layer_index=0,
                          cache_dtype=CacheDType.FP16)
    cfg = WriteConfig(num_q_heads=4, pool=pool_cfg, rope=RopeConfig(style=style), explicit_positions=explicit)
    meta = StepMetadata(block_table=np.array([[2, 0, -1], [1, 3, 4]]), cu_q_lens=np.array([0, 5, 8]),
                        past_lens=np.array([12, 30]), position_ids=position_ids)
    pool = np.full(pool_cfg.layout().pool_shape(5), np.nan, dtype=np.float16)
    qkv = np.random.default_rng(7).standard_normal((8, 8 * 64))
    return cfg, meta, pool, qkv


@pytest.mark.parametrize("style", [RopeStyle.NEOX, RopeStyle.GPTJ])
def test_past_len_positions_equal_explicit_position_ids(style):
    cfg_a, meta_a, pool_a, qkv = _write_setup(False, style=style)
    q_a = qkv_write(qkv, None, meta_a, pool_a, cfg_a)
    cache_pos = np.array([12, 13, 14, 15, 16, 30, 31, 32])
    np.testing.assert_array_equal(meta_a.token_cache_pos, cache_pos)
    cfg_b, meta_b, pool_b, _ = _write_setup(True, position_ids=cache_pos, style=style)
    q_b = qkv_write(qkv, None, meta_b, pool_b, cfg_b)
    np.testing.assert_array_equal(q_a, q_b)
    np.testing.assert_array_equal(pool_a.view(np.uint16), pool_b.view(np.uint16))
    q = qkv.reshape(8, 8, 64)[:, :4]
    np.testing.assert_allclose(q_a, apply_rope(q, cache_pos, 64, RopeConfig(style=style)), **EXACT_FLOAT64)


def test_explicit_positions_rotate_but_do_not_move_the_cache_slot():
    ids = np.array([100, 100, 101, 7, 0, 5000, 5001, 5002])  # e.g. M-RoPE-like or speculative offsets
    cfg, meta, pool, qkv = _write_setup(True, position_ids=ids)
    q_out = qkv_write(qkv, None, meta, pool, cfg)
    x = qkv.reshape(8, 8, 64)
    np.testing.assert_allclose(q_out, apply_rope(x[:, :4], ids, 64, RopeConfig()), **EXACT_FLOAT64)
    k_rot = apply_rope(x[:, 4:6], ids, 64, RopeConfig())
    # token 3 of sequence 0 is cache position 15: page 0 (block 2), offset 15, whatever its RoPE position
    np.testing.assert_array_equal(pool[2, 0, 0, :, 15], k_rot[3].astype(np.float16))
    # token 0 of sequence 1 is cache position 30: page 1 (block 3), offset 14
    np.testing.assert_array_equal(pool[3, 0, 0, :, 14], k_rot[5].astype(np.float16))


def test_positions_and_config_must_agree():
    cfg, meta, pool, qkv = _write_setup(True, position_ids=None)
    with pytest.raises(ValueError, match="position_ids"):
        qkv_write(qkv, None, meta, pool, cfg)
    cfg, meta, pool, qkv = _write_setup(False, position_ids=np.arange(8))
    with pytest.raises(ValueError, match="explicit_positions=0"):
        qkv_write(qkv, None, meta, pool, cfg)
