"""Small kernel launches for compute-sanitizer (memcheck, racecheck), run by .ci/gpu-run.sh.

Each case: the QKV write then the attention over the same pool, on shuffled pages with NaN-poisoned
slots, a mixed batch (prefill chunk + decodes), compared with the float64 references so that a case that
runs clean but wrong still fails. Small shapes: the sanitizers slow kernels down by 10-100x.
"""

from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np

from pagedkv.config import AttentionConfig, PoolConfig, RopeConfig, RopeStyle, WriteConfig
from pagedkv.kernels.attention import paged_attention_numpy
from pagedkv.kernels.write import qkv_write_numpy
from pagedkv.layout import CacheDType, PageLayout
from pagedkv.reference import paged_attention, qkv_write
from pagedkv.step import StepMetadata
from pagedkv.tolerances import TOLERANCES

BF16 = np.dtype(ml_dtypes.bfloat16)

CASES = [
    # (heads, kv_heads, head_dim, page, cache dtype, page layout, window, sinks, cyclic_len)
    (8, 2, 128, 16, CacheDType.BF16, PageLayout.HND, 0, 0, 0),
    (4, 4, 64, 24, CacheDType.FP16, PageLayout.NHD, 0, 0, 0),
    (8, 1, 256, 32, CacheDType.FP8_E4M3, PageLayout.HND, 0, 0, 0),
    (8, 2, 128, 16, CacheDType.INT8, PageLayout.HND, 48, 4, 96),
    # head dims 80 and 96: 16-bit tiles in 128-element rows, flat-order KV copies, idle write lanes, the 8-bit
    # decode's per-warp conversion
    (4, 2, 80, 16, CacheDType.FP16, PageLayout.NHD, 0, 0, 0),
    (6, 2, 96, 24, CacheDType.FP8_E4M3, PageLayout.HND, 48, 4, 96),
]
# Long prefill chunks: CTAs of the multi-token kernels that run through more KV tiles than the pipeline has stages,
# so every stage is refilled while other warps may still read it (on an H100 / H200: the Hopper kernel's
# warp-specialized variant, its producer converting the 8-bit tiles at fp8). (case, q_lens, past_lens)
LONG_CASES = [
    ((8, 2, 128, 16, CacheDType.BF16, PageLayout.HND, 0, 0, 0), (300, 1), (650, 50)),
    ((8, 2, 128, 64, CacheDType.FP8_E4M3, PageLayout.HND, 0, 0, 0), (260, 3), (700, 9)),
    # more CTAs than SMs, so that CTAs follow each other on an SM (a per-warp stage release was reported only here)
    ((32, 8, 128, 64, CacheDType.BF16, PageLayout.HND, 0, 0, 0), (1000,), (0,)),
    ((32, 8, 128, 16, CacheDType.FP8_E4M3, PageLayout.HND, 0, 0, 0), (700,), (0,)),
    # pages of 24 tokens in an HND bf16 pool: a producer warp's 16-row halves are whole runs of one page (loaded by TMA
    # where the Hopper kernel has its tensor map) or straddle two pages (cp.async), both kinds in the same stages
    ((8, 2, 128, 24, CacheDType.BF16, PageLayout.HND, 0, 0, 0), (400, 1), (300, 40)),
    # head dim 80 on the multi-token kernels: 128-element tile rows of which 80 are written (on an H100 / H200 the
    # Hopper kernel where it serves D = 80, its 8-bit producer converting 16 rows at a time)
    ((4, 2, 80, 16, CacheDType.BF16, PageLayout.HND, 0, 0, 0), (300, 2), (400, 30)),
    ((4, 2, 80, 16, CacheDType.FP8_E4M3, PageLayout.HND, 0, 0, 0), (300,), (200,)),
    # head dim 256 on the multi-token kernels (on an H100 / H200 the Hopper kernel's one-warpgroup configuration: 64-token
    # tiles, 16 rows a producer warp; pages of 24 tokens mix TMA and cp.async halves; 8-bit tiles converted 8 rows at a
    # time)
    ((8, 2, 256, 24, CacheDType.BF16, PageLayout.HND, 0, 0, 0), (300, 2), (400, 30)),
    ((4, 2, 256, 16, CacheDType.FP8_E4M3, PageLayout.HND, 0, 0, 0), (300,), (200,)),
    # three consumer warpgroups (the Hopper kernel over a 16-bit cache at D = 64 and 32: 192-row tiles, no turns, the
    # producer at 32 registers) through more KV tiles than stages, in more cells (32 row tiles x 8 KV heads) than an
    # H100 / H200 has CTAs: D = 64 HND with pages of 24 (TMA and cp.async halves), D = 32 NHD (cp.async only)
    ((32, 8, 64, 24, CacheDType.BF16, PageLayout.HND, 0, 0, 0), (1500, 2), (600, 30)),
    ((32, 8, 32, 16, CacheDType.FP16, PageLayout.NHD, 0, 0, 0), (1500, 2), (600, 30)),
    # over 4 x the resident write warps in tokens (132 SMs x 24 on an H200): the QKV write's grid of one warp per
    # token over several waves, its CTAs following each other on an SM; short sequences keep the attention small
    ((4, 2, 64, 16, CacheDType.FP16, PageLayout.NHD, 0, 0, 0), (100,) * 132 + (7,), (0,) * 132 + (50,)),
]

# The decode kernel at its 2- and 8-warp CTA widths (PAGEDKV_DECODE_WARPS; the plan picks 4 for these small steps):
# decode rows only, spans of several steps per warp, one split over many chunks (+ the merge). (warps, case, q_lens,
# past_lens)
WIDTH_CASES = [
    (warps, (8, 2, 128, 16, CacheDType.BF16, PageLayout.HND, 0, 0, 0), (1, 1, 1, 2), (700, 1000, 40, 300))
    for warps in (2, 8)
] + [
    (8, (4, 4, 64, 24, CacheDType.FP16, PageLayout.NHD, 0, 0, 0), (1, 1), (9000, 77)),
    (2, (6, 2, 96, 16, CacheDType.BF16, PageLayout.HND, 48, 4, 96), (1, 3, 1), (500, 90, 33)),
]


def run_case(rng, heads, kv_heads, head_dim, page, cache, page_layout, window, sinks, cyclic,
             q_lens=(33, 1, 1, 7), past=(0, 40, 77, 20)) -> bool:
    q_lens, past = np.array(q_lens), np.array(past)
    kv_lens = past + q_lens
    pool_cfg = PoolConfig(num_kv_heads=kv_heads, head_dim=head_dim, page_size=page, num_layers=2, layer_index=1,
                          cache_dtype=cache, page_layout=page_layout, ring_sink_tokens=sinks, cyclic_len=cyclic,
                          k_scale=0.05, v_scale=0.04)
    layout = pool_cfg.layout()
    pages = [int(layout.pages_needed(n)) for n in kv_lens]
    num_blocks = sum(pages) + 5
    perm = rng.permutation(num_blocks)
    table = np.full((len(pages), max(pages) + 1), -1, np.int32)
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[at:at + n]
        at += n
    meta = StepMetadata(table, np.concatenate([[0], np.cumsum(q_lens)]), past)
    wcfg = WriteConfig(num_q_heads=heads, pool=pool_cfg, rope=RopeConfig(style=RopeStyle.GPTJ, rotary_dim=head_dim // 2),
                       has_bias=True)
    acfg = AttentionConfig(num_q_heads=heads, pool=pool_cfg, window=window, attention_sinks=sinks)
    # Pool holds random "past" values (the write overwrites this step's slots).
    storage = cache.numpy_dtype
    if cache == CacheDType.INT8:
        pool = rng.integers(-100, 100, layout.pool_shape(num_blocks)).astype(np.int8)
    else:
        pool = rng.standard_normal(layout.pool_shape(num_blocks)).astype(np.float32).astype(storage)
    width = (heads + 2 * kv_heads) * head_dim
    # Activations share a 16-bit cache's type (the attention kernel takes q of the cache's type); bf16 otherwise.
    io = storage if cache in (CacheDType.FP16, CacheDType.BF16) else BF16
    qkv = rng.standard_normal((meta.num_tokens, width)).astype(io)
    bias = (0.1 * rng.standard_normal(width)).astype(io)

    pool_ref = pool.copy()
    q_ref = qkv_write(qkv, bias, meta, pool_ref, wcfg)
    out_ref = paged_attention(q_ref, meta, pool_ref, acfg)

    q = qkv_write_numpy(qkv, bias, meta, pool, wcfg)
    out = paged_attention_numpy(np.asarray(q), meta, pool, acfg).astype(np.float64)
    atol, rtol = TOLERANCES["bfloat16"]
    # The kernel attends over its own (bf16-rounded) q and its own quantized K/V: compare to the reference
    # with the bf16 tolerance, widened for quantized caches by their relative step.
    if cache.quantized:
        rtol = atol = 0.08
    good = np.allclose(out, out_ref, atol=atol, rtol=rtol) and not np.isnan(out).any()
    print(f"case H={heads} KVH={kv_heads} D={head_dim} P={page} {cache.name} {page_layout.name} window={window} "
          f"sinks={sinks} cyclic={cyclic} q_lens={q_lens.tolist()} past={past.tolist()}: "
          f"max abs err {np.abs(out - out_ref).max():.3e} {'PASS' if good else 'FAIL'}")
    return bool(good)


def main() -> int:
    rng = np.random.default_rng(7)
    results = [run_case(rng, *case) for case in CASES]
    results += [run_case(rng, *case, q_lens, past) for case, q_lens, past in LONG_CASES]
    for warps, case, q_lens, past in WIDTH_CASES:
        os.environ["PAGEDKV_DECODE_WARPS"] = str(warps)  # read at every launch
        print(f"decode CTA width {warps} warps:", end=" ")
        results.append(run_case(rng, *case, q_lens, past))
        del os.environ["PAGEDKV_DECODE_WARPS"]
    print(f"{sum(results)} passed, {len(results) - sum(results)} failed")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
