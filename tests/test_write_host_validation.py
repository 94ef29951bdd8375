"""Host side of the fused QKV write, on the CPU (no GPU needed; runs in CI).

- The C API (``pagedkv_qkv_write``, the launcher on its own ``QKVWriteParams``) rejects bad parameters before any
  CUDA call, with an error that names the field (as the plugin attribute is named) and the value; an empty step
  is a no-op; a failure never reports an earlier call's reason.
- ``write_params`` carries every attribute into the launcher's struct.
- ``computeRopeParams`` (C++) gives the reference's inverse frequencies rounded once to float32.
- The kernel's RoPE angle reduction (evaluated on the host through the C API, same code as on the device)
  stays accurate for every int32 position, where a float32 product ``pos * inv_freq`` does not.
- The launcher's warp count (``qkvWriteWarps``, through the C API) and the kernel's balanced ranges it implies:
  decode steps one pass per warp, no warp crossing two tokens where whole warps per token fit, one warp per token
  for long prefills (property test over token counts, passes per token and wave sizes).
"""

from __future__ import annotations

import ctypes
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import _lib
from pagedkv.config import PoolConfig, RopeConfig, RopeScaling, RopeStyle, WriteConfig
from pagedkv.kernels import _structs, write
from pagedkv.layout import CacheDType
from pagedkv.reference.rope import attention_factor as reference_attention_factor
from pagedkv.reference.rope import rope_inv_freq as reference_inv_freq

# Fake device addresses: never dereferenced, because every case below fails validation first (or has no GPU).
FAKE = {"qkv": 0x10000, "q_out": 0x20000, "status": 0x30000, "bias": 0x40000, "position_ids": 0x50000,
        "pool_descs": 0x60000, "block_table": 0x70000, "cu_q_lens": 0x80000, "past_lens": 0x90000}


def make_cfg(**pool_kwargs) -> WriteConfig:
    pool = dict(num_kv_heads=8, head_dim=128, page_size=16, num_layers=2, layer_index=1)
    pool.update(pool_kwargs)
    return WriteConfig(num_q_heads=32, pool=PoolConfig(**pool))


def valid_params(**overrides):
    meta = write.StepPointers(FAKE["pool_descs"], FAKE["block_table"], FAKE["cu_q_lens"], FAKE["past_lens"],
                              num_seqs=2, num_tokens=5, max_blocks=3)
    params = write.write_params(make_cfg(), write.IODType.BF16, qkv=FAKE["qkv"], q_out=FAKE["q_out"],
                                status=FAKE["status"], meta=meta)
    _structs.set_fields(params, overrides)
    return params


# (overrides of an otherwise valid launch, by QKVWriteParams member; text the error must contain: "field=value",
# the field named as the plugin attribute / C API parameter is)
BAD_PARAMS = [
    ({"headDim": 96}, "head_dim=96"),
    ({"headDim": 0}, "head_dim=0"),
    ({"headDim": 32}, "head_dim=32"),
    ({"numQHeads": 12}, "num_q_heads=12"),
    ({"numQHeads": 0}, "num_q_heads=0"),
    ({"numKVHeads": 0}, "num_kv_heads=0"),
    ({"numKVHeads": 3}, "num_q_heads=32"),  # 32 % 3 != 0: names the query heads and the divisor
    ({"ioDType": 2}, "io_dtype=2"),
    ({"cacheDType": 4}, "cache_dtype=4"),
    ({"cacheDType": -1}, "cache_dtype=-1"),
    ({"rope.rotaryDim": 7}, "rope_rotary_dim=7"),
    ({"rope.rotaryDim": 256}, "rope_rotary_dim=256"),
    ({"rope.rotaryDim": -2}, "rope_rotary_dim=-2"),
    ({"rope.style": 5}, "rope_style=5"),
    ({"rope.invFreq": (ctypes.c_float * 128)(*([0.5] * 3 + [float("nan")] * 125))}, "rope.inv_freq[3]=nan"),
    ({"rope.mscale": float("inf")}, "rope.mscale=inf"),
    ({"kScale": 0.0}, "k_scale=0"),
    ({"kScale": -1.0}, "k_scale=-1"),
    ({"vScale": float("nan")}, "v_scale=nan"),
    ({"vScale": float("inf")}, "v_scale=inf"),
    ({"qOutFP8": True, "qScale": 0.0}, "q_scale=0"),
    ({"qkv": None}, "qkv=0"),
    ({"qkv": FAKE["qkv"] + 2}, f"qkv={FAKE['qkv'] + 2}"),
    ({"bias": FAKE["bias"] + 8}, f"bias={FAKE['bias'] + 8}"),
    ({"qOut": None}, "q_out=0"),
    ({"qOut": FAKE["q_out"] + 8}, f"q_out={FAKE['q_out'] + 8}"),
    ({"status": None}, "status=0"),
    ({"positionIds": FAKE["position_ids"] + 2}, f"position_ids={FAKE['position_ids'] + 2}"),
    ({"meta.poolDescs": None}, "pool_descs=0"),
    ({"meta.blockTable": None}, "block_table=0"),
    ({"meta.cuQLens": None}, "cu_q_lens=0"),
    ({"meta.pastLens": None}, "past_lens=0"),
    ({"meta.numTokens": -1}, "num_tokens=-1"),
    ({"meta.numTokens": 2_000_000_000}, "num_tokens=2000000000"),
    ({"meta.numSeqs": 0}, "num_seqs=0"),
    ({"meta.numSeqs": -3}, "num_seqs=-3"),
    ({"meta.maxBlocks": -1}, "max_blocks=-1"),
    ({"meta.poolIndex": -1}, "pool_index=-1"),
    ({"layout.numLayers": 0}, "num_layers=0"),
    ({"layer": 2}, "layer_index=2"),
    ({"layer": -1}, "layer_index=-1"),
    ({"layout.pageSize": 0}, "page_size=0"),
    ({"layout.pageLayout": 2}, "page_layout=2"),
    ({"layout.ringSinkTokens": -1}, "ring_sink_tokens=-1"),
    ({"layout.ringSinkTokens": 4}, "layout.ring_sink_tokens=4"),  # a linear cache keeps no ring sinks
    ({"layout.cyclicLen": 20}, "cyclic_len=20"),
    ({"layout.cyclicLen": -16}, "cyclic_len=-16"),
    ({"layout.numKVHeads": 4}, "layout.num_kv_heads=4"),
    ({"layout.headDim": 64}, "layout.head_dim=64"),
    ({"layout.pageShift": -1}, "layout.page_shift=-1"),
    ({"layout.strideBlock": 7}, "layout.stride_block=7"),
    ({"layout.strideToken": 1}, "layout.stride_token=1"),
]


@pytest.mark.parametrize("overrides,expected", BAD_PARAMS, ids=[e for _, e in BAD_PARAMS])
def test_bad_parameter_is_rejected_naming_field_and_value(overrides, expected):
    params = valid_params(**overrides)
    with pytest.raises(_lib.CapiError) as err:
        write.launch(params)
    message = str(err.value)
    assert expected in message, message
    assert "expected" in message, message
    assert "CUDA error 1:" in message, message  # cudaErrorInvalidValue, not a failed CUDA call


def test_null_params_pointer_is_rejected():
    rc = write._capi().pagedkv_qkv_write(None, None)
    assert rc == 1
    assert _lib.capi().pagedkv_last_error().decode().startswith("params=NULL")


def test_a_failure_never_reports_an_earlier_calls_reason():
    """The launcher clears its reason first: after a rejected launch, a failure of the next one is that one's."""
    from pagedkv import cuda

    with pytest.raises(_lib.CapiError, match="head_dim=96"):
        write.launch(valid_params(headDim=96))
    write.launch(valid_params(**{"meta.numTokens": 0, "meta.numSeqs": 0}))  # success: nothing to report
    with pytest.raises(_lib.CapiError, match="k_scale=0") as err:
        write.launch(valid_params(kScale=0.0))
    assert "head_dim" not in str(err.value)
    if cuda.why_no_gpu() is None:
        pytest.skip("a GPU is present: launching with fake pointers would fault (covered by the GPU tests)")
    # Valid parameters on a machine without a GPU: the launch itself fails, and says so (not "k_scale=0").
    with pytest.raises(_lib.CapiError) as err:
        write.launch(valid_params())
    message = str(err.value)
    assert "launchQKVWrite: cuda" in message and "k_scale" not in message, message


def test_empty_step_is_a_no_op_without_touching_cuda():
    # T = 0: validated, then nothing to launch (null pointers are fine: nothing is read or written).
    empty = {"meta.numTokens": 0, "meta.numSeqs": 0, "meta.maxBlocks": 0, "qkv": None, "qOut": None, "status": None,
             "meta.poolDescs": None, "meta.blockTable": None, "meta.cuQLens": None, "meta.pastLens": None}
    write.launch(valid_params(**empty))
    with pytest.raises(_lib.CapiError, match="head_dim=96"):  # and an empty step is still validated
        write.launch(valid_params(**empty, headDim=96))


def test_python_wrapper_checks_optional_inputs_against_config():
    meta = write.StepPointers(1 << 16, 1 << 16, 1 << 16, 1 << 16, num_seqs=1, num_tokens=1, max_blocks=1)
    with pytest.raises(ValueError, match="bias: WriteConfig.has_bias=False"):
        write.qkv_write(1 << 16, 1 << 16, 1 << 16, meta, make_cfg(), io_dtype=write.IODType.FP16, bias=1 << 16)
    with pytest.raises(ValueError, match="position_ids: WriteConfig.explicit_positions=False"):
        write.qkv_write(1 << 16, 1 << 16, 1 << 16, write.StepPointers(**{**meta.__dict__, "position_ids": 1 << 16}),
                        make_cfg(), io_dtype=write.IODType.FP16)


def as_dict(struct) -> dict:
    """A ctypes mirror's members (nested structs as dicts, arrays as lists)."""
    out = {}
    for name, ctype in struct._fields_:
        value = getattr(struct, name)
        out[name] = (as_dict(value) if isinstance(value, ctypes.Structure)
                     else list(value) if isinstance(value, ctypes.Array) else value)
    return out


def test_write_params_carries_every_attribute():
    cfg = WriteConfig(num_q_heads=16, has_bias=True, explicit_positions=True, zero_v_tail=False, q_out_fp8=True,
                      q_scale=0.5,
                      rope=RopeConfig(style=RopeStyle.GPTJ, rotary_dim=32, theta=5e5, scaling=RopeScaling.LLAMA3,
                                      factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_positions=4096),
                      pool=PoolConfig(num_kv_heads=4, head_dim=64, page_size=24, num_layers=3, layer_index=2,
                                      pool_index=1, cache_dtype=CacheDType.INT8, page_layout=1, ring_sink_tokens=5,
                                      cyclic_len=48, k_scale=0.25, v_scale=0.125))
    meta = write.StepPointers(1, 2, 3, 4, num_seqs=5, num_tokens=6, max_blocks=7, position_ids=8)
    got = as_dict(write.write_params(cfg, write.IODType.FP16, qkv=9, q_out=10, status=11, meta=meta, bias=12))
    lay = cfg.pool.layout()  # the Python twin's geometry (tests/test_layout.py checks it against the header)
    inv_freq = write.rope_inv_freq(cfg)
    assert got.pop("rope") == {"style": 2, "rotaryDim": 32, "mscale": 1.0, "longAboveKVLen": 0,
                               "invFreq": list(inv_freq) + [0.0] * (128 - inv_freq.size), "longInvFreq": [0.0] * 128}
    assert got == {
        "numQHeads": 16, "numKVHeads": 4, "headDim": 64, "ioDType": 0, "qkv": 9, "bias": 12, "positionIds": 8,
        "meta": {"poolDescs": 1, "poolIndex": 1, "blockTable": 2, "maxBlocks": 7, "cuQLens": 3, "pastLens": 4,
                 "numSeqs": 5, "numTokens": 6},
        "layout": {"numLayers": 3, "numKVHeads": 4, "pageSize": 24, "headDim": 64, "pageShift": -1, "pageLayout": 1,
                   "ringSinkTokens": 5, "cyclicLen": 48, "bubbleLen": lay.bubble_len, "strideBlock": lay.stride_block,
                   "strideLayer": lay.stride_layer, "strideKV": lay.stride_kv, "strideHead": lay.stride_head,
                   "strideToken": lay.stride_token},
        "cacheDType": 3, "layer": 2, "kScale": 0.25, "vScale": 0.125, "qOut": 10, "qOutFP8": True, "qScale": 0.5,
        "zeroVTail": False, "status": 11}


# (overrides of the RoPE attributes by RopeConfig member, text the error must contain)
BAD_ROPE = [
    ({"rotaryDim": 7}, "rope_rotary_dim=7"),
    ({"rotaryDim": 256}, "rope_rotary_dim=256"),
    ({"style": 5}, "rope_style=5"),
    ({"theta": 0.0}, "rope_theta=0"),
    ({"theta": float("nan")}, "rope_theta=nan"),
    ({"scaling": 7}, "rope_scaling=7"),
    ({"scaling": int(RopeScaling.LINEAR), "factor": 0.0}, "rope_factor=0"),
    ({"scaling": int(RopeScaling.LLAMA3), "lowFreqFactor": 4.0, "highFreqFactor": 4.0}, "rope_high_freq_factor=4"),
    ({"scaling": int(RopeScaling.LLAMA3), "originalMaxPositions": 0}, "rope_original_max_positions=0"),
    ({"scaling": int(RopeScaling.YARN), "factor": 4.0, "betaFast": 0.0}, "rope_beta_fast=0"),
    ({"scaling": int(RopeScaling.YARN), "factor": 4.0, "betaSlow": float("nan")}, "rope_beta_slow=nan"),
    ({"scaling": int(RopeScaling.YARN), "factor": 4.0, "truncate": 2}, "rope_truncate=2"),
    ({"scaling": int(RopeScaling.YARN), "factor": 4.0, "attentionFactor": -1.0}, "rope_attention_factor=-1"),
    ({"scaling": int(RopeScaling.YARN), "factor": 4.0, "originalMaxPositions": -3}, "rope_original_max_positions=-3"),
    ({"scaling": int(RopeScaling.LONGROPE), "numFactors": 0}, "rope_short_factors=0 values"),
    ({"scaling": int(RopeScaling.LONGROPE), "numFactors": 64,
      "shortFactors": (ctypes.c_float * 128)(*([1.0] * 64)), "longFactors": (ctypes.c_float * 128)(*([1.0] * 63))},
     "rope_long_factors[63]=0"),
    ({"scaling": int(RopeScaling.LONGROPE), "numFactors": 64, "factor": 8.0, "originalMaxPositions": 1,
      "shortFactors": (ctypes.c_float * 128)(*([1.0] * 64)), "longFactors": (ctypes.c_float * 128)(*([1.0] * 64))},
     "rope_attention_factor=0"),
]


@pytest.mark.parametrize("overrides,expected", BAD_ROPE, ids=[e for _, e in BAD_ROPE])
def test_bad_rope_attribute_is_rejected_naming_field_and_value(overrides, expected):
    config = write.rope_config(RopeConfig())
    _structs.set_fields(config, overrides)
    with pytest.raises(_lib.CapiError, match="CUDA error 1:") as err:
        write.compute_rope_params(config, 128)
    assert expected in str(err.value) and "expected" in str(err.value), str(err.value)


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
    (128, RopeConfig(theta=1e6, scaling=RopeScaling.YARN, factor=4.0, original_max_positions=32768)),
    (64, RopeConfig(theta=10000.0, scaling=RopeScaling.YARN, factor=40.0, original_max_positions=4096,
                    attention_factor=0.92)),
    (64, RopeConfig(theta=150000.0, scaling=RopeScaling.YARN, factor=32.0, original_max_positions=4096,
                    truncate=False, beta_fast=16.0, beta_slow=2.0)),
    (64, RopeConfig(style=RopeStyle.GPTJ, rotary_dim=32, scaling=RopeScaling.YARN, factor=4.0,
                    original_max_positions=64)),
    (64, RopeConfig(scaling=RopeScaling.LONGROPE, original_max_positions=12, factor=512 / 12,
                    short_factors=tuple(1.0 + 0.05 * i for i in range(32)),
                    long_factors=tuple(1.5 + 0.4 * i for i in range(32)))),
    (128, RopeConfig(scaling=RopeScaling.LONGROPE, rotary_dim=96, original_max_positions=4096, factor=32.0,
                     attention_factor=1.19, short_factors=tuple(1.0 + 0.01 * i for i in range(48)),
                     long_factors=tuple(1.0 + 0.5 * i for i in range(48)))),
    # head dims 80 / 96 (Phi-2's partial rotary, Phi-3-mini's full LongRoPE)
    (80, RopeConfig(rotary_dim=48, scaling=RopeScaling.YARN, factor=4.0, original_max_positions=64)),
    (96, RopeConfig(scaling=RopeScaling.LONGROPE, original_max_positions=30, factor=16.0,
                    short_factors=tuple(1.0 + 0.02 * i for i in range(48)),
                    long_factors=tuple(1.5 + 0.5 * i for i in range(48)))),
]


@pytest.mark.parametrize("head_dim,rope", ROPE_CASES, ids=[f"D{d}-{r.style.name}-R{r.rotary_dim}-{r.scaling.name}"
                                                            for d, r in ROPE_CASES])
def test_rope_table_is_the_reference_rounded_once_to_float32(head_dim, rope):
    cfg = WriteConfig(num_q_heads=8, rope=rope, pool=PoolConfig(num_kv_heads=8, head_dim=head_dim, page_size=16,
                                                                num_layers=1, layer_index=0))
    longrope = rope.scaling == RopeScaling.LONGROPE
    for long in (False, True) if longrope else (False,):
        ours = write.rope_inv_freq(cfg, long=long)
        expected = reference_inv_freq(head_dim, rope, long=long)
        assert ours.shape == expected.shape
        # Both evaluate the same double-precision formula; std::pow and numpy's ** may differ in the last bit of
        # the double, which can move the float32 rounding by at most one float32 step.
        nearest = expected.astype(np.float32)
        assert np.all(np.abs(ours.astype(np.float64) - nearest) <= np.spacing(nearest).astype(np.float64)), \
            np.flatnonzero(ours != nearest)
        assert np.count_nonzero(ours != nearest) <= 1
    params = write.rope_params(cfg)
    assert params.mscale == np.float32(reference_attention_factor(rope))
    assert params.longAboveKVLen == (rope.original_max_positions if longrope else 0)
    if not longrope:
        assert not any(params.longInvFreq)


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


# ---- the launcher's work decomposition -----------------------------------------------------------------------
# 132 SMs x 3 CTAs x 8 warps (an H200) and other wave sizes; passes per token: NHR / RPP for real head counts.
RESIDENT_WARPS = (1, 24, 3168, 2592, 4224)
TOKEN_WARP_WAVES = 4  # kQKVWriteTokenWarpWaves


def warp_ranges(total: int, warps: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's balanced ranges (warpRangeOf): warp w takes pairs [w * total // N, (w + 1) * total // N)."""
    w = np.arange(warps, dtype=np.int64)
    return w * total // warps, (w + 1) * total // warps


@settings(max_examples=300, deadline=None)
@given(tokens=st.integers(1, 60000), passes=st.sampled_from((1, 2, 3, 6, 12, 16, 24, 40, 64)),
       resident=st.sampled_from(RESIDENT_WARPS))
def test_write_warps_split_the_pairs_as_the_policy_says(tokens, passes, resident):
    total = tokens * passes
    n = write.write_warps(tokens, passes, resident)
    begin, end = warp_ranges(total, n)
    assert begin[0] == 0 and end[-1] == total and np.array_equal(begin[1:], end[:-1])  # a partition
    if total <= resident:  # decode: one pass per warp
        assert n == total
        return
    assert np.all(end > begin)  # no idle warp
    crossing = (begin // passes) != ((end - 1) // passes)
    if resident // tokens >= 4:  # whole warps per token, >= 3/4 of the wave: no warp pays two tokens' chains
        assert n == tokens * (resident // tokens) and 4 * n >= 3 * resident
        assert not crossing.any()
    elif tokens >= TOKEN_WARP_WAVES * resident:  # long prefill: one warp per token, over several waves
        assert n == tokens
        assert np.array_equal(begin, np.arange(tokens) * passes)
    else:  # one wave of every resident warp
        assert n == resident


@pytest.mark.parametrize("args, message", [
    ((0, 24, 3168), "num_tokens=0: expected >= 1"),
    ((16, 0, 3168), "passes_per_token=0: expected >= 1"),
    ((16, 24, 0), "resident_warps=0: expected in [1, 2^31)"),
    ((16, 24, 2**31), "resident_warps=2147483648: expected in [1, 2^31)"),
])
def test_write_warps_rejects_bad_counts(args, message):
    with pytest.raises(_lib.CapiError, match=re.escape(message)):
        write.write_warps(*args)
