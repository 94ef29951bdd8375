"""Host side of the fused QKV write, on the CPU (no GPU needed; runs in CI).

- The C API (``pagedkv_qkv_write``) rejects bad parameters before any CUDA call, with an error that names the
  field and the value; an empty step is a no-op.
- ``QKVWriteArgs`` (ctypes) has the C struct's exact layout.
- ``computeRopeParams`` (C++) gives the reference's inverse frequencies rounded once to float32.
- The kernel's RoPE angle reduction (evaluated on the host through the C API, same code as on the device)
  stays accurate for every int32 position, where a float32 product ``pos * inv_freq`` does not.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest

from pagedkv import _lib
from pagedkv.config import PoolConfig, RopeConfig, RopeScaling, RopeStyle, WriteConfig
from pagedkv.kernels import write
from pagedkv.layout import CacheDType
from pagedkv.reference.rope import rope_inv_freq as reference_inv_freq

# Fake device addresses: never dereferenced, because every case below fails validation first.
FAKE = {"qkv": 0x10000, "q_out": 0x20000, "status": 0x30000, "bias": 0x40000, "position_ids": 0x50000,
        "pool_descs": 0x60000, "block_table": 0x70000, "cu_q_lens": 0x80000, "past_lens": 0x90000}


def make_cfg(**pool_kwargs) -> WriteConfig:
    pool = dict(num_kv_heads=8, head_dim=128, page_size=16, num_layers=2, layer_index=1)
    pool.update(pool_kwargs)
    return WriteConfig(num_q_heads=32, pool=PoolConfig(**pool))


def valid_args(**overrides) -> write.QKVWriteArgs:
    meta = write.StepPointers(FAKE["pool_descs"], FAKE["block_table"], FAKE["cu_q_lens"], FAKE["past_lens"],
                              num_seqs=2, num_tokens=5, max_blocks=3)
    args = write.build_args(make_cfg(), write.IODType.BF16, qkv=FAKE["qkv"], q_out=FAKE["q_out"],
                            status=FAKE["status"], meta=meta)
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


# (overrides of an otherwise valid launch, text the error must contain: "field=value")
BAD_ARGS = [
    ({"head_dim": 96}, "head_dim=96"),
    ({"head_dim": 0}, "head_dim=0"),
    ({"head_dim": 32}, "head_dim=32"),
    ({"num_q_heads": 12}, "num_q_heads=12"),
    ({"num_q_heads": 0}, "num_q_heads=0"),
    ({"num_kv_heads": 0}, "num_kv_heads=0"),
    ({"num_kv_heads": 3}, "num_q_heads=32"),  # 32 % 3 != 0: names the query heads and the divisor
    ({"io_dtype": 2}, "io_dtype=2"),
    ({"cache_dtype": 4}, "cache_dtype=4"),
    ({"cache_dtype": -1}, "cache_dtype=-1"),
    ({"rope_rotary_dim": 7}, "rope_rotary_dim=7"),
    ({"rope_rotary_dim": 256}, "rope_rotary_dim=256"),
    ({"rope_rotary_dim": -2}, "rope_rotary_dim=-2"),
    ({"rope_style": 5}, "rope_style=5"),
    ({"rope_theta": 0.0}, "rope_theta=0"),
    ({"rope_theta": float("nan")}, "rope_theta=nan"),
    ({"rope_scaling": 7}, "rope_scaling=7"),
    ({"rope_scaling": int(RopeScaling.LINEAR), "rope_factor": 0.0}, "rope_factor=0"),
    ({"rope_scaling": int(RopeScaling.LLAMA3), "rope_low_freq_factor": 4.0, "rope_high_freq_factor": 4.0},
     "rope_high_freq_factor=4"),
    ({"rope_scaling": int(RopeScaling.LLAMA3), "rope_original_max_positions": 0}, "rope_original_max_positions=0"),
    ({"k_scale": 0.0}, "k_scale=0"),
    ({"k_scale": -1.0}, "k_scale=-1"),
    ({"v_scale": float("nan")}, "v_scale=nan"),
    ({"v_scale": float("inf")}, "v_scale=inf"),
    ({"q_out_fp8": 1, "q_scale": 0.0}, "q_scale=0"),
    ({"qkv": None}, "qkv=0"),
    ({"qkv": FAKE["qkv"] + 2}, f"qkv={FAKE['qkv'] + 2}"),
    ({"bias": FAKE["bias"] + 8}, f"bias={FAKE['bias'] + 8}"),
    ({"q_out": None}, "q_out=0"),
    ({"q_out": FAKE["q_out"] + 8}, f"q_out={FAKE['q_out'] + 8}"),
    ({"status": None}, "status=0"),
    ({"position_ids": FAKE["position_ids"] + 2}, f"position_ids={FAKE['position_ids'] + 2}"),
    ({"pool_descs": None}, "pool_descs=0"),
    ({"block_table": None}, "block_table=0"),
    ({"cu_q_lens": None}, "cu_q_lens=0"),
    ({"past_lens": None}, "past_lens=0"),
    ({"num_tokens": -1}, "num_tokens=-1"),
    ({"num_tokens": 2_000_000_000}, "num_tokens=2000000000"),
    ({"num_seqs": 0}, "num_seqs=0"),
    ({"num_seqs": -3}, "num_seqs=-3"),
    ({"max_blocks": -1}, "max_blocks=-1"),
    ({"pool_index": -1}, "pool_index=-1"),
    ({"num_layers": 0}, "num_layers=0"),
    ({"layer_index": 2}, "layer_index=2"),
    ({"layer_index": -1}, "layer_index=-1"),
    ({"page_size": 0}, "page_size=0"),
    ({"page_layout": 2}, "page_layout=2"),
    ({"ring_sink_tokens": -1}, "ring_sink_tokens=-1"),
    ({"cyclic_len": 20}, "cyclic_len=20"),
    ({"cyclic_len": -16}, "cyclic_len=-16"),
    ({"struct_size": 8}, "struct_size=8"),
]


@pytest.mark.parametrize("overrides,expected", BAD_ARGS, ids=[e for _, e in BAD_ARGS])
def test_bad_parameter_is_rejected_naming_field_and_value(overrides, expected):
    args = valid_args(**overrides)
    with pytest.raises(_lib.CapiError) as err:
        write.launch(args)
    message = str(err.value)
    assert expected in message, message
    assert "expected" in message, message
    assert "CUDA error 1:" in message, message  # cudaErrorInvalidValue, not a failed CUDA call


def test_null_args_pointer_is_rejected():
    rc = write._capi().pagedkv_qkv_write(None, None)
    assert rc == 1
    assert _lib.capi().pagedkv_last_error().decode().startswith("args=0")


def test_empty_step_is_a_no_op_without_touching_cuda():
    # T = 0: validated, then nothing to launch (null pointers are fine: nothing is read or written).
    args = valid_args(num_tokens=0, num_seqs=0, max_blocks=0, qkv=None, q_out=None, status=None,
                      pool_descs=None, block_table=None, cu_q_lens=None, past_lens=None)
    write.launch(args)
    with pytest.raises(_lib.CapiError, match="head_dim=96"):  # and an empty step is still validated
        write.launch(valid_args(num_tokens=0, num_seqs=0, head_dim=96))


def test_python_wrapper_checks_optional_inputs_against_config():
    meta = write.StepPointers(1 << 16, 1 << 16, 1 << 16, 1 << 16, num_seqs=1, num_tokens=1, max_blocks=1)
    with pytest.raises(ValueError, match="bias: WriteConfig.has_bias=False"):
        write.qkv_write(1 << 16, 1 << 16, 1 << 16, meta, make_cfg(), io_dtype=write.IODType.FP16, bias=1 << 16)
    with pytest.raises(ValueError, match="position_ids: WriteConfig.explicit_positions=False"):
        write.qkv_write(1 << 16, 1 << 16, 1 << 16, write.StepPointers(**{**meta.__dict__, "position_ids": 1 << 16}),
                        make_cfg(), io_dtype=write.IODType.FP16)


def test_args_struct_layout_matches_the_library():
    lib = write._capi()  # raises if size or any offset differs
    n = len(write.QKVWriteArgs._fields_)
    offsets = (ctypes.c_int64 * n)()
    assert lib.pagedkv_qkv_write_args_offsets(offsets, n) == n
    assert list(offsets) == [getattr(write.QKVWriteArgs, name).offset for name, _ in write.QKVWriteArgs._fields_]
    assert lib.pagedkv_qkv_write_args_size() == ctypes.sizeof(write.QKVWriteArgs)
    # pointers start 8-byte aligned with no implicit padding (explicit reserved0)
    assert write.QKVWriteArgs.qkv.offset == 4 * (len(write.QKVWriteArgs._fields_) - 9)


def test_build_args_carries_every_attribute():
    cfg = WriteConfig(num_q_heads=16, has_bias=True, explicit_positions=True, zero_v_tail=False, q_out_fp8=True,
                      q_scale=0.5,
                      rope=RopeConfig(style=RopeStyle.GPTJ, rotary_dim=32, theta=5e5, scaling=RopeScaling.LLAMA3,
                                      factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_positions=4096),
                      pool=PoolConfig(num_kv_heads=4, head_dim=64, page_size=24, num_layers=3, layer_index=2,
                                      pool_index=1, cache_dtype=CacheDType.INT8, page_layout=1, ring_sink_tokens=5,
                                      cyclic_len=48, k_scale=0.25, v_scale=0.125))
    meta = write.StepPointers(1, 2, 3, 4, num_seqs=5, num_tokens=6, max_blocks=7, position_ids=8)
    a = write.build_args(cfg, write.IODType.FP16, qkv=9, q_out=10, status=11, meta=meta, bias=12)
    got = {name: getattr(a, name) for name, _ in write.QKVWriteArgs._fields_}
    assert got == {
        "struct_size": ctypes.sizeof(write.QKVWriteArgs), "num_q_heads": 16, "num_kv_heads": 4, "head_dim": 64,
        "io_dtype": 0, "num_tokens": 6, "num_seqs": 5, "max_blocks": 7, "pool_index": 1, "num_layers": 3,
        "layer_index": 2, "page_size": 24, "page_layout": 1, "ring_sink_tokens": 5, "cyclic_len": 48, "cache_dtype": 3,
        "k_scale": 0.25, "v_scale": 0.125, "rope_style": 2, "rope_rotary_dim": 32, "rope_theta": 5e5,
        "rope_scaling": 2, "rope_factor": 8.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
        "rope_original_max_positions": 4096, "q_out_fp8": 1, "q_scale": 0.5, "zero_v_tail": 0, "reserved0": 0,
        "qkv": 9, "bias": 12, "position_ids": 8, "pool_descs": 1, "block_table": 2, "cu_q_lens": 3,
        "past_lens": 4, "q_out": 10, "status": 11}


# ---- RoPE tables: C++ computeRopeParams vs the float64 reference ------------------------------------------
ROPE_CASES = [
    (128, RopeConfig()),
    (128, RopeConfig(theta=500000.0)),
    (64, RopeConfig(style=RopeStyle.GPTJ, rotary_dim=24)),
    (256, RopeConfig(rotary_dim=64, theta=1e6)),
    (128, RopeConfig(scaling=RopeScaling.LINEAR, factor=4.0)),
    (128, RopeConfig(theta=500000.0, scaling=RopeScaling.LLAMA3, factor=8.0, low_freq_factor=1.0,
                     high_freq_factor=4.0, original_max_positions=8192)),
    (64, RopeConfig(theta=10000.0, scaling=RopeScaling.LLAMA3, factor=32.0, low_freq_factor=2.0,
                    high_freq_factor=8.0, original_max_positions=2048)),
]


@pytest.mark.parametrize("head_dim,rope", ROPE_CASES, ids=[f"D{d}-{r.style.name}-R{r.rotary_dim}-{r.scaling.name}"
                                                            for d, r in ROPE_CASES])
def test_rope_table_is_the_reference_rounded_once_to_float32(head_dim, rope):
    cfg = WriteConfig(num_q_heads=8, rope=rope, pool=PoolConfig(num_kv_heads=8, head_dim=head_dim, page_size=16,
                                                                num_layers=1, layer_index=0))
    ours = write.rope_inv_freq(cfg)
    expected = reference_inv_freq(head_dim, rope)
    assert ours.shape == expected.shape
    # Both evaluate the same double-precision formula; std::pow and numpy's ** may differ in the last bit of
    # the double, which can move the float32 rounding by at most one float32 step.
    nearest = expected.astype(np.float32)
    assert np.all(np.abs(ours.astype(np.float64) - nearest) <= np.spacing(nearest).astype(np.float64)), \
        np.flatnonzero(ours != nearest)
    assert np.count_nonzero(ours != nearest) <= 1


def test_rope_llama3_scaling_bands():
    # Llama 3.1 8B: theta 5e5, factor 8, low 1, high 4, original 8192: wavelengths below 2048 unchanged,
    # above 8192 divided by 8, in between interpolated.
    rope = RopeConfig(theta=500000.0, scaling=RopeScaling.LLAMA3, factor=8.0, original_max_positions=8192)
    cfg = WriteConfig(num_q_heads=8, rope=rope, pool=PoolConfig(num_kv_heads=8, head_dim=128, page_size=16,
                                                                num_layers=1, layer_index=0))
    scaled = write.rope_inv_freq(cfg).astype(np.float64)
    plain = write.rope_inv_freq(WriteConfig(num_q_heads=8, rope=RopeConfig(theta=500000.0), pool=cfg.pool))
    wavelength = 2 * math.pi / plain.astype(np.float64)
    high, low = wavelength < 2048, wavelength > 8192
    assert high.any() and low.any() and (~high & ~low).any()
    np.testing.assert_array_equal(scaled[high], plain[high])
    np.testing.assert_allclose(scaled[low], plain[low] / 8.0, rtol=2 ** -23)
    mid = ~high & ~low
    assert np.all((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8.0))


def test_rope_style_none_has_no_table():
    cfg = WriteConfig(num_q_heads=8, rope=RopeConfig(style=RopeStyle.NONE), pool=make_cfg().pool)
    assert write.rope_inv_freq(cfg).size == 0


# ---- the kernel's angle reduction (same code as the device, run on the host) --------------------------------
# The reduction's error budget (qkv_write_params.cuh): 2^-32 turn dropped (1.5e-9 rad) + the int -> float
# rounding of the turn fraction and the float constant 2 pi / 2^32 (2^-24 relative each, of an angle <= pi:
# 1.9e-7 rad each) + the turn rate's long double rounding times |pos| (< 1e-8 rad): under 4e-7 rad, about
# __sincosf's own absolute error, and 1000x below an fp16 ulp.
ANGLE_BOUND = 4e-7
TWO_PI = np.longdouble("6.28318530717958647692528676655900577")


def exact_angles(inv_freq: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """(pos * f) mod 2 pi, with f the float32 value taken as exact: the product of a 32-bit position and a
    24-bit significand is exact in 80-bit long double, and so is fmod."""
    return np.fmod(positions.astype(np.longdouble)[:, None] * inv_freq.astype(np.longdouble)[None, :], TWO_PI)


def angle_error(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance of two angles on the circle."""
    d = np.abs(np.fmod(a.astype(np.longdouble) - b.astype(np.longdouble), TWO_PI))
    return np.minimum(d, TWO_PI - d)


@pytest.mark.skipif(np.finfo(np.longdouble).nmant < 60, reason="needs 80-bit long double for exact products")
def test_rope_angle_reduction_is_accurate_for_every_int32_position():
    rng = np.random.default_rng(7)
    inv_freq = np.concatenate([
        write.rope_inv_freq(WriteConfig(num_q_heads=8, rope=RopeConfig(theta=500000.0), pool=make_cfg().pool)),
        np.array([1.0, 2.0, 7.5, 1e-6, np.float32(2 * math.pi)], dtype=np.float32),
    ]).astype(np.float32)
    positions = np.concatenate([
        np.array([0, 1, 2, 4095, 4096, 131071, 131072, 1_000_003, 2**24 + 1, 2**30, 2**31 - 1, -1, -131072, -2**31]),
        rng.integers(-2**31, 2**31, size=200),
    ]).astype(np.int32)
    ours = write.rope_angles(inv_freq, positions)
    assert np.all((ours >= -math.pi) & (ours <= math.pi))
    err = angle_error(ours, exact_angles(inv_freq, positions))
    assert err.max() < ANGLE_BOUND, (err.max(), np.unravel_index(err.argmax(), err.shape))
    # What the reduction buys: a float32 product pos * inv_freq is already ~4e-3 rad off at position 131071.
    naive = (positions.astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)
    assert angle_error(naive[5:6], exact_angles(inv_freq, positions[5:6])).max() > 100 * ANGLE_BOUND
