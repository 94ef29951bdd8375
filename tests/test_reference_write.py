"""pagedkv.reference.quant and pagedkv.reference.write against independent formulations.

quant: rounding against brute-force nearest-even on an independently decoded e4m3 grid, bf16 near-ties built
from bit patterns, numpy's own (correctly rounded) float16 cast; round-trip bounds from conftest.TOLERANCES.
write: the pool after a write against an expected pool built by plain numpy indexing of ``pool_shape`` (not
through elem_offset), poisoned with NaN first; chunking, decode, batching and a cyclic ring against direct
models; invalid pages.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import TOLERANCES

from pagedkv.config import PoolConfig, RopeConfig, RopeStyle, WriteConfig
from pagedkv.layout import CacheDType, KVLayout, PageLayout
from pagedkv.reference import InvalidPageError, dequantize, qkv_write, quantize
from pagedkv.step import KVWriteError, StepMetadata

FP16, BF16, FP8, INT8 = CacheDType.FP16, CacheDType.BF16, CacheDType.FP8_E4M3, CacheDType.INT8
ALL_DTYPES = [FP16, BF16, FP8, INT8]
HEAD_DIM = 64
FP8_MIN_NORMAL = 2.0 ** -6
FP8_SUBNORMAL_HALF_STEP = 2.0 ** -10  # e4m3: subnormals are multiples of 2**-9


# ======================================================================================================
# quant
# ======================================================================================================
def decode_e4m3fn(code: int) -> float:
    """e4m3fn bits -> value, from the format's definition (bias 7, no inf, S.1111.111 is NaN)."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:
        return sign * mantissa / 8 * 2.0 ** -6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def nearest_even_e4m3(x: np.ndarray) -> np.ndarray:
    """Brute force: the nearest finite e4m3 value, ties to the code with an even mantissa."""
    codes = [c for c in range(256) if not np.isnan(decode_e4m3fn(c)) and c != 0x80]  # one zero
    values = np.array([decode_e4m3fn(c) for c in codes])
    even = np.array([c & 1 == 0 for c in codes])
    out = np.empty_like(x)
    for i, xi in enumerate(x):
        dist = np.abs(values - xi)
        best = np.flatnonzero(dist == dist.min())
        out[i] = values[best[0]] if best.size == 1 else values[best[even[best]][0]]
    return out


def assert_dequantized_close(deq, dense, cache_dtype: CacheDType, scale: float):
    """Round-trip bound of one stored value, with conftest.TOLERANCES for the cache dtype."""
    atol, rtol = TOLERANCES[np.dtype(cache_dtype.numpy_dtype).name]
    if cache_dtype == INT8:  # tolerance in units of the scale
        np.testing.assert_allclose(deq / scale, dense / scale, atol=atol, rtol=rtol)
    elif cache_dtype == FP8:
        normal = np.abs(dense / scale) >= FP8_MIN_NORMAL  # the relative bound holds for normal numbers
        assert normal.mean() > 0.5, "test data should be mostly in e4m3's normal range"
        np.testing.assert_allclose(deq[normal], dense[normal], atol=atol, rtol=rtol)
        assert np.all(np.abs(deq[~normal] - dense[~normal]) <= FP8_SUBNORMAL_HALF_STEP * scale)
    else:
        np.testing.assert_allclose(deq, dense, atol=atol, rtol=rtol)


def data_scale(values, cache_dtype: CacheDType) -> float:
    """Per-tensor scale a calibrator would pick: the largest |value| lands just inside the stored range."""
    top = {FP8: 440.0, INT8: 126.0}.get(cache_dtype)
    return float(np.max(np.abs(values))) / top if top else 1.0


@pytest.mark.parametrize("cache_dtype", ALL_DTYPES)
def test_round_trip_within_tolerances(cache_dtype):
    x = np.random.default_rng(3).standard_normal(20000) * 3.0
    scale = data_scale(x, cache_dtype)
    stored = quantize(x, cache_dtype, scale)
    assert stored.dtype == cache_dtype.numpy_dtype
    assert_dequantized_close(dequantize(stored, cache_dtype, scale), x, cache_dtype, scale)


def test_fp8_rounds_to_nearest_even_on_the_e4m3_grid():
    rng = np.random.default_rng(5)
    grid = np.unique([decode_e4m3fn(c) for c in range(256) if not np.isnan(decode_e4m3fn(c))])
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties, and values a hair either side of them
    x = np.concatenate([rng.uniform(-448, 448, 1500), rng.uniform(-0.05, 0.05, 500), grid, mids,
                        mids * (1 + 2.0 ** -30), mids * (1 - 2.0 ** -30)])
    for scale in (1.0, 0.25, 2.0 ** -7):  # powers of two keep the constructed ties exact after x * scale / scale
        got = dequantize(quantize(x * scale, FP8, scale), FP8, scale) / scale
        np.testing.assert_allclose(got, nearest_even_e4m3(x), rtol=1e-15, atol=0)


def test_bf16_rounds_once_to_nearest_even():
    rng = np.random.default_rng(6)
    codes = rng.integers(0x0080, 0x7F00, 400, dtype=np.uint16)  # positive normal bf16 values
    lo = codes.view(ml_dtypes.bfloat16).astype(np.float64)
    hi = (codes + 1).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    mid = (lo + hi) / 2
    tiny = (hi - lo) * 2.0 ** -30  # far below float32 resolution: a cast through float32 would lose it
    even_is_lo = codes % 2 == 0
    for sign in (1.0, -1.0):
        np.testing.assert_array_equal(quantize(sign * (mid + tiny), BF16).astype(np.float64), sign * hi)
        np.testing.assert_array_equal(quantize(sign * (mid - tiny), BF16).astype(np.float64), sign * lo)
        np.testing.assert_array_equal(quantize(sign * mid, BF16).astype(np.float64),
                                      sign * np.where(even_is_lo, lo, hi))


def test_fp16_matches_numpys_correctly_rounded_cast():
    rng = np.random.default_rng(7)
    codes = rng.integers(0x0001, 0x7BFF, 3000, dtype=np.uint16)  # subnormals and normals
    lo = codes.view(np.float16).astype(np.float64)
    hi = (codes + 1).view(np.float16).astype(np.float64)
    x = np.concatenate([rng.standard_normal(3000) * 100, (lo + hi) / 2, (lo + hi) / 2 + (hi - lo) * 2.0 ** -40])
    x = np.concatenate([x, -x])
    np.testing.assert_array_equal(quantize(x, FP16).view(np.uint16), x.astype(np.float16).view(np.uint16))


def test_a_cast_through_float32_would_round_twice():
    """Why quant.py rounds float64 itself: ml_dtypes casts float64 via float32."""
    x = np.array([1 + 2.0 ** -4 + 2.0 ** -40, 1 + 2.0 ** -8 + 2.0 ** -40])
    assert quantize(x[:1], FP8, 1.0).astype(np.float64)[0] == 1.125
    assert quantize(x[1:], BF16).astype(np.float64)[0] == 1 + 2.0 ** -7


def test_saturation():
    big = np.array([448.0, 449.0, 463.9, 464.0, 1e6, np.inf, -1e6, -np.inf])
    np.testing.assert_array_equal(quantize(big, FP8, 1.0).astype(np.float64),
                                  [448, 448, 448, 448, 448, 448, -448, -448])
    np.testing.assert_array_equal(quantize(big * 0.5, FP8, 0.5).astype(np.float64),
                                  [448, 448, 448, 448, 448, 448, -448, -448])
    np.testing.assert_array_equal(quantize(np.array([127.4, 127.6, 1e9, -128.4, -1e9, np.inf, -np.inf]), INT8, 1.0),
                                  [127, 127, 127, -128, -128, 127, -128])
    # fp16/bf16 are not saturated: like __float2half_rn they overflow to inf
    np.testing.assert_array_equal(quantize(np.array([65504.0, 65519.0, 65520.0, -1e6]), FP16).astype(np.float64),
                                  [65504, 65504, np.inf, -np.inf])
    assert np.isinf(quantize(np.array([1e39]), BF16).astype(np.float64)[0])


def test_int8_rounds_half_to_even():
    halves = np.array([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 126.5, -127.5, 0.49999, 2.50001])
    np.testing.assert_array_equal(quantize(halves, INT8, 1.0), [0, 2, 2, 4, 0, -2, -2, 126, -128, 0, 3])
    np.testing.assert_array_equal(quantize(halves * 0.25, INT8, 0.25), [0, 2, 2, 4, 0, -2, -2, 126, -128, 0, 3])


def test_nan_handling_matches_the_kernels():
    nan = np.array([np.nan])
    assert np.isnan(quantize(nan, FP16).astype(np.float64)[0])
    assert np.isnan(quantize(nan, BF16).astype(np.float64)[0])
    assert np.isnan(quantize(nan, FP8, 1.0).astype(np.float64)[0])
    assert quantize(nan, INT8, 1.0)[0] == -128  # CUDA fmaxf(NaN, -128) = -128


def test_quant_errors_name_the_field():
    with pytest.raises(ValueError, match="scale"):
        quantize(np.ones(2), FP8, 0.0)
    with pytest.raises(ValueError, match="scale"):
        quantize(np.ones(2), INT8, float("nan"))
    with pytest.raises(ValueError, match="scale"):
        dequantize(np.ones(2, np.int8), INT8, -1.0)
    with pytest.raises(TypeError, match="stored"):
        dequantize(np.ones(2, np.float16), BF16)
    with pytest.raises(NotImplementedError, match="NVFP4"):
        quantize(np.ones(2), CacheDType.NVFP4, 1.0)
    quantize(np.ones(2), FP16, None)  # fp16/bf16 ignore the scale


# ======================================================================================================
# write
# ======================================================================================================
def rotate_half(x, positions):
    """NEOX RoPE, full rotary, theta 1e4, written independently of pagedkv.reference.rope."""
    d = x.shape[-1]
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, d, 2) / d)).astype(np.float32).astype(np.float64)  # stored as float32
    emb = np.concatenate([positions[:, None] * inv_freq] * 2, axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * np.cos(emb) + rotated * np.sin(emb)


def bits(a: np.ndarray) -> np.ndarray:
    """Bit patterns (NaN == NaN, -0 != +0): for exact comparisons of pools."""
    return a.view({1: np.uint8, 2: np.uint16}[a.dtype.itemsize])


def pool_index(layout: KVLayout, block: int, layer: int, kv: int, head: int, offset: int) -> tuple:
    """Index of one K/V row in an array of ``pool_shape``: plain numpy indexing, not elem_offset."""
    if layout.page_layout == PageLayout.HND:
        return block, layer, kv, head, offset
    return block, layer, kv, offset, head


def poisoned_pool(layout: KVLayout, num_blocks: int, cache_dtype: CacheDType, rng) -> np.ndarray:
    shape = layout.pool_shape(num_blocks)
    if cache_dtype == INT8:  # no NaN in int8: random bytes, compared bit for bit all the same
        return rng.integers(-128, 128, size=shape, dtype=np.int8)
    return np.full(shape, np.nan, dtype=cache_dtype.numpy_dtype)


def dense_qkv(qkv, bias, num_q_heads, num_kv_heads, positions):
    x = qkv.astype(np.float64) + (0 if bias is None else bias.astype(np.float64))
    x = x.reshape(len(qkv), num_q_heads + 2 * num_kv_heads, HEAD_DIM)
    q, k, v = x[:, :num_q_heads], x[:, num_q_heads:num_q_heads + num_kv_heads], x[:, num_q_heads + num_kv_heads:]
    return rotate_half(q, positions), rotate_half(k, positions), v


def allocate(seqs, page_size: int, rng, spare: int = 3):
    """Block table for sequences given as (past_len, q_len) on a linear cache: shuffled distinct blocks, one
    trailing -1 column, a few spare blocks in the pool. Returns (StepMetadata, num_blocks)."""
    pages = [-(-(past + q) // page_size) for past, q in seqs]
    num_blocks = sum(pages) + spare
    free = list(rng.permutation(num_blocks))
    table = np.full((len(seqs), max(pages) + 1), -1, dtype=np.int32)
    for b, n in enumerate(pages):
        table[b, :n] = [free.pop() for _ in range(n)]
    cu = np.concatenate([[0], np.cumsum([q for _, q in seqs])])
    return StepMetadata(table, cu, np.array([p for p, _ in seqs])), num_blocks


def write_config(cache_dtype, page_layout, page_size, q_heads, kv_heads, *, k_scale=1.0, v_scale=1.0,
                 has_bias=False, zero_v_tail=True, **pool_extra) -> WriteConfig:
    pool = PoolConfig(num_kv_heads=kv_heads, head_dim=HEAD_DIM, page_size=page_size, num_layers=2, layer_index=1,
                      cache_dtype=cache_dtype, page_layout=page_layout, k_scale=k_scale, v_scale=v_scale,
                      **pool_extra)
    return WriteConfig(num_q_heads=q_heads, pool=pool, has_bias=has_bias, zero_v_tail=zero_v_tail)


def read_back(pool, layout: KVLayout, meta: StepMetadata, layer: int, num_blocks: int):
    """Stored K and V [T, KVH, D] of the step's tokens, located through KVLayout.locate + elem_offset."""
    flat = pool.reshape(-1)
    heads = np.arange(layout.num_kv_heads)
    out = []
    for kv in (0, 1):
        rows = []
        for seq in range(meta.num_seqs):
            pos = meta.past_lens[seq] + np.arange(meta.q_lens[seq])
            block, offset, _ = layout.locate(meta.block_table[seq], pos, num_blocks)
            assert np.all(block >= 0)
            base = layout.elem_offset(block[:, None], layer, kv, heads[None, :], offset[:, None])
            rows.append(flat[base[:, :, None] + np.arange(layout.head_dim)])
        out.append(np.concatenate(rows))
    return out


class Scenario:
    """One random step: qkv, bias, the dense q/k/v, scales and a NaN-poisoned pool."""

    def __init__(self, seqs, cache_dtype, page_layout=PageLayout.HND, page_size=16, heads=(8, 2), bias=False,
                 zero_v_tail=True, seed=0, qkv_dtype=np.float32):
        rng = np.random.default_rng(seed)
        self.seqs, self.cache_dtype = seqs, cache_dtype
        self.meta, self.num_blocks = allocate(seqs, page_size, rng)
        h, kvh = heads
        t = self.meta.num_tokens
        self.qkv = rng.standard_normal((t, (h + 2 * kvh) * HEAD_DIM)).astype(qkv_dtype)
        self.bias = rng.standard_normal((h + 2 * kvh) * HEAD_DIM).astype(qkv_dtype) if bias else None
        self.q, self.k, self.v = dense_qkv(self.qkv, self.bias, h, kvh, self.meta.token_cache_pos.astype(np.float64))
        self.cfg = write_config(cache_dtype, page_layout, page_size, h, kvh, has_bias=bias, zero_v_tail=zero_v_tail,
                                k_scale=data_scale(self.k, cache_dtype), v_scale=data_scale(self.v, cache_dtype))
        self.layout = self.cfg.pool.layout()
        self.pool = poisoned_pool(self.layout, self.num_blocks, cache_dtype, rng)
        self.before = self.pool.copy()

    def run(self):
        return qkv_write(self.qkv, self.bias, self.meta, self.pool, self.cfg)

    def expected_pool(self):
        """The pool as the contract says it must be after the step, by direct indexing."""
        exp = self.before.copy()
        lay, layer, p = self.layout, self.cfg.pool.layer_index, self.layout.page_size
        k_st = quantize(self.k, self.cache_dtype, self.cfg.pool.k_scale)
        v_st = quantize(self.v, self.cache_dtype, self.cfg.pool.v_scale)
        tails = 0
        for seq, (past, q_len) in enumerate(self.seqs):
            row = self.meta.block_table[seq]
            for i in range(q_len):
                t, pos = self.meta.cu_q_lens[seq] + i, past + i
                for h in range(lay.num_kv_heads):
                    exp[pool_index(lay, row[pos // p], layer, 0, h, pos % p)] = k_st[t, h]
                    exp[pool_index(lay, row[pos // p], layer, 1, h, pos % p)] = v_st[t, h]
            if q_len > 1:  # a prefill chunk: V rows after its last token, in its last page
                last = past + q_len - 1
                for offset in range(last % p + 1, p):
                    tails += 1
                    for h in range(lay.num_kv_heads):
                        if self.cfg.zero_v_tail:
                            exp[pool_index(lay, row[last // p], layer, 1, h, offset)] = 0
        return exp, tails


HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}
MIXED = ((0, 37), (13, 30), (47, 1), (5, 0))  # prefill, chunk over a prefix across pages, decode, idle


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("page_size", [16, 24])
@pytest.mark.parametrize("page_layout", list(PageLayout), ids=lambda p: p.name)
@pytest.mark.parametrize("cache_dtype", ALL_DTYPES, ids=lambda c: c.name)
def test_paged_write_reads_back_the_dense_tensors(cache_dtype, page_layout, page_size, heads, bias):
    sc = Scenario(MIXED, cache_dtype, page_layout, page_size, HEADS[heads], bias)
    q_out = sc.run()
    np.testing.assert_allclose(q_out, sc.q, rtol=1e-12, atol=1e-12)
    k_stored, v_stored = read_back(sc.pool, sc.layout, sc.meta, sc.cfg.pool.layer_index, sc.num_blocks)
    np.testing.assert_array_equal(bits(k_stored), bits(quantize(sc.k, cache_dtype, sc.cfg.pool.k_scale)))
    np.testing.assert_array_equal(bits(v_stored), bits(quantize(sc.v, cache_dtype, sc.cfg.pool.v_scale)))
    assert_dequantized_close(dequantize(k_stored, cache_dtype, sc.cfg.pool.k_scale), sc.k, cache_dtype,
                             sc.cfg.pool.k_scale)
    assert_dequantized_close(dequantize(v_stored, cache_dtype, sc.cfg.pool.v_scale), sc.v, cache_dtype,
                             sc.cfg.pool.v_scale)


@pytest.mark.parametrize("zero_v_tail", [True, False], ids=["tail", "notail"])
@pytest.mark.parametrize("page_size", [16, 24])
@pytest.mark.parametrize("page_layout", list(PageLayout), ids=lambda p: p.name)
@pytest.mark.parametrize("cache_dtype", ALL_DTYPES, ids=lambda c: c.name)
def test_exactly_the_expected_slots_change(cache_dtype, page_layout, page_size, zero_v_tail):
    sc = Scenario(MIXED, cache_dtype, page_layout, page_size, zero_v_tail=zero_v_tail, seed=11)
    sc.run()
    expected, tails = sc.expected_pool()
    assert tails > 0  # the scenario has V tails to zero (or to leave alone)
    np.testing.assert_array_equal(bits(sc.pool), bits(expected))
    if cache_dtype != INT8:  # everything not written is still the NaN poison
        untouched = np.isnan(expected.astype(np.float64))
        assert untouched.sum() > sc.pool.size // 2
        assert np.all(np.isnan(sc.pool.astype(np.float64)[untouched]))


@pytest.mark.parametrize("page_size", [16, 24])
@pytest.mark.parametrize("page_layout", list(PageLayout), ids=lambda p: p.name)
@pytest.mark.parametrize("cache_dtype", ALL_DTYPES, ids=lambda c: c.name)
def test_three_chunk_prefill_equals_one_prefill(cache_dtype, page_layout, page_size):
    one = Scenario(((0, 50),), cache_dtype, page_layout, page_size, seed=21)
    q_one = one.run()
    pool = one.before.copy()
    q_chunks = []
    for past, q_len in ((0, 17), (17, 20), (37, 13)):
        meta = StepMetadata(one.meta.block_table, np.array([0, q_len]), np.array([past]))
        q_chunks.append(qkv_write(one.qkv[past:past + q_len], None, meta, pool, one.cfg))
    np.testing.assert_array_equal(bits(pool), bits(one.pool))
    np.testing.assert_array_equal(np.concatenate(q_chunks), q_one)
    assert not np.array_equal(bits(one.pool), bits(one.before))


@pytest.mark.parametrize("page_size", [16, 24])
@pytest.mark.parametrize("cache_dtype", [FP16, INT8], ids=lambda c: c.name)
def test_decode_after_prefill(cache_dtype, page_size):
    """Prefill 30 tokens, then decode 5 one at a time: each decode step changes exactly its K and V rows, the
    V rows after it stay as they were (decode does not zero), and the whole history reads back."""
    full = Scenario(((0, 35),), cache_dtype, PageLayout.NHD, page_size, seed=31)
    lay, layer, pool = full.layout, full.cfg.pool.layer_index, full.pool
    row = full.meta.block_table[0]
    prefill = StepMetadata(full.meta.block_table, np.array([0, 30]), np.array([0]))
    qkv_write(full.qkv[:30], None, prefill, pool, full.cfg)
    k_st = quantize(full.k, cache_dtype, full.cfg.pool.k_scale)
    v_st = quantize(full.v, cache_dtype, full.cfg.pool.v_scale)
    for pos in range(30, 35):
        expected = pool.copy()
        for h in range(lay.num_kv_heads):
            expected[pool_index(lay, row[pos // page_size], layer, 0, h, pos % page_size)] = k_st[pos, h]
            expected[pool_index(lay, row[pos // page_size], layer, 1, h, pos % page_size)] = v_st[pos, h]
        step = StepMetadata(full.meta.block_table, np.array([0, 1]), np.array([pos]))
        qkv_write(full.qkv[pos:pos + 1], None, step, pool, full.cfg)
        np.testing.assert_array_equal(bits(pool), bits(expected), err_msg=f"decode at {pos}")
    k_stored, v_stored = read_back(pool, lay, full.meta, layer, full.num_blocks)
    np.testing.assert_array_equal(bits(k_stored), bits(k_st))
    np.testing.assert_array_equal(bits(v_stored), bits(v_st))
    if page_size == 16:  # position 32 opened page 2 in a decode step: its later V rows are still poison
        if cache_dtype != INT8:
            tail = pool[row[2], layer, 1, 3:]  # NHD: [P, KVH, D]
            assert np.all(np.isnan(tail.astype(np.float64)))


@pytest.mark.parametrize("cache_dtype", [BF16, FP8], ids=lambda c: c.name)
def test_one_batched_step_equals_one_step_per_sequence(cache_dtype):
    sc = Scenario(MIXED, cache_dtype, PageLayout.HND, 24, seed=41)
    q_batched = sc.run()
    pool = sc.before.copy()
    q_each = []
    for seq, (past, q_len) in enumerate(MIXED):
        rows = slice(sc.meta.cu_q_lens[seq], sc.meta.cu_q_lens[seq + 1])
        meta = StepMetadata(sc.meta.block_table[seq:seq + 1], np.array([0, q_len]), np.array([past]))
        q_each.append(qkv_write(sc.qkv[rows], None, meta, pool, sc.cfg))
    np.testing.assert_array_equal(bits(pool), bits(sc.pool))
    np.testing.assert_array_equal(np.concatenate(q_each), q_batched)


def test_q_out_fp8_is_quantized_then_dequantized():
    sc = Scenario(MIXED, FP16, seed=51)
    q_plain = sc.run()
    cfg = WriteConfig(num_q_heads=sc.cfg.num_q_heads, pool=sc.cfg.pool, q_out_fp8=True, q_scale=0.02)
    q_fp8 = qkv_write(sc.qkv, None, sc.meta, sc.before.copy(), cfg)
    np.testing.assert_array_equal(q_fp8, quantize(q_plain, FP8, 0.02).astype(np.float64) * 0.02)
    assert not np.array_equal(q_fp8, q_plain)


# ---- cyclic window with sinks ----------------------------------------------------------------------------
class RingModel:
    """Direct model of a cyclic cache: sinks occupy slots [0, sinks), the ring's cyclic_len slots start at the
    first page boundary after them, position p >= sinks goes to ring slot (p - sinks) mod cyclic_len."""

    def __init__(self, page_size, sinks, cyclic_len):
        self.page_size, self.sinks, self.cyclic_len = page_size, sinks, cyclic_len
        self.ring_start = -(-sinks // page_size) * page_size
        self.written = set()
        self.wrapped = False

    def slot(self, pos):
        return pos if pos < self.sinks else self.ring_start + (pos - self.sinks) % self.cyclic_len

    def write(self, pos):
        s = self.slot(pos)
        self.wrapped |= s in self.written  # a ring slot written a second time: the ring has wrapped
        self.written.add(s)
        return s

    @property
    def pages(self):
        return -(-(self.ring_start + self.cyclic_len) // self.page_size)


@pytest.mark.parametrize("page_layout", list(PageLayout), ids=lambda p: p.name)
@pytest.mark.parametrize("cache_dtype", [FP16, INT8], ids=lambda c: c.name)
@pytest.mark.parametrize("page_size, sinks, cyclic_len, steps", [
    (4, 3, 8, [6, 5, 1, 1, 3, 1, 7, 2, 1, 5]),
    (4, 6, 8, [5, 3, 6, 1, 8, 2, 3]),
    (16, 5, 32, [20, 30, 1, 1, 25, 9, 32, 3]),
    (3, 0, 6, [4, 1, 5, 2, 6, 1, 4]),
    (24, 24, 48, [30, 40, 1, 47, 5]),
], ids=["p4s3", "p4s6", "p16s5", "p3s0", "p24s24"])
def test_cyclic_ring_with_sinks_matches_direct_model(cache_dtype, page_layout, page_size, sinks, cyclic_len, steps):
    rng = np.random.default_rng(61)
    ring = RingModel(page_size, sinks, cyclic_len)
    total = sum(steps)
    assert total > sinks + 2 * cyclic_len  # wraps at least twice
    num_blocks = ring.pages + 2
    row = rng.permutation(num_blocks)[:ring.pages].astype(np.int32)
    qkv = rng.standard_normal((total, 16 * HEAD_DIM)).astype(np.float32)
    _, k, v = dense_qkv(qkv, None, 8, 4, np.arange(total, dtype=np.float64))
    cfg = write_config(cache_dtype, page_layout, page_size, 8, 4, ring_sink_tokens=sinks, cyclic_len=cyclic_len,
                       k_scale=data_scale(k, cache_dtype), v_scale=data_scale(v, cache_dtype))
    layout, layer = cfg.pool.layout(), cfg.pool.layer_index
    k_st, v_st = quantize(k, cache_dtype, cfg.pool.k_scale), quantize(v, cache_dtype, cfg.pool.v_scale)
    pool = poisoned_pool(layout, num_blocks, cache_dtype, rng)
    expected = pool.copy()
    zeroed_tails = kept_tails = 0
    past = 0
    for q_len in steps:
        meta = StepMetadata(row[None, :], np.array([0, q_len]), np.array([past]))
        qkv_write(qkv[past:past + q_len], None, meta, pool, cfg)
        for pos in range(past, past + q_len):
            s = ring.write(pos)
            for h in range(4):
                expected[pool_index(layout, row[s // page_size], layer, 0, h, s % page_size)] = k_st[pos, h]
                expected[pool_index(layout, row[s // page_size], layer, 1, h, s % page_size)] = v_st[pos, h]
        last = ring.slot(past + q_len - 1)
        tail = range(last % page_size + 1, page_size)
        if q_len > 1 and len(tail):
            if ring.wrapped:
                kept_tails += 1  # rows after the newest slot hold the oldest live tokens
            else:
                zeroed_tails += 1
                for offset in tail:
                    for h in range(4):
                        expected[pool_index(layout, row[last // page_size], layer, 1, h, offset)] = 0
        past += q_len
        np.testing.assert_array_equal(bits(pool), bits(expected), err_msg=f"after writing up to {past}")
    assert zeroed_tails > 0 and kept_tails > 0, (zeroed_tails, kept_tails)


def test_a_step_longer_than_the_ring_is_rejected():
    cfg = write_config(FP16, PageLayout.HND, 4, 4, 1, ring_sink_tokens=2, cyclic_len=8)
    meta = StepMetadata(np.array([[0, 1, 2]]), np.array([0, 11]), np.array([0]))  # positions 2..10: 9 > 8
    pool = np.full(cfg.pool.layout().pool_shape(3), np.nan, np.float16)
    with pytest.raises(ValueError, match="cyclic_len=8"):
        qkv_write(np.zeros((11, 6 * HEAD_DIM)), None, meta, pool, cfg)
    assert np.all(np.isnan(pool.astype(np.float64)))


def test_two_sequences_on_one_page_are_rejected():
    """A page with two owners in one step: the kernel would race, the reference refuses before writing."""
    cfg = write_config(FP16, PageLayout.HND, 16, 4, 1)
    pool = np.full(cfg.pool.layout().pool_shape(8), np.nan, np.float16)
    qkv = np.ones((6, 6 * HEAD_DIM))
    same_rows = StepMetadata(np.array([[3, -1], [3, -1]]), np.array([0, 5, 6]), np.array([0, 2]))
    with pytest.raises(ValueError, match="sequences 0 and 1 both write block 3 offset 2"):
        qkv_write(qkv, None, same_rows, pool, cfg)
    # sequence 1's decode lands at block 3 offset 9: inside the V tail sequence 0's prefill chunk would zero
    tail_row = StepMetadata(np.array([[3, -1], [7, 3]]), np.array([0, 5, 6]), np.array([0, 25]))
    with pytest.raises(ValueError, match="zero_v_tail"):
        qkv_write(qkv, None, tail_row, pool, cfg)
    assert np.all(np.isnan(pool.astype(np.float64)))
    no_tail = write_config(FP16, PageLayout.HND, 16, 4, 1, zero_v_tail=False)
    qkv_write(qkv, None, tail_row, pool, no_tail)  # without tail zeroing the two writes do not overlap


# ---- invalid pages -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, entry, match", [
    ("sentinel", -1, "invalid-page sentinel"),
    ("past_pool", "NB+3", "outside the pool"),
    ("negative", -2, "outside the pool"),
    ("past_width", None, "past the block table's width"),
])
def test_invalid_page_raises_and_leaves_the_pool_untouched(kind, entry, match):
    sc = Scenario(((0, 20), (13, 30), (47, 1)), FP16, PageLayout.HND, 16, seed=71)
    meta = sc.meta
    if kind == "past_width":
        # a table only 2 pages wide: sequence 0 (positions 0..19) fits, sequence 1 (13..42) needs page 2
        meta = StepMetadata(meta.block_table[:, :2], meta.cu_q_lens, meta.past_lens)
        want_seq, want_page, want_entry = 1, 2, -1
    else:
        table = meta.block_table.copy()
        table[1, 1] = sc.num_blocks + 3 if entry == "NB+3" else entry
        meta = StepMetadata(table, meta.cu_q_lens, meta.past_lens)
        want_seq, want_page, want_entry = 1, 1, int(table[1, 1])
    with pytest.raises(InvalidPageError, match=match) as err:
        qkv_write(sc.qkv, None, meta, sc.pool, sc.cfg)
    assert isinstance(err.value, KVWriteError)
    assert (err.value.seq, err.value.page_in_seq, err.value.entry) == (want_seq, want_page, want_entry)
    named = (f"sequence {want_seq} needs page {want_page}" if kind == "past_width"
             else f"block_table[{want_seq}][{want_page}] = {want_entry}")
    assert named in str(err.value)
    np.testing.assert_array_equal(bits(sc.pool), bits(sc.before))  # sequence 0 was valid: still not written


def test_invalid_entries_no_token_lands_on_are_fine():
    """Pages before past_len (evicted, or outside a window) may be -1: the write never touches them."""
    sc = Scenario(((40, 6), (0, 3)), FP16, PageLayout.HND, 16, seed=81)
    table = sc.meta.block_table.copy()
    table[0, 0] = table[0, 1] = -1  # positions 0..31 of sequence 0 are gone; it writes 40..45 on page 2
    meta = StepMetadata(table, sc.meta.cu_q_lens, sc.meta.past_lens)
    qkv_write(sc.qkv, None, meta, sc.pool, sc.cfg)
    k_stored, _ = read_back(sc.pool, sc.layout, meta, 1, sc.num_blocks)
    np.testing.assert_array_equal(bits(k_stored), bits(quantize(sc.k, FP16)))


# ---- input validation ------------------------------------------------------------------------------------
def test_bad_inputs_name_the_field():
    sc = Scenario(MIXED, FP16, seed=91)
    with pytest.raises(ValueError, match="qkv"):
        qkv_write(sc.qkv[:, :-1], None, sc.meta, sc.pool, sc.cfg)
    with pytest.raises(ValueError, match="qkv"):
        qkv_write(sc.qkv[:-1], None, sc.meta, sc.pool, sc.cfg)
    with pytest.raises(ValueError, match="bias"):
        qkv_write(sc.qkv, np.zeros(sc.qkv.shape[1]), sc.meta, sc.pool, sc.cfg)  # has_bias=0
    biased = WriteConfig(num_q_heads=sc.cfg.num_q_heads, pool=sc.cfg.pool, has_bias=True)
    with pytest.raises(ValueError, match="bias"):
        qkv_write(sc.qkv, None, sc.meta, sc.pool, biased)
    with pytest.raises(ValueError, match="bias"):
        qkv_write(sc.qkv, np.zeros(7), sc.meta, sc.pool, biased)
    with pytest.raises(ValueError, match="pool"):
        qkv_write(sc.qkv, None, sc.meta, sc.pool.astype(ml_dtypes.bfloat16), sc.cfg)
    with pytest.raises(ValueError, match="pool"):
        qkv_write(sc.qkv, None, sc.meta, sc.pool[:, :, :, :, :8], sc.cfg)
    with pytest.raises(ValueError, match="contiguous"):
        qkv_write(sc.qkv, None, sc.meta, np.asfortranarray(sc.pool), sc.cfg)
    with pytest.raises(ValueError, match="q_scale"):  # the config refuses it before any write (capability table)
        WriteConfig(num_q_heads=sc.cfg.num_q_heads, pool=sc.cfg.pool, q_out_fp8=True, q_scale=0.0)
    np.testing.assert_array_equal(bits(sc.pool), bits(sc.before))


def test_rope_style_none_writes_k_unrotated():
    sc = Scenario(((3, 5),), BF16, seed=92)
    cfg = WriteConfig(num_q_heads=sc.cfg.num_q_heads, pool=sc.cfg.pool, rope=RopeConfig(style=RopeStyle.NONE))
    q_out = qkv_write(sc.qkv, None, sc.meta, sc.pool, cfg)
    x = sc.qkv.astype(np.float64).reshape(5, 12, HEAD_DIM)
    np.testing.assert_array_equal(q_out, x[:, :8])
    k_stored, _ = read_back(sc.pool, sc.layout, sc.meta, 1, sc.num_blocks)
    np.testing.assert_array_equal(bits(k_stored), bits(quantize(x[:, 8:10], BF16)))
