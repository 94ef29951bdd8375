"""pagedkv.reference.attention: the paged read against dense_attention (explicit mask matrix) on the same K/V,
with pools filled by plain numpy indexing and poisoned with NaN everywhere a read must not reach."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import pagedkv.reference.attention as attention_module
from pagedkv.config import AttentionConfig, PoolConfig, WriteConfig
from pagedkv.layout import CacheDType, KVLayout, PageLayout, last_page_len, length_from_pages
from pagedkv.reference import apply_rope, dense_attention, dequantize, paged_attention, qkv_write, quantize
from pagedkv.step import StepMetadata

FP16, BF16, FP8, INT8 = CacheDType.FP16, CacheDType.BF16, CacheDType.FP8_E4M3, CacheDType.INT8
HEAD_DIM = 64
# Both sides are float64 over the same stored K/V; they differ only in summation order.
AGREE = dict(rtol=1e-10, atol=1e-12)


def pool_index(layout: KVLayout, block, layer, kv, offset) -> tuple:
    """Index of the [KVH, D] rows of one token: plain numpy indexing of pool_shape, not elem_offset."""
    if layout.page_layout == PageLayout.HND:
        return block, layer, kv, slice(None), offset
    return block, layer, kv, offset


def scale_for(values, cache_dtype):
    top = {FP8: 440.0, INT8: 126.0}.get(cache_dtype)
    return float(np.max(np.abs(values))) / top if top else 1.0


@dataclass(frozen=True)
class Case:
    """One attention step: sequences as (past_len, q_len) over a linear cache."""

    name: str
    seqs: tuple
    heads: tuple = (8, 2)
    cache_dtype: CacheDType = FP16
    window: int = 0
    attention_sinks: int = 0
    softcap: float = 0.0
    softmax_scale: float = 0.0
    q_gain: float = 1.0  # larger logits, so that softcap matters
    head_dim: int = HEAD_DIM

    def __post_init__(self):
        assert all(past >= 0 and q >= 0 for past, q in self.seqs)
        assert self.heads[0] % self.heads[1] == 0

    def __str__(self):
        return self.name


MIXED = ((0, 33), (50, 10), (77, 1), (12, 0))
CASES = [
    Case("decode", ((0, 1), (5, 1), (16, 1), (47, 1), (100, 1))),
    Case("chunk-over-prefix", ((40, 25),)),
    Case("mixed-gqa", MIXED),
    Case("mixed-mqa", MIXED, heads=(4, 1)),
    Case("mixed-mha", MIXED, heads=(4, 4)),
    Case("window", MIXED, window=16),
    Case("window-sinks", MIXED, window=16, attention_sinks=4),
    Case("window-1", ((30, 5), (3, 1)), window=1),
    Case("softcap", MIXED, softcap=5.0, q_gain=4.0),
    Case("softmax-scale", MIXED, softmax_scale=0.3),
    Case("bf16", MIXED, cache_dtype=BF16),
    Case("fp8", MIXED, cache_dtype=FP8, window=20, attention_sinks=3),
    Case("int8", MIXED, cache_dtype=INT8),
    # head dims outside 64 / 128 / 256 (Phi-2 80, Phi-3-mini 96, 32)
    Case("mixed-gqa-d80", MIXED, head_dim=80),
    Case("window-sinks-fp8-d96", MIXED, cache_dtype=FP8, window=16, attention_sinks=4, head_dim=96),
    Case("decode-int8-d32", ((0, 1), (5, 1), (16, 1), (47, 1)), cache_dtype=INT8, head_dim=32),
]


class Built:
    """Pool filled from dense K/V for every sequence's kv positions; NaN (float pools) or random bytes (int8)
    everywhere else. ``k``/``v`` hold the dequantized per-sequence dense tensors [kv_len, KVH, D]."""

    def __init__(self, case: Case, page_layout: PageLayout, page_size: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        h, kvh = case.heads
        kv_lens = [past + q for past, q in case.seqs]
        pages = [-(-n // page_size) for n in kv_lens]
        self.num_blocks = sum(pages) + 3
        free = list(rng.permutation(self.num_blocks))
        table = np.full((len(case.seqs), max(pages) + 1), -1, dtype=np.int32)
        for b, n in enumerate(pages):
            table[b, :n] = [free.pop() for _ in range(n)]
        cu = np.concatenate([[0], np.cumsum([q for _, q in case.seqs])])
        self.meta = StepMetadata(table, cu, np.array([p for p, _ in case.seqs]))
        raw_k = [rng.standard_normal((n, kvh, case.head_dim)) for n in kv_lens]
        raw_v = [rng.standard_normal((n, kvh, case.head_dim)) for n in kv_lens]
        k_scale = scale_for(np.concatenate(raw_k), case.cache_dtype)
        v_scale = scale_for(np.concatenate(raw_v), case.cache_dtype)
        pool_cfg = PoolConfig(num_kv_heads=kvh, head_dim=case.head_dim, page_size=page_size, num_layers=3,
                              layer_index=2, cache_dtype=case.cache_dtype, page_layout=page_layout, k_scale=k_scale, v_scale=v_scale)
        self.cfg = AttentionConfig(num_q_heads=h, pool=pool_cfg, window=case.window, attention_sinks=case.attention_sinks,
                                   softmax_scale=case.softmax_scale, logit_softcap=case.softcap)
        self.layout = pool_cfg.layout()
        dtype = case.cache_dtype.numpy_dtype
        shape = self.layout.pool_shape(self.num_blocks)
        self.pool = (rng.integers(-128, 128, size=shape, dtype=np.int8) if case.cache_dtype == INT8
                     else np.full(shape, np.nan, dtype=dtype))
        self.k, self.v = [], []
        for b, n in enumerate(kv_lens):
            k_st, v_st = quantize(raw_k[b], case.cache_dtype, k_scale), quantize(raw_v[b], case.cache_dtype, v_scale)
            for pos in range(n):
                blk = table[b, pos // page_size]
                self.pool[pool_index(self.layout, blk, 2, 0, pos % page_size)] = k_st[pos]
                self.pool[pool_index(self.layout, blk, 2, 1, pos % page_size)] = v_st[pos]
            self.k.append(dequantize(k_st, case.cache_dtype, k_scale))
            self.v.append(dequantize(v_st, case.cache_dtype, v_scale))
        self.q = rng.standard_normal((self.meta.num_tokens, h, case.head_dim)) * case.q_gain

    def dense(self, case: Case, k=None, v=None):
        out = np.zeros_like(self.q)
        for b, (past, q_len) in enumerate(case.seqs):
            if q_len == 0:
                continue
            rows = slice(self.meta.cu_q_lens[b], self.meta.cu_q_lens[b + 1])
            kk = self.k[b] if k is None else k[b]
            vv = self.v[b] if v is None else v[b]
            out[rows] = dense_attention(self.q[rows], kk, vv, past + np.arange(q_len), np.arange(past + q_len),
                                        window=case.window, attention_sinks=case.attention_sinks,
                                        softmax_scale=self.cfg.resolved_softmax_scale, logit_softcap=case.softcap)
        return out


@pytest.mark.parametrize("page_size", [16, 24])
@pytest.mark.parametrize("page_layout", list(PageLayout), ids=lambda p: p.name)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_paged_equals_dense(case, page_layout, page_size):
    built = Built(case, page_layout, page_size)
    got = paged_attention(built.q, built.meta, built.pool, built.cfg)
    assert got.shape == built.q.shape and np.all(np.isfinite(got))  # NaN poison past every length: never read
    np.testing.assert_allclose(got, built.dense(case), **AGREE)
    flat_q = built.q.reshape(built.q.shape[0], -1)  # [T, H*D] is accepted too
    np.testing.assert_array_equal(paged_attention(flat_q, built.meta, built.pool, built.cfg), got)


@pytest.mark.parametrize("case", [c for c in CASES if c.name in ("mixed-gqa", "window-sinks", "softcap")], ids=str)
def test_query_tiling_does_not_change_the_result(case, monkeypatch):
    """Long prefills are processed in query tiles that skip keys no query of the tile sees."""
    built = Built(case, PageLayout.HND, 16, seed=2)
    whole = paged_attention(built.q, built.meta, built.pool, built.cfg)
    monkeypatch.setattr(attention_module, "_QUERY_TILE", 7)
    tiled = paged_attention(built.q, built.meta, built.pool, built.cfg)
    np.testing.assert_allclose(tiled, whole, **AGREE)
    np.testing.assert_allclose(tiled, built.dense(case), **AGREE)


def test_long_prefill_spanning_several_query_tiles():
    case = Case("long", ((0, 300), (40, 150)), heads=(2, 1), window=100, attention_sinks=2)
    built = Built(case, PageLayout.NHD, 24, seed=4)
    np.testing.assert_allclose(paged_attention(built.q, built.meta, built.pool, built.cfg), built.dense(case), **AGREE)


def test_softcap_and_scale_change_the_result():
    """Guards the two cases above against passing vacuously (e.g. if the options were ignored on both sides)."""
    base = Built(Case("b", MIXED, q_gain=4.0), PageLayout.HND, 16)
    plain = paged_attention(base.q, base.meta, base.pool, base.cfg)
    capped = AttentionConfig(num_q_heads=8, pool=base.cfg.pool, logit_softcap=5.0)
    scaled = AttentionConfig(num_q_heads=8, pool=base.cfg.pool, softmax_scale=0.3)
    assert not np.allclose(plain, paged_attention(base.q, base.meta, base.pool, capped), rtol=1e-3, atol=1e-3)
    assert not np.allclose(plain, paged_attention(base.q, base.meta, base.pool, scaled), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("case", [c for c in CASES if c.window], ids=str)
def test_positions_no_query_sees_are_never_read(case):
    built = Built(case, PageLayout.NHD, 16, seed=3)
    if case.cache_dtype == INT8:
        pytest.skip("int8 pools cannot hold NaN")
    table, layout = built.meta.block_table, built.layout
    poisoned = 0
    for b, (past, q_len) in enumerate(case.seqs):
        if q_len == 0:
            continue
        # visible to the first query (the oldest window): sinks and the last `window` positions up to it
        for pos in range(past + q_len):
            if pos >= case.attention_sinks and past - pos >= case.window:
                blk = table[b, pos // 16]
                built.pool[pool_index(layout, blk, 2, 0, pos % 16)] = np.nan
                built.pool[pool_index(layout, blk, 2, 1, pos % 16)] = np.nan
                poisoned += 1
    assert poisoned > 0
    got = paged_attention(built.q, built.meta, built.pool, built.cfg)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, built.dense(case), **AGREE)


@pytest.mark.parametrize("bad_entry", [-1, "NB", -3])
def test_invalid_page_on_read_is_zero_filled(bad_entry):
    case = Case("mixed", MIXED)
    built = Built(case, PageLayout.HND, 16, seed=5)
    table = built.meta.block_table.copy()
    table[1, 1] = built.num_blocks if bad_entry == "NB" else bad_entry  # sequence 1: positions 16..31
    meta = StepMetadata(table, built.meta.cu_q_lens, built.meta.past_lens)
    k = [x.copy() for x in built.k]
    v = [x.copy() for x in built.v]
    k[1][16:32] = 0
    v[1][16:32] = 0
    got = paged_attention(built.q, meta, built.pool, built.cfg)
    np.testing.assert_allclose(got, built.dense(case, k, v), **AGREE)
    assert not np.allclose(got, built.dense(case), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cache_dtype", [FP16, FP8, INT8], ids=lambda c: c.name)
@pytest.mark.parametrize("window, sinks", [(0, 0), (8, 2)])
@pytest.mark.parametrize("page_layout", list(PageLayout), ids=lambda p: p.name)
def test_chunked_prefill_equals_one_shot_dense_causal(cache_dtype, window, sinks, page_layout):
    """Write + attend chunk by chunk (17, 20, 13 tokens) == dense attention over the whole 50-token prompt."""
    rng = np.random.default_rng(9)
    h, kvh, n = 8, 2, 50
    qkv = rng.standard_normal((n, (h + 2 * kvh) * HEAD_DIM))
    k_scale, v_scale = (0.02, 0.03) if cache_dtype.quantized else (1.0, 1.0)
    pool_cfg = PoolConfig(num_kv_heads=kvh, head_dim=HEAD_DIM, page_size=16, num_layers=1, layer_index=0,
                          cache_dtype=cache_dtype, page_layout=page_layout, k_scale=k_scale, v_scale=v_scale)
    write_cfg = WriteConfig(num_q_heads=h, pool=pool_cfg)
    attn_cfg = AttentionConfig(num_q_heads=h, pool=pool_cfg, window=window, attention_sinks=sinks)
    table = rng.permutation(6)[:4].astype(np.int32)[None, :]
    shape, dtype = pool_cfg.layout().pool_shape(6), cache_dtype.numpy_dtype
    pool = np.zeros(shape, dtype) if cache_dtype == INT8 else np.full(shape, np.nan, dtype)
    outs, qs = [], []
    for past, q_len in ((0, 17), (17, 20), (37, 13)):
        meta = StepMetadata(table, np.array([0, q_len]), np.array([past]))
        q = qkv_write(qkv[past:past + q_len], None, meta, pool, write_cfg)
        outs.append(paged_attention(q, meta, pool, attn_cfg))
        qs.append(q)
    # the dense side: the same q, K/V computed without the pool (RoPE'd by the write reference's positions)
    one = StepMetadata(table, np.array([0, n]), np.array([0]))
    q_all = qkv_write(qkv, None, one, np.zeros_like(pool), write_cfg)
    np.testing.assert_array_equal(np.concatenate(qs), q_all)
    x = qkv.reshape(n, h + 2 * kvh, HEAD_DIM)
    k = apply_rope(x[:, h:h + kvh], np.arange(n), HEAD_DIM, write_cfg.rope)
    v = x[:, h + kvh:]
    k = dequantize(quantize(k, cache_dtype, pool_cfg.k_scale), cache_dtype, pool_cfg.k_scale)
    v = dequantize(quantize(v, cache_dtype, pool_cfg.v_scale), cache_dtype, pool_cfg.v_scale)
    want = dense_attention(q_all, k, v, np.arange(n), np.arange(n), window=window, attention_sinks=sinks,
                           softmax_scale=attn_cfg.resolved_softmax_scale)
    np.testing.assert_allclose(np.concatenate(outs), want, **AGREE)


@pytest.mark.parametrize("page_size", [1, 7, 16, 24, 64])
def test_length_formula_matches_the_mapping(page_size):
    """(pages - 1) * P + last_page_len recovers the length that pages_needed / locate lay out."""
    layout = KVLayout(1, 1, page_size, HEAD_DIM)
    rng = np.random.default_rng(page_size)
    for length in np.concatenate([[0, 1, page_size - 1, page_size, page_size + 1], rng.integers(0, 5000, 60)]):
        length = int(length)
        pages = int(layout.pages_needed(length))
        last = int(last_page_len(length, page_size))
        assert int(length_from_pages(pages, last, page_size)) == length
        if length:
            row = np.arange(pages, dtype=np.int32)
            block, offset, _ = layout.locate(row, np.arange(length), pages)
            assert np.all(block >= 0) and len(np.unique(block)) == pages  # every page used, none missing
            assert int(np.sum(block == pages - 1)) == last  # the last page holds last_page_len tokens
            assert int(offset[-1]) + 1 == last


# ---- cyclic cache ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_layout", list(PageLayout), ids=lambda p: p.name)
@pytest.mark.parametrize("page_size, sinks, cyclic_len, window, steps", [
    (4, 3, 16, 8, [6, 5, 1, 1, 3, 1, 7, 2, 1, 5, 9, 1, 1]),
    (16, 4, 32, 20, [20, 13, 1, 1, 13, 1, 10, 13, 2, 1]),
], ids=["p4", "p16"])
def test_cyclic_cache_attention_equals_dense_over_the_full_history(page_layout, page_size, sinks, cyclic_len,
                                                                   window, steps):
    rng = np.random.default_rng(13)
    h, kvh = 4, 2
    total = sum(steps)
    assert total > sinks + 2 * cyclic_len
    pool_cfg = PoolConfig(num_kv_heads=kvh, head_dim=HEAD_DIM, page_size=page_size, num_layers=1, layer_index=0,
                          cache_dtype=FP16, page_layout=page_layout, ring_sink_tokens=sinks, cyclic_len=cyclic_len)
    layout = pool_cfg.layout()
    pages = int(layout.pages_needed(total))
    table = rng.permutation(pages + 2)[:pages].astype(np.int32)[None, :]
    pool = np.full(layout.pool_shape(pages + 2), np.nan, np.float16)
    write_cfg = WriteConfig(num_q_heads=h, pool=pool_cfg)
    attn_cfg = AttentionConfig(num_q_heads=h, pool=pool_cfg, window=window, attention_sinks=sinks)
    qkv = rng.standard_normal((total, (h + 2 * kvh) * HEAD_DIM))
    x = qkv.reshape(total, h + 2 * kvh, HEAD_DIM)
    k = quantize(apply_rope(x[:, h:h + kvh], np.arange(total), HEAD_DIM, write_cfg.rope), FP16).astype(np.float64)
    v = quantize(x[:, h + kvh:], FP16).astype(np.float64)
    past = 0
    for q_len in steps:
        meta = StepMetadata(table, np.array([0, q_len]), np.array([past]))
        q = qkv_write(qkv[past:past + q_len], None, meta, pool, write_cfg)
        got = paged_attention(q, meta, pool, attn_cfg)
        kv_len = past + q_len
        want = dense_attention(q, k[:kv_len], v[:kv_len], past + np.arange(q_len), np.arange(kv_len), window=window,
                               attention_sinks=sinks, softmax_scale=attn_cfg.resolved_softmax_scale)
        np.testing.assert_allclose(got, want, **AGREE, err_msg=f"step at past {past}")
        past = kv_len


def test_window_larger_than_the_ring_is_an_error():
    pool_cfg = PoolConfig(num_kv_heads=1, head_dim=HEAD_DIM, page_size=4, num_layers=1, layer_index=0,
                          cache_dtype=FP16, ring_sink_tokens=2, cyclic_len=8)
    pool = np.zeros(pool_cfg.layout().pool_shape(4), np.float16)
    table = np.array([[0, 1, 2]], dtype=np.int32)
    # decode at position 20 with window 9: position 12 was overwritten by position 20 (same ring slot)
    attn = AttentionConfig(num_q_heads=1, pool=pool_cfg, window=9, attention_sinks=2)
    meta = StepMetadata(table, np.array([0, 1]), np.array([20]))
    with pytest.raises(ValueError, match="cyclic_len=8"):
        paged_attention(np.ones((1, 1, HEAD_DIM)), meta, pool, attn)
    # window 8 fits a decode, but not a 3-token chunk (needs window + q_len - 1 = 10 ring slots)
    ok = AttentionConfig(num_q_heads=1, pool=pool_cfg, window=8, attention_sinks=2)
    paged_attention(np.ones((1, 1, HEAD_DIM)), meta, pool, ok)
    chunk = StepMetadata(table, np.array([0, 3]), np.array([18]))
    with pytest.raises(ValueError, match="window"):
        paged_attention(np.ones((3, 1, HEAD_DIM)), chunk, pool, ok)
    full_causal = AttentionConfig(num_q_heads=1, pool=pool_cfg)
    with pytest.raises(ValueError, match="overwrote"):
        paged_attention(np.ones((1, 1, HEAD_DIM)), meta, pool, full_causal)


# ---- fp8 queries and input validation ------------------------------------------------------------------------
def test_fp8_query_is_dequantized_with_q_scale():
    built = Built(Case("mixed", MIXED), PageLayout.HND, 16, seed=17)
    q_scale = 0.01
    fp8_cfg = AttentionConfig(num_q_heads=8, pool=built.cfg.pool, q_fp8=True, q_scale=q_scale)
    q_stored = quantize(built.q, FP8, q_scale)
    q_values = dequantize(q_stored, FP8, q_scale)
    want = paged_attention(q_values, built.meta, built.pool, built.cfg)
    np.testing.assert_array_equal(paged_attention(q_stored, built.meta, built.pool, fp8_cfg), want)
    # float input under q_fp8 is put on the fp8 grid first
    np.testing.assert_array_equal(paged_attention(built.q, built.meta, built.pool, fp8_cfg), want)
    assert not np.allclose(want, paged_attention(built.q, built.meta, built.pool, built.cfg), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="q_fp8"):
        paged_attention(q_stored, built.meta, built.pool, built.cfg)


def test_bad_inputs_name_the_field():
    built = Built(Case("mixed", MIXED), PageLayout.HND, 16, seed=19)
    with pytest.raises(ValueError, match="q:"):
        paged_attention(built.q[:-1], built.meta, built.pool, built.cfg)
    with pytest.raises(ValueError, match="q:"):
        paged_attention(built.q[:, :4], built.meta, built.pool, built.cfg)
    with pytest.raises(ValueError, match="pool"):
        paged_attention(built.q, built.meta, built.pool.astype(np.float32), built.cfg)
    with pytest.raises(ValueError, match="sees no key"):
        dense_attention(np.ones((1, 1, 4)), np.ones((2, 1, 4)), np.ones((2, 1, 4)), [0], [1, 2], softmax_scale=1.0)
    with pytest.raises(ValueError, match="multiple"):
        dense_attention(np.ones((1, 3, 4)), np.ones((1, 2, 4)), np.ones((1, 2, 4)), [0], [0], softmax_scale=1.0)


def test_empty_step():
    built = Built(Case("idle", ((7, 0), (3, 0))), PageLayout.HND, 16)
    out = paged_attention(np.zeros((0, 8, HEAD_DIM)), built.meta, built.pool, built.cfg)
    assert out.shape == (0, 8, HEAD_DIM)
