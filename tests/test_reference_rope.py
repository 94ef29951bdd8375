"""pagedkv.reference.rope against independent formulations: the rotate-half formula (NEOX), complex
multiplication on interleaved pairs (GPTJ), Meta's published Llama 3.1 loop, and the positions the write
reference takes (past_len + i vs explicit position_ids)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pagedkv.config import PoolConfig, RopeConfig, RopeScaling, RopeStyle, WriteConfig
from pagedkv.layout import CacheDType
from pagedkv.reference import apply_rope, qkv_write, rope_inv_freq
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


def test_unimplemented_scaling_names_the_value():
    with pytest.raises(NotImplementedError, match="rope_scaling: 3"):
        rope_inv_freq(64, RopeConfig(scaling=3))  # the next enum value (YaRN would go there)
    with pytest.raises(NotImplementedError, match="rope_scaling"):
        apply_rope(np.ones((1, 1, 64)), np.array([1]), 64, RopeConfig(scaling=3))


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
