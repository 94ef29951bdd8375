"""The fused QKV-preprocess + paged KV write kernel (``launchQKVWrite`` through the C API) on a GPU, against
the float64 reference ``pagedkv.reference.write.qkv_write``.

Every case starts from a poisoned pool (NaN bit patterns for fp16/bf16/e4m3, a sentinel for int8) and checks:
- exactly the slots the reference writes change, the V tail rows become zero, every other byte keeps its
  bits (the written set comes from the reference run on an fp16 mirror of the pool, so int8 needs no NaN);
- the written values match the reference: fp16/bf16 within ``conftest.TOLERANCES``; fp8/int8 stored codes at
  most one quantization step apart (the same value rounded at a boundary) and almost all identical;
- q matches the reference's float64 q within ``conftest.TOLERANCES`` (one e4m3 step with q_out_fp8);
- q rows start as NaN on the device (0xFF), so a row the kernel skipped fails.
The reference takes its inverse frequencies in float64 while the kernel's table is float32 (RopeParams), so
the cases keep positions where that difference stays far below fp16's resolution; the large-position case
uses a theta whose frequencies are exact powers of two (identical in both).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import pytest
from conftest import TOLERANCES

from pagedkv.config import PoolConfig, RopeConfig, RopeScaling, RopeStyle, WriteConfig
from pagedkv.kernels.write import qkv_write_numpy, qkv_write_numpy_unchecked
from pagedkv.layout import INVALID_BLOCK, CacheDType, PageLayout
from pagedkv.reference import qkv_write as reference_qkv_write
from pagedkv.step import (STATUS_BLOCK_OUT_OF_RANGE, STATUS_FLAGS, STATUS_INVALID_BLOCK, STATUS_PAST_BLOCK_TABLE,
                          KVWriteError, StepMetadata)

pytestmark = pytest.mark.gpu

IO_DTYPES = {"fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}
INT8_SENTINEL = -77  # int8 pools start here; the written set comes from the fp16 mirror, not from this value
# Scales that spread N(0, 1)-ish activations over the quantized range (a few values saturate / clip).
QUANT_SCALES = {CacheDType.FP8_E4M3: (1 / 64, 1 / 48), CacheDType.INT8: (4 / 127, 3 / 127)}


@dataclass(frozen=True)
class Case:
    """One step (or the first step) of a write test. ``q_lens[b]`` new tokens after ``past_lens[b]`` cached."""

    name: str
    q_lens: tuple[int, ...]
    past_lens: tuple[int, ...]
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 128
    page_size: int = 16
    io: str = "bf16"
    cache: CacheDType = CacheDType.BF16
    page_layout: PageLayout = PageLayout.HND
    rope: RopeConfig = field(default_factory=RopeConfig)
    bias: bool = False
    explicit_positions: bool = False
    sinks: int = 0
    cyclic: int = 0
    q_out_fp8: bool = False
    zero_v_tail: bool = True
    num_layers: int = 2
    layer: int = 1
    pool_index: int = 0
    spare_blocks: int = 3  # blocks no sequence owns: they must stay untouched

    def __post_init__(self):
        assert len(self.q_lens) == len(self.past_lens), self.name
        assert self.io in IO_DTYPES, self.name

    def cfg(self) -> WriteConfig:
        k_scale, v_scale = QUANT_SCALES.get(self.cache, (1.0, 1.0))
        pool = PoolConfig(num_kv_heads=self.kv_heads, head_dim=self.head_dim, page_size=self.page_size,
                          num_layers=self.num_layers, layer_index=self.layer, pool_index=self.pool_index,
                          cache_dtype=self.cache, page_layout=self.page_layout, ring_sink_tokens=self.sinks,
                          cyclic_len=self.cyclic, k_scale=k_scale, v_scale=v_scale)
        return WriteConfig(num_q_heads=self.heads, pool=pool, rope=self.rope, has_bias=self.bias,
                           explicit_positions=self.explicit_positions, zero_v_tail=self.zero_v_tail,
                           q_out_fp8=self.q_out_fp8, q_scale=0.05)


# ---- data ------------------------------------------------------------------------------------------------
def block_table_for(cfg: WriteConfig, final_lens, rng, spare: int) -> tuple[np.ndarray, int]:
    """Shuffled distinct blocks covering every sequence's final length; -1 past each sequence's pages."""
    layout = cfg.pool.layout()
    pages = [int(layout.pages_needed(n)) for n in final_lens]
    num_blocks = sum(pages) + spare
    perm = rng.permutation(num_blocks).astype(np.int32)
    table = np.full((len(pages), max(pages + [1])), INVALID_BLOCK, dtype=np.int32)
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[at:at + n]
        at += n
    return table, num_blocks


def make_meta(table, q_lens, past_lens, rng, explicit: bool) -> StepMetadata:
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    meta = StepMetadata(table, cu, np.asarray(past_lens, dtype=np.int32))
    if explicit:
        # M-RoPE-like per-sequence deltas plus speculative-decoding-like per-token jitter
        delta = rng.integers(-40, 3000, size=max(meta.num_seqs, 1))[meta.token_seq]
        jitter = rng.integers(0, 4, size=meta.num_tokens)
        meta = StepMetadata(table, cu, meta.past_lens, position_ids=(meta.token_cache_pos + delta + jitter))
    return meta


def make_qkv(cfg: WriteConfig, num_tokens: int, io: str, rng) -> tuple[np.ndarray, np.ndarray | None]:
    width = (cfg.num_q_heads + 2 * cfg.pool.num_kv_heads) * cfg.pool.head_dim
    qkv = rng.standard_normal((num_tokens, width)).astype(IO_DTYPES[io])
    bias = (0.5 * rng.standard_normal(width)).astype(IO_DTYPES[io]) if cfg.has_bias else None
    return qkv, bias


def poisoned_pool(cfg: WriteConfig, num_blocks: int) -> np.ndarray:
    shape = cfg.pool.layout().pool_shape(num_blocks)
    dtype = CacheDType(cfg.pool.cache_dtype).numpy_dtype
    if cfg.pool.cache_dtype == CacheDType.INT8:
        return np.full(shape, INT8_SENTINEL, dtype=dtype)
    return np.full(shape, np.nan, dtype=dtype)


def fp16_mirror(cfg: WriteConfig) -> WriteConfig:
    """Same geometry with an fp16 pool: run on NaN, the reference's written set is where NaN is gone."""
    return dataclasses.replace(cfg, pool=dataclasses.replace(cfg.pool, cache_dtype=CacheDType.FP16,
                                                             k_scale=1.0, v_scale=1.0))


class Run:
    """The kernel's pool and the reference's (plus its fp16 mirror) stepped through the same steps."""

    def __init__(self, cfg: WriteConfig, num_blocks: int):
        self.cfg = cfg
        self.initial = poisoned_pool(cfg, num_blocks)
        self.kernel = self.initial.copy()
        self.ref = self.initial.copy()
        self.mirror_cfg = fp16_mirror(cfg)
        self.mirror = poisoned_pool(self.mirror_cfg, num_blocks)

    def step(self, qkv, bias, meta: StepMetadata) -> None:
        q_kernel = qkv_write_numpy(qkv, bias, meta, self.kernel, self.cfg)
        q_ref = reference_qkv_write(qkv, bias, meta, self.ref, self.cfg)
        reference_qkv_write(qkv, bias, meta, self.mirror, self.mirror_cfg)
        assert_q_matches(q_kernel, q_ref, self.cfg, qkv.dtype)
        assert_pool_matches(self.kernel, self.ref, self.initial, self.written, self.cfg)

    @property
    def written(self) -> np.ndarray:
        return ~np.isnan(self.mirror)


# ---- comparisons -----------------------------------------------------------------------------------------
def bits(a: np.ndarray) -> np.ndarray:
    return a.view({1: np.uint8, 2: np.uint16}[a.dtype.itemsize])


def e4m3_step(magnitude: np.ndarray) -> np.ndarray:
    """Spacing of the e4m3 grid at |x| (3 mantissa bits; subnormal spacing 2^-9 below 2^-6)."""
    exponent = np.floor(np.log2(np.maximum(np.abs(magnitude), 2.0 ** -6)))
    return np.exp2(exponent - 3)


def assert_quantized_close(kernel_stored: np.ndarray, ref_stored: np.ndarray, what: str) -> None:
    """fp8 / int8 stored values: at most one quantization step apart, and almost all identical (a systematic
    off-by-one rounding would pass the first check, not the second)."""
    k, r = kernel_stored.astype(np.float64), ref_stored.astype(np.float64)
    assert not np.isnan(k).any(), f"{what}: NaN where the reference wrote"
    if kernel_stored.dtype == np.int8:
        step = np.ones_like(k)
    else:
        step = e4m3_step(np.maximum(np.abs(k), np.abs(r)))
    worst = np.abs(k - r) / step
    assert worst.max(initial=0) <= 1.0, f"{what}: {worst.max()} quantization steps apart at {np.argmax(worst)}"
    assert np.count_nonzero(k != r) <= max(2, k.size // 1000), f"{what}: {np.count_nonzero(k != r)} of {k.size} differ"


def assert_pool_matches(kernel, ref, initial, written, cfg: WriteConfig) -> None:
    untouched = ~written
    assert written.any()
    assert np.array_equal(bits(kernel)[untouched], bits(initial)[untouched]), \
        f"kernel wrote {np.count_nonzero(bits(kernel)[untouched] != bits(initial)[untouched])} element(s) outside " \
        f"the reference's slots, first at {np.argwhere(untouched & (bits(kernel) != bits(initial)))[:3].tolist()}"
    assert np.array_equal(bits(ref)[untouched], bits(initial)[untouched])  # mirror and reference agree
    cache = CacheDType(cfg.pool.cache_dtype)
    if cache.quantized:
        assert_quantized_close(kernel[written], ref[written], "pool")
    else:
        atol, rtol = TOLERANCES[np.dtype(cache.numpy_dtype).name]
        k, r = kernel[written].astype(np.float64), ref[written].astype(np.float64)
        assert not np.isnan(k).any(), "pool: NaN where the reference wrote"
        np.testing.assert_allclose(k, r, atol=atol, rtol=rtol, err_msg="pool")


def assert_q_matches(q_kernel: np.ndarray, q_ref: np.ndarray, cfg: WriteConfig, io_dtype) -> None:
    assert q_kernel.shape == q_ref.shape
    if cfg.q_out_fp8:
        assert q_kernel.dtype == np.dtype(ml_dtypes.float8_e4m3fn)
        # the reference returns the dequantized fp8 value: back to its e4m3 code (exact up to float64 rounding)
        ref_stored = np.asarray(q_ref / cfg.q_scale, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)
        assert_quantized_close(q_kernel, ref_stored, "q")
    else:
        assert q_kernel.dtype == io_dtype
        atol, rtol = TOLERANCES[np.dtype(io_dtype).name]
        k = q_kernel.astype(np.float64)
        assert not np.isnan(k).any(), f"q: {np.count_nonzero(np.isnan(k))} element(s) not written"
        np.testing.assert_allclose(k, q_ref, atol=atol, rtol=rtol, err_msg="q")


def run_case(case: Case, seed: int = 0) -> Run:
    rng = np.random.default_rng(seed)
    cfg = case.cfg()
    final = [p + q for p, q in zip(case.past_lens, case.q_lens, strict=True)]
    table, num_blocks = block_table_for(cfg, final, rng, case.spare_blocks)
    meta = make_meta(table, case.q_lens, case.past_lens, rng, case.explicit_positions)
    qkv, bias = make_qkv(cfg, meta.num_tokens, case.io, rng)
    run = Run(cfg, num_blocks)
    run.step(qkv, bias, meta)
    return run


# ---- single steps over the configuration space ---------------------------------------------------------------
YARN_QWEN25 = RopeConfig(theta=1e6, scaling=RopeScaling.YARN, factor=4.0, original_max_positions=32768)


def longrope(switch: int, head_dim: int = 128, rotary_dim: int = 0) -> RopeConfig:
    """LongRoPE switching past kv length ``switch``, factors of unit order (short near 1, long 1.5 .. 8), so the
    two tables differ visibly."""
    pairs = (rotary_dim or head_dim) // 2
    return RopeConfig(scaling=RopeScaling.LONGROPE, rotary_dim=rotary_dim, original_max_positions=switch,
                      factor=512 / switch, short_factors=tuple(1.0 + 0.05 * i for i in range(pairs)),
                      long_factors=tuple(1.5 + 6.5 * i / pairs for i in range(pairs)))



MIXED = dict(q_lens=(37, 1, 1, 70, 1), past_lens=(0, 100, 5, 16, 0))
SMALL = dict(heads=4, kv_heads=1, head_dim=64, num_layers=1, layer=0)
# Head dims 32, 80, 96: D / 8 = 4, 10, 12 vectors per head row, so a warp pass is 8, 3 or 2 rows and at 80 / 96
# lanes 30-31 / 24-31 sit idle past the pass's last row (they must load and store nothing). Every cache dtype,
# both page layouts, and each RoPE partner path: NeoX full and partial with R / 2 % 8 == 0 (shuffle), partial
# with R / 2 % 8 != 0 (shared-memory partners, where the idle lanes stage their own words), GPT-J.
HEAD_DIM_CASES = [
    Case("D80-bf16-neox-full", **MIXED, head_dim=80),
    Case("D80-fp16-phi2-partial-R32-bias", **MIXED, head_dim=80, heads=32, kv_heads=32, io="fp16",
         cache=CacheDType.FP16, bias=True, rope=RopeConfig(rotary_dim=32)),
    Case("D80-fp8-nhd-R24-smem-partners-bias", **MIXED, head_dim=80, cache=CacheDType.FP8_E4M3,
         page_layout=PageLayout.NHD, bias=True, rope=RopeConfig(rotary_dim=24)),
    Case("D80-int8-gptj-P24", **MIXED, head_dim=80, cache=CacheDType.INT8, page_size=24,
         rope=RopeConfig(style=RopeStyle.GPTJ)),
    Case("D80-q-out-fp8-R40", **MIXED, head_dim=80, q_out_fp8=True, cache=CacheDType.FP8_E4M3,
         rope=RopeConfig(rotary_dim=40)),
    Case("D96-bf16-neox-full-kv1", **MIXED, head_dim=96, heads=3, kv_heads=1),
    Case("D96-fp16-nhd-R40-smem-partners", **MIXED, head_dim=96, io="fp16", cache=CacheDType.FP16,
         page_layout=PageLayout.NHD, rope=RopeConfig(rotary_dim=40)),
    Case("D96-int8-nhd-gptj-R20-bias", **MIXED, head_dim=96, cache=CacheDType.INT8, page_layout=PageLayout.NHD,
         bias=True, rope=RopeConfig(style=RopeStyle.GPTJ, rotary_dim=20)),
    Case("D96-fp8-explicit-positions", **MIXED, head_dim=96, cache=CacheDType.FP8_E4M3,
         explicit_positions=True),
    Case("D96-cyclic-sinks-P24", q_lens=(45, 1, 10), past_lens=(0, 500, 60), head_dim=96, sinks=7, cyclic=48,
         page_size=24),
    # YaRN and LongRoPE at 80 / 96 (both LongRoPE tables in one launch: MIXED's kv lengths straddle 40), each
    # partner path: shuffle (R / 2 = 40, 32), shared-memory partners (R / 2 = 12, 20), GPT-J
    Case("D80-yarn-neox-full-fp16", **MIXED, head_dim=80, io="fp16", cache=CacheDType.FP16,
         rope=RopeConfig(scaling=RopeScaling.YARN, factor=4.0, original_max_positions=64)),
    Case("D80-longrope-R24-smem-partners-bias", **MIXED, head_dim=80, bias=True,
         rope=longrope(40, head_dim=80, rotary_dim=24)),
    Case("D96-longrope-gptj-fp8-kv1", **MIXED, head_dim=96, heads=3, kv_heads=1, cache=CacheDType.FP8_E4M3,
         rope=dataclasses.replace(longrope(40, head_dim=96), style=RopeStyle.GPTJ)),
    Case("D96-longrope-R40-smem-partners-positions", **MIXED, head_dim=96, explicit_positions=True,
         rope=longrope(40, head_dim=96, rotary_dim=40)),
    Case("D96-yarn-R64-shuffle-nhd", **MIXED, head_dim=96, page_layout=PageLayout.NHD,
         rope=RopeConfig(rotary_dim=64, scaling=RopeScaling.YARN, factor=8.0, original_max_positions=128,
                         attention_factor=1.2)),
    Case("D32-bf16-neox-R8-smem-partners", **MIXED, head_dim=32, rope=RopeConfig(rotary_dim=8)),
    Case("D32-fp16-int8-gptj-nhd", **MIXED, head_dim=32, io="fp16", cache=CacheDType.INT8,
         page_layout=PageLayout.NHD, rope=RopeConfig(style=RopeStyle.GPTJ)),
    Case("D32-fp8-no-rope-P128", q_lens=(129, 1, 200), past_lens=(0, 127, 5), head_dim=32, page_size=128,
         cache=CacheDType.FP8_E4M3, rope=RopeConfig(style=RopeStyle.NONE)),
]
CASES = [
    Case("gqa-bf16-mixed", **MIXED),
    Case("mha-fp16-D64-P32", q_lens=(50, 3, 1), past_lens=(0, 31, 64), heads=4, kv_heads=4, head_dim=64,
         page_size=32, io="fp16", cache=CacheDType.FP16),
    Case("mqa-bf16-D256-P64", q_lens=(65, 1, 130), past_lens=(0, 63, 1), kv_heads=1, head_dim=256, page_size=64),
    Case("gqa-P128", q_lens=(129, 1, 200), past_lens=(0, 127, 5), page_size=128),
    Case("gqa-P24-divmod", q_lens=(49, 1, 23, 1), past_lens=(0, 47, 1, 24), page_size=24),
    Case("gqa-P48-divmod-fp16", q_lens=(97, 2), past_lens=(3, 95), page_size=48, io="fp16", cache=CacheDType.FP16),
    Case("nhd-bf16", q_lens=(33, 1, 17), past_lens=(0, 15, 3), page_layout=PageLayout.NHD),
    Case("nhd-P24-fp8", q_lens=(30, 1, 9), past_lens=(0, 23, 40), page_layout=PageLayout.NHD, page_size=24,
         cache=CacheDType.FP8_E4M3),
    Case("io-bf16-cache-fp16", **MIXED, cache=CacheDType.FP16),
    Case("io-fp16-cache-bf16", **MIXED, io="fp16", cache=CacheDType.BF16),
    Case("io-bf16-cache-fp8", **MIXED, cache=CacheDType.FP8_E4M3),
    Case("io-fp16-cache-fp8", **MIXED, io="fp16", cache=CacheDType.FP8_E4M3),
    Case("io-bf16-cache-int8", **MIXED, cache=CacheDType.INT8),
    Case("io-fp16-cache-int8-D64", **MIXED, io="fp16", cache=CacheDType.INT8, head_dim=64, heads=12, kv_heads=3),
    Case("bias-neox-partial-shuffle", **MIXED, bias=True, rope=RopeConfig(rotary_dim=64)),
    Case("bias-gptj-fp16", **MIXED, bias=True, io="fp16", cache=CacheDType.FP16,
         rope=RopeConfig(style=RopeStyle.GPTJ)),
    Case("bias-neox-R24-smem-partners", **MIXED, bias=True, head_dim=64, rope=RopeConfig(rotary_dim=24)),
    Case("gptj-full", **MIXED, rope=RopeConfig(style=RopeStyle.GPTJ)),
    Case("gptj-R20-D64", **MIXED, head_dim=64, rope=RopeConfig(style=RopeStyle.GPTJ, rotary_dim=20)),
    Case("gptj-R64-D256-int8-nhd", q_lens=(20, 1), past_lens=(0, 9), head_dim=256, cache=CacheDType.INT8,
         page_layout=PageLayout.NHD, rope=RopeConfig(style=RopeStyle.GPTJ, rotary_dim=64)),
    Case("neox-R16-D64", **MIXED, head_dim=64, rope=RopeConfig(rotary_dim=16)),
    Case("neox-R6-D64-fp16", **MIXED, head_dim=64, io="fp16", cache=CacheDType.FP16, rope=RopeConfig(rotary_dim=6)),
    Case("neox-R96-D256", q_lens=(9, 1), past_lens=(0, 300), head_dim=256, rope=RopeConfig(rotary_dim=96)),
    Case("llama3-scaling", **MIXED, rope=RopeConfig(theta=500000.0, scaling=RopeScaling.LLAMA3, factor=8.0,
                                                   original_max_positions=8192)),
    Case("linear-scaling-fp16", **MIXED, io="fp16", cache=CacheDType.FP16,
         rope=RopeConfig(scaling=RopeScaling.LINEAR, factor=4.0)),
    # YaRN: one table and the attention factor on cos and sin (Qwen2.5's recipe; DeepSeek's given factor)
    Case("yarn-qwen2.5", **MIXED, rope=YARN_QWEN25),
    Case("yarn-gptj-R32-D64-fp16-factor", **MIXED, head_dim=64, io="fp16", cache=CacheDType.FP16,
         rope=RopeConfig(style=RopeStyle.GPTJ, rotary_dim=32, scaling=RopeScaling.YARN, factor=40.0,
                         original_max_positions=4096, attention_factor=0.92)),
    # LongRoPE switching at kv length 40: MIXED's sequences end at 37, 101, 6, 86, 1 (short, long, short, long,
    # short) in one launch, so both tables are in use by neighbouring warps.
    Case("longrope-both-tables-shuffle", **MIXED, rope=longrope(40)),
    Case("longrope-R24-smem-partners-positions", **MIXED, head_dim=64, explicit_positions=True,
         rope=longrope(40, head_dim=64, rotary_dim=24)),
    Case("longrope-gptj-fp8", **MIXED, cache=CacheDType.FP8_E4M3,
         rope=dataclasses.replace(longrope(40), style=RopeStyle.GPTJ)),
    Case("longrope-switch-at-the-boundary", q_lens=(1, 1, 5, 5), past_lens=(39, 40, 35, 36), head_dim=64,
         io="fp16", cache=CacheDType.FP16, rope=longrope(40, head_dim=64)),  # kv lens 40 (short), 41, 40, 41
    Case("longrope-decode-batch-300", q_lens=(1,) * 300, past_lens=tuple(range(0, 600, 2)), **SMALL,
         rope=longrope(299, head_dim=64)),
    Case("no-rope", **MIXED, rope=RopeConfig(style=RopeStyle.NONE)),
    Case("no-rope-bias-fp8", **MIXED, bias=True, cache=CacheDType.FP8_E4M3, rope=RopeConfig(style=RopeStyle.NONE)),
    Case("explicit-positions", **MIXED, explicit_positions=True),
    Case("explicit-positions-gptj-fp16", **MIXED, explicit_positions=True, io="fp16", cache=CacheDType.FP16,
         rope=RopeConfig(style=RopeStyle.GPTJ)),
    Case("q-out-fp8", **MIXED, q_out_fp8=True, cache=CacheDType.FP8_E4M3),
    Case("q-out-fp8-fp16-bias", **MIXED, q_out_fp8=True, io="fp16", bias=True, head_dim=64),
    Case("no-v-tail-zeroing", **MIXED, zero_v_tail=False),
    Case("empty-sequences", q_lens=(5, 0, 3, 0), past_lens=(0, 7, 2, 0)),
    Case("pool-index-1-layer-0-of-3", **MIXED, pool_index=1, num_layers=3, layer=0),
    Case("single-decode-token", q_lens=(1,), past_lens=(0,)),
    Case("single-prefill-token-fp16", q_lens=(1,), past_lens=(17,), io="fp16", cache=CacheDType.FP16),
    # many sequences (small heads keep the pools small): the guess t*B/T is exact for the pure decode batch;
    # the mixed and ragged ones need the 32-ary search (two rounds for B = 300).
    Case("decode-batch-300", q_lens=(1,) * 300, past_lens=tuple(range(0, 600, 2)), **SMALL),
    Case("mixed-300-search", q_lens=(50,) + (1,) * 299, past_lens=(0,) + tuple(range(1, 598, 2)), **SMALL),
    Case("ragged-70", q_lens=tuple(int(x) for x in np.random.default_rng(5).integers(0, 10, 70)),
         past_lens=tuple(int(x) for x in np.random.default_rng(6).integers(0, 60, 70)), **SMALL),
    Case("many-heads-H64-KVH8", q_lens=(17, 1, 2), past_lens=(0, 5, 9), heads=64, kv_heads=8),
    # cyclic window with sinks: 5 sinks (bubble 11), a ring of 64 slots over 16-token pages. Prefill without
    # wrapping (V tail zeroed), decode long past wrapping, a chunk after wrapping (no tail zeroing), a
    # sequence still inside its sinks.
    Case("cyclic-sinks", q_lens=(40, 1, 20, 3), past_lens=(0, 200, 100, 0), sinks=5, cyclic=64),
    Case("cyclic-sinks-page-aligned-fp8", q_lens=(30, 1, 12), past_lens=(0, 77, 40), sinks=16, cyclic=32,
         cache=CacheDType.FP8_E4M3),
    Case("cyclic-nhd-P24-int8", q_lens=(45, 1, 10), past_lens=(0, 500, 60), sinks=7, cyclic=48, page_size=24,
         page_layout=PageLayout.NHD, cache=CacheDType.INT8),
    Case("cyclic-no-sinks", q_lens=(31, 1), past_lens=(0, 70), cyclic=32),
    *HEAD_DIM_CASES,
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_single_step_matches_reference(case):
    run_case(case)


def test_large_positions_keep_angle_accuracy():
    # theta = 2^32 and R = 64: inverse frequencies 2^-i, identical in float32 and float64, so the reference
    # and the kernel rotate by the same angles and any difference is the kernel's angle reduction (a float32
    # product pos * inv_freq would be off by up to 64 rad here).
    rng = np.random.default_rng(11)
    for style in (RopeStyle.NEOX, RopeStyle.GPTJ):
        case = Case(f"positions-2^31-{style.name}", q_lens=(40, 1, 1), past_lens=(0, 7, 3), head_dim=64,
                    io="fp16", cache=CacheDType.FP16, explicit_positions=True,
                    rope=RopeConfig(style=style, theta=float(2 ** 32)))
        cfg = case.cfg()
        table, num_blocks = block_table_for(cfg, [40, 8, 4], rng, 2)
        base = make_meta(table, case.q_lens, case.past_lens, rng, explicit=False)
        positions = rng.integers(2 ** 30, 2 ** 31 - 1, size=base.num_tokens).astype(np.int32)
        positions[:3] = [2 ** 31 - 1, 2 ** 31 - 2, 131072]
        meta = StepMetadata(base.block_table, base.cu_q_lens, base.past_lens, position_ids=positions)
        qkv, bias = make_qkv(cfg, meta.num_tokens, case.io, rng)
        Run(cfg, num_blocks).step(qkv, bias, meta)


# Long prefills: at least 4 x the resident warps in tokens (12672 on an H200: 132 SMs x 24 warps), so one warp per
# token (qkvWriteWarps), a grid of T / 8 CTAs over several waves whose CTAs follow each other on an SM.
LARGE_PREFILL_CASES = [
    Case("prefill-20000", q_lens=(12000, 1, 7999), past_lens=(0, 4000, 0), heads=4, kv_heads=1, page_size=64,
         rope=RopeConfig(theta=500000.0)),
    Case("prefill-13300-fp8-nhd-D80-R24-bias", q_lens=(6500, 1, 6799), past_lens=(0, 70, 3), heads=4, kv_heads=2,
         head_dim=80, cache=CacheDType.FP8_E4M3, page_layout=PageLayout.NHD, page_size=24, bias=True,
         rope=RopeConfig(rotary_dim=24)),
    # the other partner paths, the 1-byte and fp16 stores, a cyclic ring with sinks, explicit positions, fp8 q
    Case("prefill-12700-int8-nhd-D256-gptj", q_lens=(12700,), past_lens=(5,), heads=2, kv_heads=1, head_dim=256,
         cache=CacheDType.INT8, page_layout=PageLayout.NHD, page_size=32, rope=RopeConfig(style=RopeStyle.GPTJ)),
    # 360 chunks of 30-48 tokens (a step writes at most a ring's worth per sequence) after 0-199 cached: rings wrap
    Case("prefill-14000-fp16-D96-cyclic-sinks-explicit",
         q_lens=tuple(int(x) for x in np.random.default_rng(11).integers(30, 49, 360)),
         past_lens=tuple(int(x) for x in np.random.default_rng(12).integers(0, 200, 360)), heads=2, kv_heads=1,
         head_dim=96, page_size=24, io="fp16", cache=CacheDType.FP16, sinks=7, cyclic=48, explicit_positions=True),
    Case("prefill-12900-bf16-D64-R24-bias-fp8q", q_lens=(1, 12898, 1), past_lens=(30, 0, 9), heads=4, kv_heads=2,
         head_dim=64, bias=True, q_out_fp8=True, rope=RopeConfig(rotary_dim=24)),
]


@pytest.mark.parametrize("case", LARGE_PREFILL_CASES, ids=[c.name for c in LARGE_PREFILL_CASES])
def test_large_prefill_runs_over_several_waves(case):
    run_case(case, seed=3)


# Warp ranges that cross tokens and sequences, in one wave of every resident warp: the mid cases (between a quarter
# of the resident warps and all of them in tokens: 792..3168 on an H200) give each warp a few passes, the long ones
# (under 4 x the resident warps) a few tokens, so ranges start and end mid-token and mid-sequence and the ring of
# asynchronous loads wraps many times. One case per RoPE partner path (shared-memory staging, in-vector, shuffle)
# and per 1-byte / 2-byte cache store.
LONG_RANGE_CASES = [
    Case("mid-ranges-bf16-D128", q_lens=(1500, 1, 603, 37), past_lens=(0, 900, 13, 0)),
    Case("mid-ranges-fp8-nhd-D80-R24-bias", q_lens=(1200, 1, 1, 977), past_lens=(0, 40, 7, 0), head_dim=80,
         cache=CacheDType.FP8_E4M3, page_layout=PageLayout.NHD, bias=True, rope=RopeConfig(rotary_dim=24)),
    Case("long-ranges-fp8-D64-R24-bias", q_lens=(6000, 1, 4650, 37), past_lens=(0, 900, 13, 0), head_dim=64,
         cache=CacheDType.FP8_E4M3, bias=True, rope=RopeConfig(rotary_dim=24)),
    Case("long-ranges-int8-nhd-D256-gptj", q_lens=(3000, 1, 1, 2398), past_lens=(0, 40, 7, 0), heads=4,
         kv_heads=1, head_dim=256, cache=CacheDType.INT8, page_layout=PageLayout.NHD, page_size=32,
         rope=RopeConfig(style=RopeStyle.GPTJ)),
    Case("long-ranges-bf16-D80-R24-bias", q_lens=(6000, 1, 4650, 37), past_lens=(0, 900, 13, 0), head_dim=80,
         bias=True, rope=RopeConfig(rotary_dim=24)),
    Case("long-ranges-int8-nhd-D96", q_lens=(3000, 1, 1, 2398), past_lens=(0, 40, 7, 0), heads=4, kv_heads=2,
         head_dim=96, cache=CacheDType.INT8, page_layout=PageLayout.NHD, page_size=32),
    Case("long-ranges-fp16-nhd-explicit-ragged",
         q_lens=tuple(int(x) for x in np.random.default_rng(9).integers(0, 131, 80)),
         past_lens=tuple(int(x) for x in np.random.default_rng(10).integers(0, 50, 80)), io="fp16",
         cache=CacheDType.FP16, page_layout=PageLayout.NHD, explicit_positions=True),
]


@pytest.mark.parametrize("case", LONG_RANGE_CASES, ids=[c.name for c in LONG_RANGE_CASES])
def test_long_warp_ranges_match_reference(case):
    run_case(case, seed=4)


# ---- several steps ---------------------------------------------------------------------------------------
CHUNK_CASES = [
    Case("chunks-bf16-P16", q_lens=(100, 57), past_lens=(0, 0)),
    Case("chunks-fp8-nhd-P24-bias", q_lens=(100, 57), past_lens=(0, 0), cache=CacheDType.FP8_E4M3,
         page_layout=PageLayout.NHD, page_size=24, bias=True),
    Case("chunks-int8-gptj-D64", q_lens=(100, 57), past_lens=(0, 0), cache=CacheDType.INT8, head_dim=64,
         rope=RopeConfig(style=RopeStyle.GPTJ)),
    Case("chunks-bf16-D80-R32", q_lens=(100, 57), past_lens=(0, 0), head_dim=80, rope=RopeConfig(rotary_dim=32)),
    Case("chunks-fp8-nhd-D96-P24", q_lens=(100, 57), past_lens=(0, 0), head_dim=96, cache=CacheDType.FP8_E4M3,
         page_layout=PageLayout.NHD, page_size=24),
]


@pytest.mark.parametrize("case", CHUNK_CASES, ids=[c.name for c in CHUNK_CASES])
def test_three_chunk_prefill_equals_one_prefill(case):
    """Chunk k lands after chunks < k (past_len), never over them: the pool and q come out bitwise equal to
    one prefill of the whole prompt (each chunk also zeroes its tail, which the next chunk then overwrites)."""
    rng = np.random.default_rng(1)
    cfg = case.cfg()
    lens = list(case.q_lens)
    table, num_blocks = block_table_for(cfg, lens, rng, case.spare_blocks)
    one = make_meta(table, lens, [0] * len(lens), rng, explicit=False)
    qkv, bias = make_qkv(cfg, one.num_tokens, case.io, rng)
    whole = poisoned_pool(cfg, num_blocks)
    q_whole = qkv_write_numpy(qkv, bias, one, whole, cfg)

    cuts = [(0, 30, 31, 100), (0, 1, 40, 57)]  # per sequence: chunk boundaries (a 1-token chunk included)
    chunked = poisoned_pool(cfg, num_blocks)
    q_chunks = np.empty_like(q_whole)
    for k in range(3):
        starts = [c[k] for c in cuts]
        ends = [c[k + 1] for c in cuts]
        rows = np.concatenate([np.arange(one.cu_q_lens[b] + s, one.cu_q_lens[b] + e)
                               for b, (s, e) in enumerate(zip(starts, ends, strict=True))])
        meta = make_meta(table, [e - s for s, e in zip(starts, ends, strict=True)], starts, rng, explicit=False)
        q_chunks[rows] = qkv_write_numpy(qkv[rows], bias, meta, chunked, cfg)
    assert np.array_equal(bits(chunked), bits(whole))
    assert np.array_equal(bits(q_chunks), bits(q_whole))
    # and the one-shot result is the reference's
    ref = poisoned_pool(cfg, num_blocks)
    mirror = poisoned_pool(fp16_mirror(cfg), num_blocks)
    q_ref = reference_qkv_write(qkv, bias, one, ref, cfg)
    reference_qkv_write(qkv, bias, one, mirror, fp16_mirror(cfg))
    assert_q_matches(q_whole, q_ref, cfg, qkv.dtype)
    assert_pool_matches(whole, ref, poisoned_pool(cfg, num_blocks), ~np.isnan(mirror), cfg)


DECODE_CASES = [
    Case("decode-after-prefill", q_lens=(20, 33, 1), past_lens=(0, 0, 0)),
    Case("decode-after-prefill-int8-P24", q_lens=(20, 33, 1), past_lens=(0, 0, 0), cache=CacheDType.INT8,
         page_size=24),
    Case("decode-wraps-cyclic-ring", q_lens=(30, 5), past_lens=(0, 0), sinks=4, cyclic=32),
    # sequence 1 crosses the switch during the decode steps: its cached keys keep the short table's rotation
    Case("decode-crosses-longrope-switch", q_lens=(20, 33, 1), past_lens=(0, 0, 0), rope=longrope(40)),
    Case("decode-crosses-longrope-switch-D96-R40", q_lens=(20, 33, 1), past_lens=(0, 0, 0), head_dim=96,
         rope=longrope(40, head_dim=96, rotary_dim=40)),
    Case("decode-after-prefill-D80-int8", q_lens=(20, 33, 1), past_lens=(0, 0, 0), head_dim=80,
         cache=CacheDType.INT8, rope=RopeConfig(rotary_dim=32)),
    Case("decode-wraps-cyclic-ring-D96", q_lens=(30, 5), past_lens=(0, 0), head_dim=96, sinks=4, cyclic=32),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c.name for c in DECODE_CASES])
def test_decode_steps_after_prefill(case):
    """A prefill step, then decode steps (one token per sequence) stepping kernel and reference together; the
    cyclic case decodes far enough to wrap its ring."""
    rng = np.random.default_rng(2)
    cfg = case.cfg()
    decode_steps = 12
    final = [q + decode_steps for q in case.q_lens]
    table, num_blocks = block_table_for(cfg, final, rng, case.spare_blocks)
    run = Run(cfg, num_blocks)
    meta = make_meta(table, case.q_lens, case.past_lens, rng, explicit=False)
    qkv, bias = make_qkv(cfg, meta.num_tokens, case.io, rng)
    run.step(qkv, bias, meta)
    lens = list(case.q_lens)
    for _ in range(decode_steps):
        meta = make_meta(table, [1] * len(lens), lens, rng, explicit=False)
        qkv, bias = make_qkv(cfg, meta.num_tokens, case.io, rng)
        run.step(qkv, bias, meta)
        lens = [n + 1 for n in lens]


# ---- bad block-table entries -------------------------------------------------------------------------------
BAD_ENTRIES = [
    # (name, sequence, page, entry written there (None: shrink the table's width to `page`), expected flag)
    ("invalid-sentinel-mid-prefill", 0, 1, INVALID_BLOCK, STATUS_INVALID_BLOCK),
    ("invalid-sentinel-last-page", 0, 2, INVALID_BLOCK, STATUS_INVALID_BLOCK),
    ("out-of-range-decode", 1, 3, "NB+5", STATUS_BLOCK_OUT_OF_RANGE),
    ("negative-entry", 2, 0, -7, STATUS_BLOCK_OUT_OF_RANGE),
    ("past-the-row", 1, 3, None, STATUS_PAST_BLOCK_TABLE),  # width 3: only sequence 1 (position 60) needs page 3
]


@pytest.mark.parametrize("name,seq,page,entry,flag", BAD_ENTRIES, ids=[b[0] for b in BAD_ENTRIES])
@pytest.mark.parametrize("cache", [CacheDType.BF16, CacheDType.FP8_E4M3], ids=["bf16", "fp8"])
def test_bad_block_entry_raises_and_writes_nothing_outside_valid_slots(name, seq, page, entry, flag, cache):
    """The token's K/V are skipped and the status names (seq, page, entry); q is still written; the pool
    equals what the reference writes with the bad pages redirected to scratch blocks outside the pool."""
    check_bad_block_entry(Case(name, q_lens=(40, 1, 9), past_lens=(0, 60, 0), cache=cache), seq, page, entry, flag)


# The same in a long prefill, whose warps each own one token (qkvWriteWarps: >= 4 waves of resident warps): bad
# pages early in, deep in and at the end of its first sequence (12800 tokens: 800 pages of 16), and in the decode
# and the short sequence after it.
LONG_PREFILL_BAD_ENTRIES = [
    ("invalid-sentinel-page-1", 0, 1, INVALID_BLOCK, STATUS_INVALID_BLOCK),
    ("out-of-range-page-517", 0, 517, "NB+5", STATUS_BLOCK_OUT_OF_RANGE),
    ("invalid-sentinel-last-page", 0, 799, INVALID_BLOCK, STATUS_INVALID_BLOCK),
    ("out-of-range-decode", 1, 3, "NB+5", STATUS_BLOCK_OUT_OF_RANGE),
    ("negative-entry", 2, 0, -7, STATUS_BLOCK_OUT_OF_RANGE),
]


@pytest.mark.parametrize("name,seq,page,entry,flag", LONG_PREFILL_BAD_ENTRIES,
                         ids=[b[0] for b in LONG_PREFILL_BAD_ENTRIES])
def test_bad_block_entry_in_a_long_prefill(name, seq, page, entry, flag):
    check_bad_block_entry(Case(name, q_lens=(12800, 1, 9), past_lens=(0, 60, 0), heads=4, kv_heads=1,
                               cache=CacheDType.FP8_E4M3), seq, page, entry, flag)


def check_bad_block_entry(case, seq, page, entry, flag):
    rng = np.random.default_rng(4)
    cfg = case.cfg()
    final = [p + q for p, q in zip(case.past_lens, case.q_lens, strict=True)]
    table, num_blocks = block_table_for(cfg, final, rng, case.spare_blocks)
    scratch = num_blocks + 1  # a block id past the real pool, backed only in the reference's extended pool
    repaired = table.copy()
    if entry is None:  # width shrunk to `page`: pages >= page of every sequence are past the row
        bad = table[:, :page].copy()
        repaired[:, page:] = np.where(table[:, page:] >= 0, scratch + np.arange(table[:, page:].size).reshape(
            table[:, page:].shape), INVALID_BLOCK)
        expected_entry = INVALID_BLOCK
    else:
        bad = table.copy()
        bad[seq, page] = num_blocks + 5 if entry == "NB+5" else entry
        repaired[seq, page] = scratch
        expected_entry = int(bad[seq, page])
    meta_bad = make_meta(bad, case.q_lens, case.past_lens, rng, explicit=False)
    meta_rep = StepMetadata(repaired, meta_bad.cu_q_lens, meta_bad.past_lens)
    qkv, _ = make_qkv(cfg, meta_bad.num_tokens, case.io, rng)

    pool = poisoned_pool(cfg, num_blocks)
    initial = pool.copy()
    q_kernel, status = qkv_write_numpy_unchecked(qkv, None, meta_bad, pool, cfg)
    assert status[STATUS_FLAGS] == flag, status
    assert tuple(status[1:]) == (seq, page, expected_entry), status

    extra = int(repaired.max()) + 1 - num_blocks
    ref = poisoned_pool(cfg, num_blocks + extra)
    mirror = poisoned_pool(fp16_mirror(cfg), num_blocks + extra)
    q_ref = reference_qkv_write(qkv, None, meta_rep, ref, cfg)
    reference_qkv_write(qkv, None, meta_rep, mirror, fp16_mirror(cfg))
    assert_q_matches(q_kernel, q_ref, cfg, qkv.dtype)
    assert_pool_matches(pool, ref[:num_blocks], initial, ~np.isnan(mirror[:num_blocks]), cfg)

    # the checked entry point raises the same report as an exception
    with pytest.raises(KVWriteError) as err:
        qkv_write_numpy(qkv, None, meta_bad, poisoned_pool(cfg, num_blocks), cfg)
    assert (err.value.seq, err.value.page_in_seq, err.value.entry) == (seq, page, expected_entry)


def test_reference_rejects_what_the_kernel_skips():
    # The reference raises before writing anything on a bad page; the kernel writes the valid tokens and
    # reports. Both name the same (seq, page, entry).
    from pagedkv.reference import InvalidPageError

    rng = np.random.default_rng(9)
    case = Case("bad", q_lens=(20,), past_lens=(0,))
    cfg = case.cfg()
    table, num_blocks = block_table_for(cfg, [20], rng, 1)
    table[0, 1] = INVALID_BLOCK
    meta = make_meta(table, case.q_lens, case.past_lens, rng, explicit=False)
    qkv, _ = make_qkv(cfg, meta.num_tokens, case.io, rng)
    with pytest.raises(InvalidPageError) as ref_err:
        reference_qkv_write(qkv, None, meta, poisoned_pool(cfg, num_blocks), cfg)
    with pytest.raises(KVWriteError) as kernel_err:
        qkv_write_numpy(qkv, None, meta, poisoned_pool(cfg, num_blocks), cfg)
    assert (kernel_err.value.seq, kernel_err.value.page_in_seq, kernel_err.value.entry) == \
        (ref_err.value.seq, ref_err.value.page_in_seq, ref_err.value.entry) == (0, 1, INVALID_BLOCK)
