"""Paged attention kernels on the GPU against the float64 reference (``pagedkv.reference.attention``).

Every case fills a pool with fresh random K/V only in the slots its sequences own (NaN -- or, for int8, the
sentinel -128 -- everywhere else, other layers included), shuffles the physical pages, poisons the output
buffer with NaN (``paged_attention_numpy``), runs the kernels through the C API and compares with
``paged_attention`` using the per-dtype TOLERANCES of conftest. A kernel that read one slot it does not own,
or skipped one output row, shows up as NaN or as a large error.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from pagedkv.config import AttentionConfig, PoolConfig
from pagedkv.layout import INVALID_BLOCK, CacheDType, PageLayout
from pagedkv.reference.attention import paged_attention
from pagedkv.reference.quant import quantize
from pagedkv.step import StepMetadata

from conftest import TOLERANCES

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


@dataclasses.dataclass(frozen=True)
class Case:
    """One step. seqs: (past_len, q_len) per sequence."""

    seqs: tuple[tuple[int, int], ...]
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    cache: CacheDType = CacheDType.BF16
    io: str = "bfloat16"
    layout: PageLayout = PageLayout.HND
    window: int = 0
    sinks: int = 0
    cyclic_pages: int = 0          # ring length in pages; cyclic sink tokens = sinks
    softcap: float = 0.0
    softmax_scale: float = 0.0
    q_fp8: bool = False
    evict_below_window: bool = False  # -1 for pages entirely below every query's window (sinks kept)
    num_layers: int = 1
    layer: int = 0
    pool_index: int = 0
    loose_bounds: bool = False     # max_q_len = T, max_kv_len = MB * page_size, like the TensorRT plugin
    q_pow2: int = 0                # q *= 2**q_pow2 (exact): magnitudes outside the f16 range
    q_token_pow2: int = 0          # each token's q *= 2**u, u uniform in [-q_token_pow2, q_token_pow2] (exact)
    seed: int = 0

    def __post_init__(self):
        assert self.num_q_heads % self.num_kv_heads == 0
        if self.cache in (CacheDType.FP16, CacheDType.BF16):
            assert np.dtype(self.cache.numpy_dtype) == np.dtype(self.io_dtype), "16-bit cache: q has its type"
        if self.cyclic_pages:
            ring = self.cyclic_pages * self.page_size
            assert self.window > 0 and all(ring >= self.window + q - 1 for _, q in self.seqs), "ring too short"

    @property
    def io_dtype(self) -> np.dtype:
        return BF16 if self.io == "bfloat16" else FP16

    @property
    def id(self) -> str:
        more = f"+{len(self.seqs) - 3}more" if len(self.seqs) > 3 else ""
        s = "+".join(f"{p}:{q}" for p, q in self.seqs[:3]) + more
        extra = [n for n, on in (("fp8q", self.q_fp8), ("evict", self.evict_below_window), ("loose", self.loose_bounds),
                                 (f"q2^{self.q_pow2}", self.q_pow2 != 0),
                                 (f"qtok2^+-{self.q_token_pow2}", self.q_token_pow2 != 0)) if on]
        return (f"H{self.num_q_heads}kv{self.num_kv_heads}D{self.head_dim}P{self.page_size}-{self.cache.name}-{self.io}"
                f"-{self.layout.name}-w{self.window}s{self.sinks}ring{self.cyclic_pages}-cap{self.softcap:g}"
                f"-L{self.layer}/{self.num_layers}-{'-'.join(extra)}-[{s}]")


def build(case: Case):
    rng = np.random.default_rng(case.seed)
    quantized = case.cache in (CacheDType.FP8_E4M3, CacheDType.INT8)
    pool_cfg = PoolConfig(num_kv_heads=case.num_kv_heads, head_dim=case.head_dim, page_size=case.page_size,
                          num_layers=case.num_layers, layer_index=case.layer, pool_index=case.pool_index,
                          cache_dtype=case.cache, page_layout=case.layout,
                          ring_sink_tokens=case.sinks if case.cyclic_pages else 0,
                          cyclic_len=case.cyclic_pages * case.page_size,
                          k_scale=0.05 if quantized else 1.0, v_scale=0.04 if quantized else 1.0)
    cfg = AttentionConfig(num_q_heads=case.num_q_heads, pool=pool_cfg, window=case.window, attention_sinks=case.sinks,
                          softmax_scale=case.softmax_scale, logit_softcap=case.softcap, q_fp8=case.q_fp8,
                          q_scale=0.02 if case.q_fp8 else 1.0)
    layout = pool_cfg.layout()
    past = np.array([p for p, _ in case.seqs], np.int32)
    qlen = np.array([q for _, q in case.seqs], np.int32)
    kv_len = past + qlen
    pages = np.array([int(layout.pages_needed(n)) for n in kv_len])
    max_blocks = int(pages.max()) + 2  # past-the-end columns hold -1
    num_blocks = int(pages.sum()) + 7  # a few blocks nobody owns
    perm = rng.permutation(num_blocks)
    table = np.full((len(case.seqs), max_blocks), INVALID_BLOCK, np.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[used:used + n]
        used += n

    # Poison: NaN (int8: the most negative value) in every slot, every layer, both K and V. The pool is then
    # addressed as rows of D elements: row = elem_offset(block, layer, kv, head, offset) / D (the contract).
    pool = np.empty(layout.pool_shape(num_blocks), dtype=case.cache.numpy_dtype)
    pool[...] = -128 if case.cache == CacheDType.INT8 else np.nan
    rows = pool.reshape(-1, case.head_dim)
    heads = np.arange(case.num_kv_heads)
    for b in range(len(case.seqs)):
        n = int(kv_len[b])
        # positions whose slot still holds them (a ring keeps the sinks and the last cyclic_len positions)
        pos = np.arange(n)
        if layout.cyclic_len:
            pos = pos[(pos < layout.ring_sink_tokens) | (pos >= n - layout.cyclic_len)]
        block, offset, _ = layout.locate(table[b], pos, num_blocks)
        assert np.all(block != INVALID_BLOCK)
        for kv in (0, 1):
            values = rng.standard_normal((pos.size, case.num_kv_heads, case.head_dim), dtype=np.float32)
            if quantized:  # spread over the quantized range: values up to ~ +-12 steps of the scale ... and beyond
                scale = pool_cfg.k_scale if kv == 0 else pool_cfg.v_scale
                stored = quantize(values.astype(np.float64) * 3 * scale, case.cache, scale)
            else:  # fp16 / bf16 storage is round-to-nearest-even of the value (cache_convert.cuh)
                stored = values.astype(case.cache.numpy_dtype)
            elem = layout.elem_offset(block[:, None], case.layer, kv, heads[None, :], offset[:, None])
            rows[elem // case.head_dim] = stored

    if case.evict_below_window and case.window > 0:
        # Pages no query of the sequence can see any more (below the first query's window, past the sinks).
        for b in range(len(case.seqs)):
            first_visible = max(0, int(past[b]) - case.window + 1)
            for page in range(int(pages[b])):
                slots = np.arange(page * case.page_size, (page + 1) * case.page_size)
                if layout.cyclic_len:
                    continue  # ring pages are reused, never below the window
                if slots[-1] < first_visible and slots[0] >= case.sinks:
                    table[b, page] = INVALID_BLOCK

    cu = np.concatenate([[0], np.cumsum(qlen)]).astype(np.int32)
    meta = StepMetadata(table, cu, past)
    q = rng.standard_normal((meta.num_tokens, case.num_q_heads * case.head_dim))
    if case.q_fp8:
        q = quantize(q * 4 * cfg.q_scale, CacheDType.FP8_E4M3, cfg.q_scale)
    else:
        q = q * 2.0**case.q_pow2
        if case.q_token_pow2:
            q = q * 2.0 ** rng.integers(-case.q_token_pow2, case.q_token_pow2 + 1, size=(meta.num_tokens, 1))
        q = q.astype(case.io_dtype)
    return cfg, meta, pool, q


def check(case: Case):
    from pagedkv.kernels.attention import IODType, paged_attention_numpy

    cfg, meta, pool, q = build(case)
    kwargs = {}
    if case.loose_bounds:
        kwargs = dict(max_q_len=meta.num_tokens, max_kv_len=meta.max_blocks * case.page_size)
    out = paged_attention_numpy(q, meta, pool, cfg, io_dtype=IODType.from_numpy(case.io_dtype), **kwargs)
    ref = paged_attention(q, meta, pool, cfg)
    assert out.dtype == case.io_dtype
    got = out.astype(np.float64)
    assert np.isfinite(got).all(), f"{np.argwhere(~np.isfinite(got))[:5].tolist()} not finite (row never written?)"
    atol, rtol = TOLERANCES[case.io]
    np.testing.assert_allclose(got, ref, atol=atol, rtol=rtol)


def _decode_lengths(page: int) -> tuple[tuple[int, int], ...]:
    # cache lengths 1, page - 1, page, page + 1 and a longer one (past = length - 1)
    return tuple((n - 1, 1) for n in (1, page - 1, page, page + 1, 1000))


# Head dims 32, 80, 96 (Phi-2 80, Phi-3-mini 96): 16-bit tiles in rows of 64 / 128 elements, KV copies in flat
# chunk order (80, 96), 8-bit decode through the per-warp conversion (not Frag8), merge lanes of 4 dims. Every
# kernel path of the other head dims once more: decode (16- and 8-bit, fp8 q), multi-token (prefill, chunk over
# a prefix, drafts, mixed batch, MQA), NHD, odd pages, window / sinks / ring / soft-cap, evicted pages.
HEAD_DIM_CASES = [
    Case(_decode_lengths(16), head_dim=80, seed=60),
    Case(_decode_lengths(16), head_dim=96, cache=CacheDType.FP16, io="float16", seed=61),
    Case(_decode_lengths(24), head_dim=32, page_size=24, seed=62),
    Case(_decode_lengths(16), num_q_heads=32, num_kv_heads=32, head_dim=80, seed=63),           # MHA: 1 row
    Case(_decode_lengths(16), num_q_heads=16, num_kv_heads=1, head_dim=96, seed=64),            # G = 16
    Case(_decode_lengths(16), head_dim=80, cache=CacheDType.FP8_E4M3, io="bfloat16", seed=65),
    Case(_decode_lengths(24), head_dim=96, cache=CacheDType.INT8, io="float16", layout=PageLayout.NHD, page_size=24,
         seed=66),
    Case(_decode_lengths(16), head_dim=32, cache=CacheDType.FP8_E4M3, io="float16", q_fp8=True, seed=67),
    Case(_decode_lengths(16), head_dim=96, cache=CacheDType.INT8, io="bfloat16", q_pow2=20,
         softmax_scale=2.0**-20 / np.sqrt(96), seed=68),
    Case(((40, 1), (0, 100)), head_dim=80, cache=CacheDType.FP16, io="float16", q_fp8=True, seed=69),
    Case(((0, 333),), head_dim=80, seed=70),
    Case(((300, 200),), head_dim=96, seed=71),
    Case(((0, 129), (64, 63)), head_dim=32, page_size=24, layout=PageLayout.NHD, cache=CacheDType.FP16, io="float16",
         seed=72),
    Case(((700, 2), (700, 4), (700, 5), (700, 9)), head_dim=96, seed=73),                     # drafts
    Case(((5, 1), (0, 77), (1000, 1), (250, 130), (64, 3), (9, 0), (1, 1)), head_dim=80, seed=74),
    Case(((200, 150),), num_q_heads=32, num_kv_heads=1, head_dim=80, seed=75),                # MQA prefill
    Case(((100, 70),), num_q_heads=12, num_kv_heads=4, head_dim=96, seed=76),                 # G = 3
    Case(((17, 50), (2000, 1)), head_dim=80, cache=CacheDType.FP8_E4M3, seed=77),
    Case(((17, 50), (900, 1)), head_dim=96, cache=CacheDType.INT8, io="float16", layout=PageLayout.NHD, seed=78),
    Case(((17, 50), (900, 1)), head_dim=32, cache=CacheDType.INT8, io="bfloat16", seed=79),
    Case(((17, 50), (900, 1)), head_dim=96, cache=CacheDType.FP8_E4M3, io="bfloat16", q_fp8=True, seed=88),
    Case(((900, 1), (500, 30), (40, 1)), head_dim=80, window=100, sinks=4, seed=80),
    Case(((900, 1), (500, 30)), head_dim=96, window=100, sinks=4, evict_below_window=True, seed=81),
    Case(((1000, 1), (700, 20), (3, 2)), head_dim=96, window=128, sinks=4, cyclic_pages=10, seed=82),
    Case(((1000, 1), (700, 20)), head_dim=80, window=96, sinks=5, cyclic_pages=4, page_size=32, layout=PageLayout.NHD,
         cache=CacheDType.FP8_E4M3, seed=83),
    Case(((500, 1), (100, 90)), head_dim=80, softcap=30.0, seed=84),
    Case(((500, 1), (100, 90)), head_dim=96, softcap=20.0, softmax_scale=0.05, cache=CacheDType.INT8, io="float16",
         seed=85),
    Case(((30, 1), (300, 40)), head_dim=80, layout=PageLayout.NHD, num_layers=3, layer=2, pool_index=1, seed=86),
    Case(((5, 1), (0, 77), (1000, 1), (250, 130)), head_dim=96, loose_bounds=True, seed=87),
]

# The sm_90a multi-token kernel (D = 32, 64, 128, 256, every cache dtype; the multi-token cases above reach it too on
# an H100 / H200): many KV tiles of 128 tokens through its pipeline, pages of 64 and 128 tokens (a tile is 2 or 1
# pages), Llama-70B-like G = 8, fp16, window + sinks + soft-cap in one case, a cyclic ring, 8-bit caches.
HOPPER_MULTI_CASES = [
    Case(((0, 1000),), page_size=64, seed=100),
    Case(((1500, 700), (0, 260)), cache=CacheDType.FP16, io="float16", seed=101),
    Case(((0, 300), (77, 45)), num_q_heads=64, num_kv_heads=8, page_size=128, seed=102),
    Case(((64, 500),), head_dim=64, window=200, sinks=4, softcap=30.0, seed=103),
    Case(((2000, 333),), head_dim=64, cache=CacheDType.FP16, io="float16", layout=PageLayout.NHD, page_size=32,
         seed=104),
    Case(((900, 257), (3, 1), (0, 20)), window=300, sinks=8, cyclic_pages=50, seed=105),
    # 8-bit caches: tiles converted in shared memory each iteration (one K, two V buffers)
    Case(((0, 700),), cache=CacheDType.FP8_E4M3, page_size=64, seed=106),
    Case(((1200, 300), (5, 40)), cache=CacheDType.INT8, io="float16", head_dim=64, seed=107),
    Case(((800, 129),), cache=CacheDType.FP8_E4M3, q_fp8=True, window=256, sinks=4, seed=108),
    Case(((3000, 100),), cache=CacheDType.INT8, softcap=30.0, layout=PageLayout.NHD, seed=109),
    # more CTAs (row slot x KV head x chunk) than SMs, so that CTAs follow each other on an SM: next to decode
    # sequences (the CTAs of their slots exit at once), with 8-bit queries (converted on the way) and a window
    Case(((0, 1200), (4000, 1), (300, 900), (9, 1)), seed=112),
    Case(((0, 900), (7, 1)), cache=CacheDType.FP8_E4M3, q_fp8=True, seed=113),
    Case(((500, 800),), head_dim=64, window=300, sinks=4, page_size=64, seed=114),
    # D = 256: one consumer warpgroup of 64 rows, 64-token tiles, 16 rows a producer warp (HND 16-bit runs by TMA)
    Case(((0, 700),), head_dim=256, page_size=64, seed=140),
    Case(((1500, 300), (0, 130)), head_dim=256, cache=CacheDType.FP16, io="float16", seed=141),
    Case(((0, 129), (64, 63)), head_dim=256, page_size=24, seed=142),  # halves straddling pages: TMA and cp.async
    Case(((900, 257), (3, 1)), head_dim=256, window=300, sinks=8, cyclic_pages=50, seed=143),
    Case(((500, 200),), head_dim=256, softcap=30.0, layout=PageLayout.NHD, seed=144),
    Case(((0, 700),), head_dim=256, cache=CacheDType.FP8_E4M3, page_size=64, seed=145),
    Case(((1200, 300), (5, 40)), head_dim=256, cache=CacheDType.INT8, io="float16", layout=PageLayout.NHD, seed=146),
    Case(((800, 129),), head_dim=256, cache=CacheDType.FP8_E4M3, q_fp8=True, window=256, sinks=4, seed=147),
    Case(((0, 600), (4000, 1), (300, 500), (9, 1)), head_dim=256, seed=148),  # more cells than CTAs: persistent walk
    Case(((16000, 20),), head_dim=256, seed=149),  # few rows over a long past: chunks split, partials merged
    # D = 32 (rows padded to D = 64's tiles, cp.async only): three consumer warpgroups of 64 rows over 16-bit caches,
    # many KV tiles a cell and more cells than CTAs; fp16 NHD pages of 32 with window + sinks + soft-cap; a cyclic ring
    Case(((1500, 600), (0, 300)), head_dim=32, seed=150),
    Case(((700, 400), (3, 1), (0, 30)), head_dim=32, cache=CacheDType.FP16, io="float16", layout=PageLayout.NHD,
         page_size=32, window=300, sinks=4, softcap=30.0, seed=151),
    Case(((900, 257), (3, 1), (0, 20)), head_dim=32, window=300, sinks=8, cyclic_pages=50, seed=152),
]

CASES = [
    # decode: GQA / MHA / MQA (G = 16 still decode kernel; G = 32 goes to the multi-token kernel)
    *[Case(_decode_lengths(p), head_dim=d, page_size=p, seed=i)
      for i, (d, p) in enumerate([(64, 16), (128, 16), (256, 16), (128, 64), (128, 128), (64, 32)])],
    Case(_decode_lengths(16), num_q_heads=8, num_kv_heads=8),
    Case(_decode_lengths(16), num_q_heads=16, num_kv_heads=1, head_dim=64),
    Case(_decode_lengths(16), num_q_heads=32, num_kv_heads=1),
    Case(_decode_lengths(24), page_size=24),  # non-power-of-two page: divmod path
    # cache dtypes x io dtypes
    Case(_decode_lengths(16), cache=CacheDType.FP16, io="float16"),
    Case(_decode_lengths(16), cache=CacheDType.FP8_E4M3, io="bfloat16"),
    Case(_decode_lengths(16), cache=CacheDType.FP8_E4M3, io="float16", head_dim=64),
    Case(_decode_lengths(16), cache=CacheDType.INT8, io="bfloat16", head_dim=256),
    Case(_decode_lengths(16), cache=CacheDType.INT8, io="float16"),
    Case(_decode_lengths(16), cache=CacheDType.FP8_E4M3, io="bfloat16", q_fp8=True),
    Case(((40, 1), (0, 100)), cache=CacheDType.FP16, io="float16", q_fp8=True),
    # 8-bit decode path (fragments straight from the 8-bit tiles, f16 MMAs): every head dim, and bf16 queries
    # far outside the f16 range both ways (the per-CTA power-of-two Q scaling must keep them exact)
    Case(_decode_lengths(16), cache=CacheDType.FP8_E4M3, io="bfloat16", head_dim=256, seed=50),
    Case(_decode_lengths(16), cache=CacheDType.INT8, io="bfloat16", head_dim=64, seed=51),
    Case(_decode_lengths(16), cache=CacheDType.FP8_E4M3, io="bfloat16", q_pow2=20,
         softmax_scale=2.0**-20 / np.sqrt(128), seed=52),
    Case(_decode_lengths(16), cache=CacheDType.FP8_E4M3, io="bfloat16", q_pow2=-30,
         softmax_scale=2.0**30 / np.sqrt(128), seed=53),
    Case(((900, 1), (500, 3), (40, 1)), window=100, sinks=4, cache=CacheDType.FP8_E4M3, io="bfloat16", seed=54),
    # multi-token rows over 8-bit caches with bf16 queries (the Hopper kernel's f16 S: a power of two per 16 rows):
    # outside the f16 range both ways, and per-token magnitudes 2^-16 .. 2^16 apart, so that the rows of one CTA
    # take different scales
    Case(((300, 200), (0, 129)), cache=CacheDType.FP8_E4M3, io="bfloat16", q_pow2=20,
         softmax_scale=2.0**-20 / np.sqrt(128), seed=57),
    Case(((300, 200),), cache=CacheDType.INT8, io="bfloat16", head_dim=256, q_pow2=-30,
         softmax_scale=2.0**30 / np.sqrt(256), seed=58),
    Case(((64, 300), (5, 40)), cache=CacheDType.FP8_E4M3, io="bfloat16", q_token_pow2=16, seed=59),
    Case(((0, 333),), head_dim=80, cache=CacheDType.INT8, io="bfloat16", q_token_pow2=16, seed=83),
    # the 8-bit decode loader (two lanes per row, own page lookups): NHD rows, a non-power-of-two page, and
    # a sliding window whose span starts mid-page over evicted pages
    Case(_decode_lengths(16), cache=CacheDType.INT8, io="float16", layout=PageLayout.NHD, page_size=24, seed=55),
    Case(((900, 1), (500, 3), (3000, 1)), window=100, sinks=4, evict_below_window=True, cache=CacheDType.FP8_E4M3,
         io="bfloat16", head_dim=256, seed=56),
    # NHD pages, pool with several layers / pool groups
    Case(_decode_lengths(16), layout=PageLayout.NHD),
    Case(((30, 1), (300, 40)), layout=PageLayout.NHD, num_layers=3, layer=2, pool_index=1, cache=CacheDType.FP16,
         io="float16"),
    # multi-token: fresh prefill, chunk over a cached prefix, drafts, a mixed batch, an empty sequence
    Case(((0, 333),), head_dim=64, seed=3),
    Case(((300, 200),), seed=4),
    Case(((700, 2), (700, 4), (700, 5), (700, 9)), seed=5),                  # drafts: 8, 16 rows | 20, 36 rows
    Case(((5, 1), (0, 77), (1000, 1), (250, 130), (64, 3), (9, 0), (1, 1)), seed=6),
    Case(((0, 100), (31, 64)), num_q_heads=8, num_kv_heads=8, head_dim=256, seed=7),
    Case(((200, 150),), num_q_heads=32, num_kv_heads=1, head_dim=128, seed=8),  # MQA prefill: 32 rows per token
    Case(((100, 70),), num_q_heads=12, num_kv_heads=4, head_dim=64, seed=9),    # G = 3: tiles split tokens
    Case(((17, 50), (2000, 1)), cache=CacheDType.FP8_E4M3, seed=10),
    Case(((17, 50), (900, 1)), cache=CacheDType.INT8, io="float16", head_dim=256, seed=11),
    Case(((0, 129), (64, 63)), page_size=24, seed=12),
    # window, sinks, cyclic ring wrapping around, soft-cap, evicted pages outside the visible range
    Case(((900, 1), (500, 30), (40, 1)), window=128, seed=13),
    Case(((900, 1), (500, 30), (40, 1)), window=100, sinks=4, seed=14),
    Case(((900, 1), (500, 30)), window=100, sinks=4, evict_below_window=True, seed=15),
    Case(((1000, 1), (700, 20), (3, 2)), window=128, sinks=4, cyclic_pages=10, seed=16),
    Case(((1000, 1), (700, 20)), window=96, sinks=20, cyclic_pages=8, page_size=16, seed=17),
    Case(((1000, 1), (700, 20)), window=96, sinks=5, cyclic_pages=4, page_size=32, layout=PageLayout.NHD, seed=18),
    Case(((500, 1), (100, 90)), softcap=30.0, seed=19),
    Case(((500, 1), (100, 90)), softcap=20.0, softmax_scale=0.05, cache=CacheDType.FP16, io="float16", seed=20),
    # the TensorRT plugin's loose bounds (max_q_len = T, max_kv_len = MB * page_size)
    Case(((5, 1), (0, 77), (1000, 1), (250, 130)), loose_bounds=True, seed=21),
    Case(((3000, 1), (10, 1)), loose_bounds=True, seed=22),
    # a decode step whose loose bound launches the multi-token kernel too (T x G > 16), which finds nothing to do
    Case(((3000, 1), (10, 1), (77, 0), (500, 1), (1, 1), (64, 1), (129, 1)), loose_bounds=True, seed=23),
    *HEAD_DIM_CASES,
    *HOPPER_MULTI_CASES,
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matches_reference(case):
    check(case)


@pytest.mark.parametrize("case", [
    Case(((32767, 1),), seed=30),                                   # one long decode: split-K + merge
    Case(((12000, 1),), num_q_heads=4, num_kv_heads=1, seed=34),     # > 32 chunks: the merge's chunk batches
    # ~79 chunks at D = 256: each merge warp folds 3 batches (online rescale across batches), fp16 output
    Case(((20000, 1),), num_q_heads=8, num_kv_heads=1, head_dim=256, cache=CacheDType.FP16, io="float16",
         seed=35),
    # a split decode next to a split 9-token draft (18 rows: multi-token kernel), D = 64: the merge is launched
    # after the multi-token kernel, which never triggers it early, and combines both kernels' chunks
    Case(((30000, 1), (5000, 9)), num_q_heads=8, num_kv_heads=4, head_dim=64, seed=36),
    Case(((9000, 1), (3, 1)), cache=CacheDType.FP8_E4M3, page_size=64, seed=31),
    Case(((12000, 4), (12000, 1)), num_q_heads=16, num_kv_heads=4, head_dim=64, seed=32),
    Case(((12000, 40),), num_q_heads=8, num_kv_heads=2, seed=33),   # a late prefill chunk, split over the prefix
    # head dims 32, 80, 96: split decode (16- and 8-bit), > 32 chunks, a split draft next to a split decode, a
    # late prefill chunk split over its prefix -- the merge's 4-dim lanes
    Case(((32767, 1),), head_dim=80, seed=90),
    Case(((12000, 1),), num_q_heads=4, num_kv_heads=1, head_dim=96, cache=CacheDType.FP16, io="float16", seed=91),
    Case(((30000, 1), (5000, 9)), num_q_heads=8, num_kv_heads=4, head_dim=32, seed=92),
    Case(((9000, 1), (3, 1)), head_dim=96, cache=CacheDType.FP8_E4M3, page_size=64, seed=93),
    Case(((12000, 40),), num_q_heads=8, num_kv_heads=2, head_dim=80, cache=CacheDType.INT8, seed=94),
], ids=lambda c: c.id)
def test_long_sequences(case):
    check(case)


@pytest.mark.parametrize("head_dim", [128, 80])
def test_large_ragged_batch(head_dim):
    rng = np.random.default_rng(40)
    lengths = rng.integers(1, 600, size=256)
    check(Case(tuple((int(n) - 1, 1) for n in lengths), num_q_heads=16, num_kv_heads=4, head_dim=head_dim, seed=40))


def _runs_multi_token_kernel(case: Case) -> bool:
    # not decode-class (attention_schedule.h: isDecodeClass, kDecodeRows = 16) for some sequence
    group = case.num_q_heads // case.num_kv_heads
    return any(q * group > 16 or group > 16 for _, q in case.seqs if q > 0)


# The default multi-token kernel on an H100 / H200 is the Hopper kernel's warp-specialized variant; the other two
# run on the cases it takes (PAGEDKV_MULTI_KERNEL, read at every launch), so that the one GPU this suite runs on
# checks all three: "sm90-cooperative" (every warp loads, one CTA barrier per tile, 8-bit tiles converted by the
# whole CTA) and "mma", the mma.sync kernel, which also serves sm_80 / sm_89.
HOPPER_HEAD_DIMS = (32, 64, 80, 96, 128, 256)
OTHER_KERNELS_ON_HOPPER_CASES = [c for c in CASES if _runs_multi_token_kernel(c) and c.head_dim in HOPPER_HEAD_DIMS]


@pytest.mark.parametrize("kernel", ["mma", "sm90-cooperative"])
@pytest.mark.parametrize("case", OTHER_KERNELS_ON_HOPPER_CASES, ids=[c.id for c in OTHER_KERNELS_ON_HOPPER_CASES])
def test_other_multi_token_kernels_match_reference(case, kernel, monkeypatch):
    monkeypatch.setenv("PAGEDKV_MULTI_KERNEL", kernel)
    check(case)


def _runs_decode_kernel_16bit_d128(case: Case) -> bool:
    # decode-class sequences (isDecodeClass) on a 16-bit cache at D <= 128: the instances compiled at 2, 4 and 8 warps
    group = case.num_q_heads // case.num_kv_heads
    return (case.cache in (CacheDType.FP16, CacheDType.BF16) and case.head_dim <= 128 and group <= 16
            and any(0 < q and q * group <= 16 for _, q in case.seqs))


# The decode kernel's CTA widths: the plan picks one per batch (attention_plan.cpp, chooseDecodeWidth), so each width
# runs every decode case that has it, forced through PAGEDKV_DECODE_WARPS (read at every launch); long sequences
# (split-K + merge at every width) and a large ragged batch included.
DECODE_WIDTH_CASES = [c for c in CASES if _runs_decode_kernel_16bit_d128(c)] + [
    Case(((32767, 1),), seed=130),
    Case(((12000, 1), (7, 1), (3000, 1)), num_q_heads=4, num_kv_heads=1, head_dim=64, cache=CacheDType.FP16,
         io="float16", seed=131),
    Case(((32767, 1),), head_dim=80, seed=132),
    Case(tuple((int(n), 1) for n in np.random.default_rng(133).integers(0, 900, size=200)), num_q_heads=16,
         num_kv_heads=4, head_dim=96, page_size=24, seed=133),
]


@pytest.mark.parametrize("warps", ["2", "4", "8"])
@pytest.mark.parametrize("case", DECODE_WIDTH_CASES, ids=[c.id for c in DECODE_WIDTH_CASES])
def test_decode_widths_match_reference(case, warps, monkeypatch):
    monkeypatch.setenv("PAGEDKV_DECODE_WARPS", warps)
    check(case)


@pytest.mark.parametrize("cache, io, head_dim, warps, offered", [
    (CacheDType.FP8_E4M3, "bfloat16", 128, "4", "2"),   # 8-bit D = 128: compiled at 2 warps only
    (CacheDType.BF16, "bfloat16", 256, "2", "4"),       # 16-bit D = 256: 4 warps only
    (CacheDType.BF16, "bfloat16", 128, "3", "2, 4, 8"),
])
def test_decode_width_choice_is_checked(cache, io, head_dim, warps, offered, monkeypatch):
    from pagedkv import _lib
    from pagedkv.kernels.attention import paged_attention_numpy

    case = Case(((300, 1),), cache=cache, io=io, head_dim=head_dim, seed=111)
    cfg, meta, pool, q = build(case)
    monkeypatch.setenv("PAGEDKV_DECODE_WARPS", warps)
    expected = (f"PAGEDKV_DECODE_WARPS={warps}: expected one of the decode widths compiled for io_dtype=\\d "
                f"cache_dtype=\\d head_dim={head_dim} that fit this GPU: {offered}$")
    with pytest.raises(_lib.CapiError, match=expected):
        paged_attention_numpy(q, meta, pool, cfg)


# Forced decode splits (PAGEDKV_DECODE_CHUNKS, read at every launch): what the split sweep (bench_attention.py --cases
# splits) times must stay exact at any chunk count -- whole, an odd count, and far more chunks than the model picks
# (capped at the span's 256-token chunks) -- on the 16-bit widths, the 8-bit path, D = 256, a window with sinks.
DECODE_SPLIT_CASES = [
    Case(((32767, 1), (8191, 1)), seed=134),
    Case(((12000, 1), (7, 1), (3000, 1)), num_q_heads=4, num_kv_heads=1, head_dim=64, cache=CacheDType.FP16,
         io="float16", page_size=64, seed=135),
    Case(((20000, 1), (513, 1)), head_dim=128, cache=CacheDType.FP8_E4M3, io="bfloat16", seed=136),
    Case(((9000, 1), (2, 1)), num_q_heads=16, num_kv_heads=8, head_dim=256, page_size=24, seed=137),
    Case(((9000, 1), (600, 2)), window=1000, sinks=4, seed=138),
]


@pytest.mark.parametrize("chunks", ["1", "3", "200"])
@pytest.mark.parametrize("case", DECODE_SPLIT_CASES, ids=[c.id for c in DECODE_SPLIT_CASES])
def test_forced_decode_splits_match_reference(case, chunks, monkeypatch):
    monkeypatch.setenv("PAGEDKV_DECODE_CHUNKS", chunks)
    check(case)


@pytest.mark.parametrize("chunks", ["0", "1025", "4x", "-3"])
def test_forced_decode_split_is_checked(chunks, monkeypatch):
    from pagedkv import _lib
    from pagedkv.kernels.attention import paged_attention_numpy

    cfg, meta, pool, q = build(Case(((300, 1),), seed=112))
    monkeypatch.setenv("PAGEDKV_DECODE_CHUNKS", chunks)
    expected = (f"PAGEDKV_DECODE_CHUNKS={chunks}: expected a whole number in \\[1, 1024\\] "
                "\\(or unset: the plan's split\\)$")
    with pytest.raises(_lib.CapiError, match=expected):
        paged_attention_numpy(q, meta, pool, cfg)


def test_unknown_multi_kernel_choice_is_refused(monkeypatch):
    from pagedkv import _lib
    from pagedkv.kernels.attention import paged_attention_numpy

    case = Case(((0, 300),), seed=110)
    cfg, meta, pool, q = build(case)
    monkeypatch.setenv("PAGEDKV_MULTI_KERNEL", "fastest")
    expected = "PAGEDKV_MULTI_KERNEL=fastest: expected mma, sm90-cooperative or sm90-ws"
    with pytest.raises(_lib.CapiError, match=expected):
        paged_attention_numpy(q, meta, pool, cfg)


def test_workspace_below_the_plan_still_correct():
    # A workspace smaller than the plan wants: the launcher splits less (or not at all), still exact.
    from pagedkv.kernels.attention import IODType, paged_attention_numpy

    case = Case(((8000, 1),), seed=41)
    cfg, meta, pool, q = build(case)
    ref = paged_attention(q, meta, pool, cfg)
    for ws in (0, 4096 * 33 * 4 * 2):
        out = paged_attention_numpy(q, meta, pool, cfg, io_dtype=IODType.from_numpy(case.io_dtype), workspace_bytes=ws)
        atol, rtol = TOLERANCES[case.io]
        np.testing.assert_allclose(out.astype(np.float64), ref, atol=atol, rtol=rtol)


def test_repeated_launches_are_bitwise_identical():
    from pagedkv.kernels.attention import IODType, paged_attention_numpy

    case = Case(((5, 1), (0, 77), (3000, 1), (250, 130)), seed=42)
    cfg, meta, pool, q = build(case)
    a = paged_attention_numpy(q, meta, pool, cfg, io_dtype=IODType.from_numpy(case.io_dtype))
    b = paged_attention_numpy(q, meta, pool, cfg, io_dtype=IODType.from_numpy(case.io_dtype))
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
