"""Paged attention, host side (CPU, in CI): everything the launcher decides before the GPU is involved.

* Bad parameters give an error naming the field and the value, before any CUDA call (this machine has no
  GPU, so a CUDA call would fail with a driver error instead of the validation message).
* The workspace size from bounds covers every launch within the bounds; the plan splits only into what fits.
* The kernels' work decomposition, replayed on the host by the library itself
  (``pagedkv_attention_schedule_check``: the same plan and per-CTA decision functions the kernels run), counts
  every visible (query, kv position) pair exactly once -- checked against an independent dense visibility
  model written with ``pagedkv.layout`` -- and writes every output row exactly once (directly, or as split-K
  partials that the merge combines).
"""

from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import _lib
from pagedkv.capabilities import capabilities
from pagedkv.config import AttentionConfig, PoolConfig
from pagedkv.layout import CacheDType, PageLayout, attends
from pagedkv.step import StepMetadata

if _lib.find_file(_lib.CAPI_NAME) is None:
    pytest.skip(f"{_lib.CAPI_NAME} not built (searched {[str(d) for d in _lib.lib_dirs()]}; "
                "build it or set PAGEDKV_LIB_DIR)", allow_module_level=True)

from pagedkv.kernels import _structs  # noqa: E402
from pagedkv.kernels import attention as A  # noqa: E402

ALIGNED = 1 << 20  # any 16-byte aligned non-null address: validation fails before anything is dereferenced


def _cfg(**pool_overrides) -> AttentionConfig:
    pool = dict(num_kv_heads=8, head_dim=128, page_size=16, num_layers=2, layer_index=1,
                cache_dtype=CacheDType.BF16)
    pool.update(pool_overrides)
    return AttentionConfig(num_q_heads=32, pool=PoolConfig(**pool))


def _good_params(**over):
    """A launch that passes validation (so that the only error is the one a test injects)."""
    params = A.attention_params(_cfg(), io_dtype=A.IODType.BF16, num_tokens=4, num_seqs=2, max_blocks=8, max_q_len=3,
                                max_kv_len=100, q=ALIGNED, out=ALIGNED, pool_descs=ALIGNED, block_table=ALIGNED,
                                cu_q_lens=ALIGNED, past_lens=ALIGNED)
    _structs.set_fields(params, over)
    return params


BAD_FIELDS = [
    # (override by AttentionParams member, text the message must contain: the field named as the plugin
    # attribute / C API parameter is, snake_case)
    ({"headDim": 48}, "head_dim=48"),
    ({"headDim": 112}, "head_dim=112"),
    ({"numQHeads": 30}, "num_q_heads=30"),
    ({"numQHeads": 0}, "num_q_heads=0"),
    ({"numKVHeads": 0}, "num_kv_heads=0"),
    ({"numKVHeads": 70000}, "num_kv_heads=70000"),
    ({"ioDType": 2}, "io_dtype=2"),
    ({"cacheDType": 4}, "cache_dtype=4"),
    ({"cacheDType": 7}, "cache_dtype=7"),
    ({"cacheDType": 0}, "cache_dtype=0"),  # fp16 cache with bf16 queries
    ({"cacheDType": 2, "kScale": 0.0}, "k_scale=0"),
    ({"cacheDType": 3, "vScale": float("nan")}, "v_scale=nan"),
    ({"cacheDType": 2, "kScale": float("inf")}, "k_scale=inf"),
    ({"qFP8": True, "qScale": 0.0}, "q_scale=0"),
    ({"softmaxScale": -1.0}, "softmax_scale=-1"),
    ({"logitSoftcap": -2.0}, "logit_softcap=-2"),
    ({"logitSoftcap": float("inf")}, "logit_softcap=inf"),
    ({"attentionSinks": -1}, "attention_sinks=-1"),
    ({"layer": 2}, "layer_index=2"),
    ({"layer": -1}, "layer_index=-1"),
    ({"layout.pageSize": 0}, "page_size=0"),
    ({"layout.pageLayout": 2}, "page_layout=2"),
    ({"layout.cyclicLen": 40}, "cyclic_len=40"),
    ({"layout.ringSinkTokens": -3}, "ring_sink_tokens=-3"),
    ({"layout.numLayers": 0}, "num_layers=0"),
    ({"layout.numKVHeads": 4}, "layout.num_kv_heads=4"),
    ({"layout.strideHead": 3}, "layout.stride_head=3"),
    ({"layout.bubbleLen": 5}, "layout.bubble_len=5"),
    ({"maxQLen": 0}, "max_q_len=0"),
    ({"maxQLen": 5}, "max_q_len=5"),
    ({"maxKVLen": -1}, "max_kv_len=-1"),
    ({"meta.numSeqs": 0}, "num_tokens=4"),
    ({"meta.numTokens": -1}, "num_tokens=-1"),
    ({"meta.maxBlocks": -1}, "max_blocks=-1"),
    ({"meta.poolIndex": -1}, "pool_index=-1"),
    ({"q": None}, "q=0"),
    ({"q": ALIGNED + 8}, f"q={ALIGNED + 8}"),
    ({"out": None}, "out=0"),
    ({"out": ALIGNED + 2}, f"out={ALIGNED + 2}"),
    ({"meta.poolDescs": None}, "pool_descs=0"),
    ({"meta.cuQLens": None}, "cu_q_lens=0"),
    ({"meta.pastLens": None}, "past_lens=0"),
    ({"meta.blockTable": None}, "block_table=0"),
    ({"workspaceBytes": 4096}, "workspace=0"),
    ({"workspace": ALIGNED + 4, "workspaceBytes": 4096}, f"workspace={ALIGNED + 4}"),
]


@pytest.mark.parametrize("override,needle", BAD_FIELDS, ids=[n for _, n in BAD_FIELDS])
def test_bad_parameters_name_field_and_value(override, needle):
    with pytest.raises(_lib.CapiError) as err:
        A.launch_attention(_good_params(**override))
    assert needle in str(err.value), str(err.value)
    assert "expected" in str(err.value)


def test_good_parameters_reach_the_gpu_only_after_validation():
    # The untouched args pass validation, so the failure (no GPU here) comes from CUDA, not from a field.
    from pagedkv import cuda

    if cuda.why_no_gpu() is None:
        pytest.skip("a GPU is present: launching with fake pointers would fault (covered by the GPU tests)")
    with pytest.raises(_lib.CapiError) as err:
        A.launch_attention(_good_params())
    msg = str(err.value)
    assert "launchAttention: cuda" in msg, msg  # the CUDA failure, not a stale validation message


def test_empty_step_is_a_no_op_without_any_cuda_call():
    # T = 0: nothing to compute, nothing dereferenced, no GPU needed.
    A.launch_attention(_good_params(**{"meta.numTokens": 0, "meta.numSeqs": 0, "maxQLen": 0, "q": None, "out": None,
                                       "meta.poolDescs": None, "meta.blockTable": None, "meta.cuQLens": None,
                                       "meta.pastLens": None}))


def test_null_params():
    rc = A._capi().pagedkv_attention(None, None)
    assert rc != 0 and "params=NULL" in _lib.capi().pagedkv_last_error().decode()


@pytest.mark.parametrize("bad,needle", [((-1, 1, 32, 128, 100, 16), "num_tokens=-1"),
                                        ((1, -1, 32, 128, 100, 16), "num_seqs=-1"),
                                        ((1, 1, 0, 128, 100, 16), "num_q_heads=0"),
                                        ((1, 1, 32, 48, 100, 16), "head_dim=48"),
                                        ((1, 1, 32, 128, -7, 16), "max_kv_len=-7"),
                                        ((1, 1, 32, 128, 100, 0), "page_size=0")])
def test_workspace_bytes_rejects_bad_bounds(bad, needle):
    with pytest.raises(_lib.CapiError, match=needle):
        A.attention_workspace_bytes(*bad)


# attention_plan.h: the Hopper kernel's KV row maps (a 128-byte tensor map per CTA, 1024 slots) at the workspace's end
KV_ROW_MAP_REGION = 1024 * 128


def test_workspace_bytes_shape():
    # no split possible (span below two minimum chunks) -> no partials, only the KV row maps' region
    assert A.attention_workspace_bytes(64, 64, 32, 128, 256, 16) == KV_ROW_MAP_REGION
    assert A.attention_workspace_bytes(0, 0, 32, 128, 100000, 16) == 0
    # grows with the bound on the span and with T, but never past the fixed partial-row budget
    small = A.attention_workspace_bytes(1, 1, 32, 128, 4096, 16)
    large = A.attention_workspace_bytes(1, 1, 32, 128, 131072, 16)
    assert 0 < small < large
    huge_t = A.attention_workspace_bytes(8192, 64, 32, 128, 131072, 16)
    assert huge_t == A.attention_workspace_bytes(16384, 64, 32, 128, 131072, 16) > 0
    assert A.attention_workspace_bytes(1, 1, 32, 256, 131072, 16) > large  # D + 1 floats per partial row


# Per-block opt-in shared-memory limits (cudaDevAttrMaxSharedMemoryPerBlockOptin), as docs/plugin_io.md states them.
SMEM_LIMITS = {"sm_80": 166912, "sm_86/89": 101376, "sm_90": 232448}
SMEM_COLUMNS = (("decode", CacheDType.BF16), ("decode", CacheDType.FP8_E4M3), ("multi", CacheDType.BF16),
                ("multi", CacheDType.FP8_E4M3))


def _docs_smem_table() -> dict[int, list[str]]:
    text = (Path(__file__).resolve().parents[1] / "docs" / "plugin_io.md").read_text()
    section = text.split("## Shared memory per CTA", 1)[1].split("\n## ", 1)[0]
    for arch, limit in SMEM_LIMITS.items():
        assert str(limit) in section, f"the section states the {arch} limit {limit}"
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ") and
            line.split("|")[1].strip().isdigit()]
    return {int(r[0]): [c.strip() for c in r[1:]] for r in rows}


def _smem_cell(smem: int) -> str:
    return f"{smem} ({smem / 1024:.1f})"


def test_docs_shared_memory_table_matches_the_kernels():
    # docs/plugin_io.md tabulates each kernel's shared memory per CTA for every head dim of the capability table
    # (the decode kernel at its default width, and its other widths where compiled) and which GPUs cannot host it:
    # a GPU hosts the decode kernel when some compiled width fits it. The library's compiled numbers must say the
    # same, for both I/O dtypes and both 8-bit dtypes (they share the kernels).
    table = _docs_smem_table()
    assert sorted(table) == list(capabilities().head_dims)
    for d, cells in table.items():
        refused = []
        for (kernel, cache), cell in zip(SMEM_COLUMNS, cells, strict=False):
            caches = ((CacheDType.FP8_E4M3, CacheDType.INT8) if cache == CacheDType.FP8_E4M3 else
                      (CacheDType.FP16, CacheDType.BF16))
            shapes = {A.kernel_shapes(io, c, d)[f"{kernel}_smem_bytes"] for io in A.IODType for c in caches}
            widths = {tuple(A.kernel_shapes(io, c, d)["decode_width_smem_bytes"]) for io in A.IODType for c in caches}
            assert len(shapes) == 1 and len(widths) == 1, (d, kernel, cache, shapes, widths)
            smem, width_smem = shapes.pop(), widths.pop()
            assert cell == _smem_cell(smem), (d, kernel, cache, cell, smem)
            assert smem <= SMEM_LIMITS["sm_90"], "sm_90 hosts every kernel (the launcher's message says so)"
            # what a GPU must host: the smallest compiled decode width, the multi-token kernel as it is
            need = min(s for s in width_smem if s > 0) if kernel == "decode" else smem
            if kernel == "decode":
                assert smem in width_smem, (d, cache, smem, width_smem)  # the default width is one of them
            bits = "16-bit" if cache == CacheDType.BF16 else "8-bit"
            refused += [(arch, f"{kernel} {bits}") for arch, limit in SMEM_LIMITS.items() if need > limit]
        bf16_widths = A.kernel_shapes(A.IODType.BF16, CacheDType.BF16, d)["decode_width_smem_bytes"]
        others = [s for i, s in enumerate(bf16_widths) if s > 0 and A.DECODE_WIDTHS[i] != 4]
        assert cells[4] == (" / ".join(_smem_cell(s) for s in others) or "—"), (d, cells[4], others)
        by_arch = {}
        for arch, what in refused:
            by_arch.setdefault(arch, []).append(what.replace("multi", "multi-token"))
        expected = "; ".join(f"{arch}: {', '.join(w)}" for arch, w in sorted(by_arch.items())) or "—"
        assert cells[5] == expected, (d, cells[5], expected)


def test_kernel_shapes_of_the_new_head_dims_reuse_the_tiles_of_the_next_width():
    # 16-bit tiles of D = 32, 80, 96 are stored in rows of 64, 128, 128 elements: their 16-bit kernels take the
    # shared memory (and threads) of D = 64 and 128 exactly; unsupported head dims are refused by name.
    for d, width in ((32, 64), (80, 128), (96, 128)):
        for io, cache in ((A.IODType.BF16, CacheDType.BF16), (A.IODType.FP16, CacheDType.FP16)):
            assert A.kernel_shapes(io, cache, d) == A.kernel_shapes(io, cache, width), d
    for bad, needle in ((48, "head_dim=48"), (112, "head_dim=112")):
        with pytest.raises(_lib.CapiError, match=needle):
            A.kernel_shapes(A.IODType.BF16, CacheDType.BF16, bad)
    with pytest.raises(_lib.CapiError, match="cache_dtype=4"):
        A.kernel_shapes(A.IODType.BF16, CacheDType.NVFP4, 128)


def test_decode_widths_mirror_the_compiled_widths():
    # DECODE_WIDTHS is Python's copy of the schedule's width list: the 16-bit D = 128 decode is compiled at every
    # width, so its per-width threads spell the list; every instance's default width is one of its compiled ones,
    # and a width's threads and shared memory are both set or both 0.
    shapes = A.kernel_shapes(A.IODType.BF16, CacheDType.BF16, 128)
    assert [t // 32 for t in shapes["decode_width_threads"]] == list(A.DECODE_WIDTHS)
    for io in A.IODType:
        for cache in (CacheDType.FP16, CacheDType.BF16, CacheDType.FP8_E4M3, CacheDType.INT8):
            for d in (32, 64, 80, 96, 128, 256):
                s = A.kernel_shapes(io, cache, d)
                pairs = list(zip(s["decode_width_threads"], s["decode_width_smem_bytes"], strict=True))
                assert (s["decode_threads"], s["decode_smem_bytes"]) in pairs, (io, cache, d, s)
                assert all((t > 0) == (b > 0) for t, b in pairs), (io, cache, d, s)
                assert all(t in (0, 32 * w) for t, w in zip(s["decode_width_threads"], A.DECODE_WIDTHS)), s


def _plan(cfg, *, io=A.IODType.BF16, T, B, MB, max_q, max_kv, ws=None, sm=132, dec=2, multi=2, chunks=0):
    if ws is None:
        ws = A.attention_workspace_bytes(T, B, cfg.num_q_heads, cfg.pool.head_dim, max_kv, cfg.pool.page_size)
    params = A.attention_params(cfg, io_dtype=io, num_tokens=T, num_seqs=B, max_blocks=MB, max_q_len=max_q,
                                max_kv_len=max_kv, workspace_bytes=ws)
    return A.attention_plan(params, sm_count=sm, decode_ctas_per_sm=dec, multi_ctas_per_sm=multi,
                            decode_chunks=chunks), ws


@pytest.mark.parametrize("shape", [dict(T=1, B=1, MB=2048, max_q=1, max_kv=32768),
                                   dict(T=8, B=1, MB=8192, max_q=8, max_kv=131072),
                                   dict(T=8192, B=4, MB=640, max_q=2048, max_kv=10240)])
def test_plan_partials_leave_the_kv_row_map_region(shape):
    # The maps' region is the workspace's tail: the partials end before it starts. A workspace too small for the
    # region (no TMA slots: the Hopper kernel loads by cp.async) still plans splits that fit it.
    cfg = _cfg()
    plan, ws = _plan(cfg, **shape)
    assert ws >= KV_ROW_MAP_REGION
    assert plan["workspace_bytes"] <= ws - KV_ROW_MAP_REGION
    small = KV_ROW_MAP_REGION - 128
    without, _ = _plan(cfg, **shape, ws=small)
    assert without["workspace_bytes"] <= small


def test_plan_kernel_choice_and_split():
    cfg = _cfg()
    # decode only: no multi-token kernel; one long sequence is split to fill the GPU
    plan, ws = _plan(cfg, T=1, B=1, MB=2048, max_q=1, max_kv=32768)
    assert plan["run_decode"] and not plan["run_multi"] and plan["run_merge"]
    assert plan["decode_grid"][:2] == [1, 8] and plan["decode_grid"][2] > 16
    assert plan["decode_chunk_len"] % 64 == 0 and plan["decode_chunk_len"] >= 256
    assert plan["decode_grid"][2] * plan["decode_chunk_len"] >= 32768
    assert 0 < plan["workspace_bytes"] <= ws
    assert plan["merge_grid"] == 1 * cfg.num_q_heads  # one merge CTA per (token, head) row
    # a large decode batch fills the GPU by itself: no split, no merge, no workspace
    plan, _ = _plan(cfg, T=256, B=256, MB=64, max_q=1, max_kv=1024)
    assert plan["run_decode"] and not plan["run_merge"] and plan["decode_grid"] == [256, 8, 1]
    assert plan["workspace_bytes"] == 0
    # prefill chunks: both kernels (decode CTAs exit for multi-token sequences), no split for big tiles
    plan, _ = _plan(cfg, T=8192, B=4, MB=640, max_q=2048, max_kv=10240)
    assert plan["run_multi"] and plan["run_decode"] and not plan["run_merge"]
    assert plan["multi_grid"] == [8192 * 4 // 128 + 4, 8, 1]
    # speculative drafts of 8 tokens x G=4 = 32 rows > 16: multi-token kernel, split over a long context
    plan, _ = _plan(cfg, T=8, B=1, MB=8192, max_q=8, max_kv=131072)
    assert plan["run_multi"] and plan["multi_grid"][2] > 1 and plan["run_merge"]
    assert plan["merge_grid"] == 8 * cfg.num_q_heads
    # G > 16 (MQA, 32 query heads on one KV head): the multi-token kernel serves decode too
    mqa = dataclasses.replace(cfg, pool=dataclasses.replace(cfg.pool, num_kv_heads=1))
    plan, _ = _plan(mqa, T=4, B=4, MB=64, max_q=1, max_kv=1024)
    assert not plan["run_decode"] and plan["run_multi"]
    # no workspace -> never split, whatever the shape
    plan, _ = _plan(cfg, T=1, B=1, MB=2048, max_q=1, max_kv=32768, ws=0)
    assert not plan["run_merge"] and plan["decode_grid"][2] == 1 and plan["workspace_bytes"] == 0
    # a window bounds the span, whatever the cache length
    windowed = dataclasses.replace(cfg, window=1000, attention_sinks=4)
    plan, _ = _plan(windowed, T=1, B=1, MB=8192, max_q=1, max_kv=131072)
    assert plan["max_span"] == 1000 + 4


@pytest.mark.parametrize("B, L, ctas_per_sm, chunks", [
    (16, 8192, 2, 2),     # 128 units: 2 chunks = 256 CTAs, one wave of 264 (5 chunks gave 2.42 waves)
    (1, 32768, 2, 32),    # 8 units: 32 chunks of 1024 = 256 CTAs, one wave
    (1, 131072, 2, 33),   # 33 chunks of 4032 = 264 CTAs, exactly one wave
    (64, 4096, 2, 1),     # 512 CTAs = 1.94 waves unsplit; 2 chunks would be 3.88 waves of half-size CTAs
    (64, 4096, 4, 1),     # 8-bit cache (4 CTAs/SM): one wave
    (256, 1024, 2, 1),
])
def test_decode_split_fills_whole_waves(B, L, ctas_per_sm, chunks):
    # The decode split minimizes waves x (chunk + per-CTA cost): a partly filled last wave costs a full one.
    cfg = _cfg()
    plan, _ = _plan(cfg, T=B, B=B, MB=L // 16, max_q=1, max_kv=L, dec=ctas_per_sm)
    assert plan["decode_grid"][2] == chunks
    ctas = B * cfg.pool.num_kv_heads * chunks
    slots = 132 * ctas_per_sm
    assert ctas / (-(-ctas // slots) * slots) > 0.95, "whole waves"
    if chunks > 1:
        assert plan["decode_chunk_len"] * (chunks - 1) < L <= plan["decode_chunk_len"] * chunks


# The decode kernel's occupancy per CTA width (2, 4, 8 warps) on an H200 for a 16-bit cache at D = 128 (53632,
# 103168 and 202240 bytes of shared memory per CTA), and on an sm_89 GPU (99 KB per block: only the 2-warp CTA fits).
H200_DECODE_16BIT_D128 = (4, 2, 1)
SM89_DECODE_16BIT_D128 = (4, 0, 0)


@pytest.mark.parametrize("B, L, warps, chunks", [
    (16, 8192, 8, 1),    # 128 units: 4 warps would split in 2 (+ the merge); 8 warps run one unsplit wave of 132
    (48, 4096, 8, 1),    # 384 units: 4 warps would split; 8 warps unsplit, 2.9 waves of 132
    (64, 4096, 2, 1),    # 512 units: 1.94 waves of 264 4-warp CTAs, > 1.5: 2 warps, unsplit (measured ~1 % faster)
    (56, 4096, 2, 1),    # 448 units: 1.7 waves: 2 warps (50 x 4K, 1.52 waves, splits at 4 warps: stays there)
    (50, 4096, 4, 3),
    (32, 4096, 4, 1),    # one unsplit wave of 4-warp CTAs
    (128, 2048, 2, 1),   # 3.88 waves of 4-warp CTAs: 2 warps, still unsplit (1.94 waves of 528)
    (256, 1024, 2, 1),
    (96, 2048, 4, 1),    # 2.9 waves, but 2 warps would split (5.8 waves of 528 unsplit)
    (1, 32768, 4, 32),   # 8 warps would split too: the default width
    (8, 8192, 4, 4),
])
def test_decode_width_follows_the_batch(B, L, warps, chunks):
    cfg = _cfg()
    plan, _ = _plan(cfg, T=B, B=B, MB=L // 16, max_q=1, max_kv=L, dec=H200_DECODE_16BIT_D128)
    assert (plan["decode_warps"], plan["decode_grid"]) == (warps, [B, 8, chunks])
    assert plan["run_merge"] == (chunks > 1)
    # the chunk count is the chosen width's own: the same as a plan offered that width alone
    alone = [n if w == warps else 0 for w, n in zip(A.DECODE_WIDTHS, H200_DECODE_16BIT_D128, strict=True)]
    assert _plan(cfg, T=B, B=B, MB=L // 16, max_q=1, max_kv=L, dec=alone)[0]["decode_grid"] == [B, 8, chunks]


def test_decode_width_without_the_default():
    cfg = _cfg()
    # sm_89 hosts only the 2-warp 16-bit CTA at D = 128: every batch runs it
    for B, L in ((1, 32768), (16, 8192), (64, 4096), (256, 1024)):
        plan, _ = _plan(cfg, T=B, B=B, MB=L // 16, max_q=1, max_kv=L, dec=SM89_DECODE_16BIT_D128)
        assert plan["decode_warps"] == 2, (B, L)
    # an 8-bit cache at D = 128 is compiled at 2 warps only: a single occupancy stands for that width
    fp8 = _cfg(cache_dtype=CacheDType.FP8_E4M3)
    assert A.kernel_shapes(A.IODType.BF16, CacheDType.FP8_E4M3, 128)["decode_threads"] == 64
    plan, _ = _plan(fp8, T=64, B=64, MB=256, max_q=1, max_kv=4096, dec=4)
    assert plan["decode_warps"] == 2 and plan["decode_grid"] == [64, 8, 1]
    # a single occupancy of a 16-bit cache is the 4-warp CTA's: the pre-width plans, unchanged
    plan, _ = _plan(cfg, T=16, B=16, MB=512, max_q=1, max_kv=8192, dec=2)
    assert plan["decode_warps"] == 4 and plan["decode_grid"] == [16, 8, 2]
    # no decode kernel: no width
    mqa = dataclasses.replace(cfg, pool=dataclasses.replace(cfg.pool, num_kv_heads=1))
    assert _plan(mqa, T=4, B=4, MB=64, max_q=1, max_kv=1024, dec=H200_DECODE_16BIT_D128)[0]["decode_warps"] == 0


@settings(max_examples=150, deadline=None)
@given(B=st.integers(1, 700), L=st.integers(1, 140000), sm=st.sampled_from([4, 16, 84, 108, 132]),
       occ=st.tuples(st.integers(0, 6), st.integers(0, 3), st.integers(0, 2)).filter(any))
def test_decode_width_is_offered_and_its_rule_holds(B, L, sm, occ):
    # Any facts, any decode batch: the plan runs a width the facts offer, with that width's own split, and leaves
    # the default (4 warps) only by the rule's two cases (attention_plan.cpp, chooseDecodeWidth).
    cfg = _cfg()
    MB = -(-L // 16)

    def plan_with(dec):
        return _plan(cfg, T=B, B=B, MB=MB, max_q=1, max_kv=L, sm=sm, dec=list(dec))[0]

    def alone(warps):
        return plan_with(n if w == warps else 0 for w, n in zip(A.DECODE_WIDTHS, occ, strict=True))

    plan = plan_with(occ)
    warps = plan["decode_warps"]
    assert occ[A.DECODE_WIDTHS.index(warps)] > 0
    assert plan["decode_grid"] == alone(warps)["decode_grid"]
    if occ[1] == 0:
        assert warps == (2 if occ[0] else 8), "without the default: the narrowest width offered"
        return
    four_splits = alone(4)["decode_grid"][2] > 1
    eight = occ[2] > 0 and four_splits and alone(8)["decode_grid"][2] == 1
    two = (occ[0] > 0 and not four_splits and 2 * B * cfg.pool.num_kv_heads > 3 * sm * occ[1]
           and alone(2)["decode_grid"][2] == 1)
    assert warps == (8 if eight else 2 if two else 4)


@pytest.mark.parametrize("dec, needle", [
    ((0, 0, 0), "decode_ctas_per_sm=0: expected > 0 at some width"),
    ((2, -1, 1), r"decode_ctas_per_sm=-1: expected >= 0 \(at 4 warps\)"),
])
def test_decode_occupancies_are_checked(dec, needle):
    cfg = _cfg()
    with pytest.raises(_lib.CapiError, match=needle):
        _plan(cfg, T=1, B=1, MB=64, max_q=1, max_kv=1024, dec=dec)
    with pytest.raises(ValueError, match=r"decode_ctas_per_sm=\[2, 2\]: expected one occupancy per width"):
        _plan(cfg, T=1, B=1, MB=64, max_q=1, max_kv=1024, dec=(2, 2))
    params = A.attention_params(cfg, io_dtype=A.IODType.BF16, num_tokens=1, num_seqs=1, max_blocks=64, max_q_len=1,
                                max_kv_len=1024)
    info = _structs.struct("PagedKVAttentionPlanInfo")()
    rc = A._capi().pagedkv_attention_plan(ctypes.byref(params), 132, None, 2, 0, ctypes.byref(info))
    with pytest.raises(_lib.CapiError, match="decode_ctas_per_sm=NULL: expected 3 occupancies"):
        _lib.check(rc, "pagedkv_attention_plan")


def _grid_chunks(span: int, n: int) -> int:
    """The chunks a grid holds when the plan cuts `span` tokens into n: lengths are whole 64-token tiles."""
    length = -(-(-(-span // n)) // 64) * 64
    return -(-span // length)


@pytest.mark.parametrize("B, L, n", [
    (16, 8192, 8),     # the one-wave 8-warp batch cut into 8: 1024 CTAs at the plan's own width
    (16, 8192, 3),     # 2731 -> 2752-token chunks: 3 in the grid
    (1, 32768, 128),   # 256-token chunks, the shortest the plan cuts
    (1, 32768, 1),     # the split batch forced whole: no merge
    (12, 8192, 11),    # the twelfth session's faster 2-warp plan at 12 x 8K
    (64, 4096, 60),    # 4096 / 60 -> 128-token chunks are below the 256-token floor: 16 chunks
])
def test_forced_decode_chunks(B, L, n):
    # PAGEDKV_DECODE_CHUNKS (PlanSettings::decodeChunks): the split asked for, at the width the plan picks anyway,
    # within the bounds the split model keeps (256-token chunks at least, 64-token multiples).
    cfg = _cfg()
    free, _ = _plan(cfg, T=B, B=B, MB=L // 16, max_q=1, max_kv=L, dec=H200_DECODE_16BIT_D128)
    plan, _ = _plan(cfg, T=B, B=B, MB=L // 16, max_q=1, max_kv=L, dec=H200_DECODE_16BIT_D128, chunks=n)
    expected = _grid_chunks(L, min(n, L // 256))
    assert plan["decode_warps"] == free["decode_warps"]
    assert plan["decode_grid"] == [B, 8, expected]
    assert plan["run_merge"] == (expected > 1)
    if expected > 1:
        assert plan["decode_chunk_len"] * (expected - 1) < L <= plan["decode_chunk_len"] * expected
        assert plan["partial_chunks"] == expected


def test_forced_decode_chunks_stay_within_the_workspace():
    # A workspace with room for 3 chunks of partial rows (besides the KV row maps' region, its tail) caps a forced
    # split of 32 at 3; none at all leaves the batch whole.
    cfg = _cfg()
    rows = 16 * cfg.num_q_heads
    ws = 3 * rows * (cfg.pool.head_dim + 1) * 4 + 128 * 1024
    plan, _ = _plan(cfg, T=16, B=16, MB=512, max_q=1, max_kv=8192, ws=ws, dec=2, chunks=32)
    assert plan["decode_grid"][2] == 3 and plan["workspace_bytes"] <= ws
    plan, _ = _plan(cfg, T=16, B=16, MB=512, max_q=1, max_kv=8192, ws=0, dec=2, chunks=32)
    assert plan["decode_grid"][2] == 1 and not plan["run_merge"]


@pytest.mark.parametrize("chunks", [-1, 1025])
def test_forced_decode_chunks_are_checked(chunks):
    expected = rf"decode_chunks={chunks}: expected in \[0, 1024\] \(0: the plan's split\)$"
    with pytest.raises(_lib.CapiError, match=expected):
        _plan(_cfg(), T=1, B=1, MB=64, max_q=1, max_kv=1024, chunks=chunks)


@pytest.mark.parametrize("seed", range(30))
def test_plan_workspace_fits_any_launch_within_the_bounds(seed):
    rng = np.random.default_rng(seed)
    cfg = _cfg(head_dim=int(rng.choice(capabilities().head_dims)))
    T_max, B_max = int(rng.integers(1, 9000)), 0
    B_max = int(rng.integers(1, T_max + 1))
    kv_max = int(rng.integers(1, 200000))
    ws = A.attention_workspace_bytes(T_max, B_max, cfg.num_q_heads, cfg.pool.head_dim, kv_max, cfg.pool.page_size)
    for _ in range(5):
        T = int(rng.integers(1, T_max + 1))
        B = int(rng.integers(1, min(B_max, T) + 1))
        plan, _ = _plan(cfg, T=T, B=B, MB=1, max_q=int(rng.integers(1, T + 1)), max_kv=int(rng.integers(0, kv_max + 1)),
                        ws=ws, sm=int(rng.integers(1, 200)), dec=int(rng.integers(1, 4)), multi=int(rng.integers(1, 3)))
        assert plan["workspace_bytes"] <= ws
        if plan["run_merge"]:
            assert plan["partial_chunks"] >= 2
            assert plan["workspace_bytes"] == plan["partial_chunks"] * T * cfg.num_q_heads * (cfg.pool.head_dim + 1) * 4


# ---------------------------------------------------------------------------------------------------------
# Schedule replay vs an independent dense visibility model


@dataclasses.dataclass(frozen=True)
class Case:
    """One step: sequences (past_len, q_len), geometry, window. Pages are shuffled; `holes` pages are -1."""

    seqs: tuple[tuple[int, int], ...]
    num_kv_heads: int
    group: int
    head_dim: int
    page_size: int
    window: int = 0
    sinks: int = 0
    cyclic_pages: int = 0  # ring length in pages (0: linear cache); cyclic sinks = `sinks`
    holes: int = 0
    sm_count: int = 132
    seed: int = 0

    @property
    def id(self) -> str:
        q = "+".join(f"{p}:{n}" for p, n in self.seqs[:4]) + ("..." if len(self.seqs) > 4 else "")
        return (f"G{self.group}xKVH{self.num_kv_heads}-D{self.head_dim}-P{self.page_size}-w{self.window}s{self.sinks}"
                f"-ring{self.cyclic_pages}-holes{self.holes}-sm{self.sm_count}-[{q}]")


def _build(case: Case):
    rng = np.random.default_rng(case.seed)
    pool = PoolConfig(num_kv_heads=case.num_kv_heads, head_dim=case.head_dim, page_size=case.page_size,
                      num_layers=1, layer_index=0, cache_dtype=CacheDType.FP16,
                      page_layout=PageLayout(case.seed % 2), ring_sink_tokens=case.sinks if case.cyclic_pages else 0,
                      cyclic_len=case.cyclic_pages * case.page_size)
    cfg = AttentionConfig(num_q_heads=case.num_kv_heads * case.group, pool=pool, window=case.window,
                          attention_sinks=case.sinks)
    layout = pool.layout()
    past = np.array([p for p, _ in case.seqs], np.int32)
    qlen = np.array([n for _, n in case.seqs], np.int32)
    pages = np.array([int(layout.pages_needed(p + n)) for p, n in case.seqs])
    mb = max(int(pages.max()), 1) + 1  # one spare column: past-the-end entries exist and hold -1
    total = int(pages.sum())
    perm = rng.permutation(total + 5)  # shuffled physical blocks, a few never used
    table = np.full((len(case.seqs), mb), -1, np.int32)
    k = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[k:k + n]
        k += n
    live = np.argwhere(table >= 0)
    if case.holes and len(live):
        for i in rng.choice(len(live), size=min(case.holes, len(live)), replace=False):
            table[tuple(live[i])] = -1
    meta = StepMetadata(table, np.concatenate([[0], np.cumsum(qlen)]).astype(np.int32), past)
    return cfg, meta, total + 5


def _expected_coverage(cfg: AttentionConfig, meta: StepMetadata, num_blocks: int, max_pos: int) -> np.ndarray:
    """[T, H, max_pos] 0/1: query row sees kv position (causal, window + sinks, page present)."""
    layout = cfg.pool.layout()
    T, H = meta.num_tokens, cfg.num_q_heads
    out = np.zeros((T, H, max_pos), np.int32)
    for b in range(meta.num_seqs):
        kv_len = int(meta.kv_lens[b])
        pos = np.arange(kv_len)
        present = layout.locate(meta.block_table[b], pos, num_blocks)[0] != -1
        for i in range(int(meta.q_lens[b])):
            q_pos = int(meta.past_lens[b]) + i
            vis = attends(q_pos, pos, cfg.window, cfg.attention_sinks) & present
            out[int(meta.cu_q_lens[b]) + i, :, :kv_len] = vis
    return out


def _cases() -> list[Case]:
    rng = np.random.default_rng(1234)
    cases = [
        Case(((0, 1),), 2, 4, 128, 16),                                   # first token
        Case(((15, 1), (16, 1), (17, 1), (31, 1)), 2, 4, 128, 16),        # page-1, page, page+1 lengths
        Case(((40, 1),) * 3 + ((0, 37), (100, 64), (7, 2)), 2, 4, 128, 16),  # mixed batch
        Case(((3000, 1),), 1, 4, 128, 16, sm_count=8),                    # one long decode, split
        Case(((2000, 4),), 1, 4, 64, 32, sm_count=4),                     # drafts of 4 (16 rows): decode, split
        Case(((1500, 9),), 1, 4, 128, 16, sm_count=4),                    # drafts of 9 (36 rows): multi, split
        Case(((0, 300), (200, 129)), 1, 1, 64, 16),                       # MHA prefill chunks
        Case(((500, 1), (10, 50)), 1, 32, 128, 64),                       # MQA: G = 32, multi serves decode
        Case(((600, 1), (300, 77)), 2, 8, 256, 16, sm_count=16),          # D = 256 tiles
        Case(((1000, 1), (900, 40)), 2, 2, 128, 24, window=128),          # non-power-of-two pages, window
        Case(((1000, 1), (900, 40)), 2, 2, 128, 16, window=100, sinks=5),  # window + sinks (linear)
        Case(((700, 1), (650, 20)), 1, 4, 128, 16, window=128, sinks=4, cyclic_pages=10),  # ring wraps, sinks
        Case(((700, 1), (650, 20)), 1, 4, 128, 16, window=128, sinks=20, cyclic_pages=10),  # sinks span a page
        Case(((400, 1), (380, 25), (0, 90)), 2, 4, 128, 16, holes=6),     # -1 pages inside the span
        Case(((900, 1), (850, 3)), 1, 4, 128, 16, window=64, holes=30),   # evicted pages below the window
        # head dims 32, 80, 96 (tiles of the D = 64 / 128 kernels' shapes): prefill chunk + decodes, split
        Case(((0, 70), (300, 1), (129, 2)), 2, 4, 32, 16, sm_count=16),
        Case(((2000, 1), (500, 33)), 2, 4, 80, 24, window=300, sinks=4, sm_count=8),
        Case(((700, 1), (650, 20)), 1, 3, 96, 16, window=128, sinks=4, cyclic_pages=10),
        Case(((3000, 1), (40, 200)), 1, 8, 96, 32, holes=4, sm_count=4),
    ]
    for i in range(25):
        n = int(rng.integers(1, 7))
        seqs = tuple((int(rng.integers(0, 1200)), int(rng.choice([1, 1, 2, 3, 5, 17, 40, 70]))) for _ in range(n))
        page = int(rng.choice([16, 24, 32, 64]))
        window = int(rng.choice([0, 0, 50, 300]))
        cyclic = int(rng.choice([0, 0, 40])) if window and window + 70 < 40 * page else 0
        cases.append(Case(seqs, int(rng.choice([1, 2])), int(rng.choice([1, 2, 4, 8, 16, 32])),
                          int(rng.choice(capabilities().head_dims)), page, window=window,
                          sinks=int(rng.choice([0, 3, 16])) if window else 0, cyclic_pages=cyclic,
                          holes=int(rng.choice([0, 0, 3])), sm_count=int(rng.choice([2, 16, 132])), seed=i))
    return cases


CASES = _cases()


@pytest.mark.parametrize("decode_ctas_per_sm", [2, H200_DECODE_16BIT_D128], ids=["one-width", "three-widths"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_schedule_counts_every_visible_pair_once_and_writes_every_row_once(case, decode_ctas_per_sm):
    cfg, meta, num_blocks = _build(case)
    max_pos = int(meta.kv_lens.max())
    res = A.schedule_check(cfg, meta, num_blocks, io_dtype=A.IODType.FP16, sm_count=case.sm_count, max_pos=max_pos,
                           decode_ctas_per_sm=decode_ctas_per_sm)
    expected = _expected_coverage(cfg, meta, num_blocks, max_pos)
    mismatch = np.argwhere(res["coverage"] != expected)
    assert mismatch.size == 0, (f"{len(mismatch)} (token, head, pos) mismatches, first {mismatch[:5].tolist()}: "
                                f"got {[int(res['coverage'][tuple(m)]) for m in mismatch[:5]]}")
    direct, partial, merged = res["direct_writes"], res["partial_writes"], res["merged_chunks"]
    assert np.all(res["poisoned"] == 0)
    assert np.all((direct == 1) ^ (partial > 0)), "every row: exactly one of a direct write or partials"
    assert np.all(direct <= 1)
    assert np.array_equal(partial, merged), "the merge combines exactly the chunks that were written"


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), chunks=st.integers(1, 80))
def test_schedule_with_forced_decode_chunks_covers_every_pair_once(seed, chunks):
    # Any forced decode split (PAGEDKV_DECODE_CHUNKS) keeps the kernels' contract: every visible pair once, every row
    # written once, the merge combining exactly the chunks written. Decode batches with drafts, windows and holes.
    rng = np.random.default_rng(seed)
    seqs = tuple((int(rng.integers(0, 3000)), int(rng.choice([1, 1, 2, 4]))) for _ in range(int(rng.integers(1, 5))))
    window = int(rng.choice([0, 0, 200]))
    case = Case(seqs, 1, int(rng.choice([1, 4, 8])), int(rng.choice(capabilities().head_dims)),
                int(rng.choice([16, 24, 64])), window=window, sinks=int(rng.choice([0, 4])) if window else 0,
                holes=int(rng.choice([0, 2])), sm_count=int(rng.choice([4, 132])), seed=seed % 1000)
    cfg, meta, num_blocks = _build(case)
    max_pos = max(int(meta.kv_lens.max()), 1)
    res = A.schedule_check(cfg, meta, num_blocks, io_dtype=A.IODType.FP16, sm_count=case.sm_count, max_pos=max_pos,
                           decode_ctas_per_sm=H200_DECODE_16BIT_D128, decode_chunks=chunks)
    assert np.array_equal(res["coverage"], _expected_coverage(cfg, meta, num_blocks, max_pos))
    assert np.all(res["poisoned"] == 0)
    assert np.all((res["direct_writes"] == 1) ^ (res["partial_writes"] > 0))
    assert np.array_equal(res["partial_writes"], res["merged_chunks"])


def test_schedule_splits_when_the_gpu_is_large():
    # The replay above is only meaningful if splits happen in it: make sure some cases do.
    case = Case(((3000, 1), (2500, 12)), 1, 4, 128, 16, sm_count=64)
    cfg, meta, num_blocks = _build(case)
    res = A.schedule_check(cfg, meta, num_blocks, sm_count=case.sm_count)
    assert res["partial_writes"].max() > 1 and res["merged_chunks"].max() > 1


def test_schedule_with_loose_plugin_bounds():
    # The TensorRT plugin only knows T and MB * page_size: bounds far above the real values stay correct.
    case = Case(((300, 1), (20, 33), (5, 1)), 2, 4, 128, 16, sm_count=32)
    cfg, meta, num_blocks = _build(case)
    max_pos = int(meta.kv_lens.max())
    res = A.schedule_check(cfg, meta, num_blocks, max_q_len=meta.num_tokens,
                           max_kv_len=meta.max_blocks * cfg.pool.page_size * 50, sm_count=32, max_pos=max_pos)
    assert np.array_equal(res["coverage"], _expected_coverage(cfg, meta, num_blocks, max_pos))
    assert np.all((res["direct_writes"] == 1) ^ (res["partial_writes"] > 0))


def test_schedule_of_a_decode_step_under_plugin_bounds():
    # A decode step (q_len 1, one sequence with nothing this step) under the plugin's bounds launches the multi-token
    # kernel too; none of its cells has work, so the Hopper kernel's CTAs may end at once (the replay checks that).
    case = Case(((300, 1), (20, 0), (77, 1), (5, 1), (0, 1), (64, 1), (129, 1)), 2, 4, 128, 16, sm_count=32)
    cfg, meta, num_blocks = _build(case)
    max_pos = int(meta.kv_lens.max())
    max_kv_len = meta.max_blocks * cfg.pool.page_size
    params = A.attention_params(cfg, io_dtype=A.IODType.FP16, num_tokens=meta.num_tokens, num_seqs=meta.num_seqs,
                                max_blocks=meta.max_blocks, max_q_len=meta.num_tokens, max_kv_len=max_kv_len)
    assert A.attention_plan(params, sm_count=32)["run_multi"]
    res = A.schedule_check(cfg, meta, num_blocks, max_q_len=meta.num_tokens, max_kv_len=max_kv_len, sm_count=32,
                           max_pos=max_pos)
    assert np.array_equal(res["coverage"], _expected_coverage(cfg, meta, num_blocks, max_pos))
    assert np.all((res["direct_writes"] == 1) ^ (res["partial_writes"] > 0)) and not res["poisoned"].any()


def test_schedule_with_too_small_kv_bound_still_covers_everything():
    # maxKVLen only sizes the split: the last chunk of the grid takes whatever remains of a longer span.
    case = Case(((2000, 1),), 1, 4, 128, 16, sm_count=64)
    cfg, meta, num_blocks = _build(case)
    res = A.schedule_check(cfg, meta, num_blocks, max_kv_len=600, sm_count=64, max_pos=2001)
    assert np.array_equal(res["coverage"], _expected_coverage(cfg, meta, num_blocks, 2001))
    assert np.array_equal(res["partial_writes"], res["merged_chunks"])


def test_wrong_max_q_len_poisons_instead_of_leaving_stale_rows():
    # maxQLen = 1 claims pure decode, so the multi-token kernel is not launched; the decode kernel then fills
    # the rows of the 5-token sequence with NaN (loud) rather than leaving whatever the buffer held.
    case = Case(((10, 1), (10, 5)), 1, 4, 128, 16)
    cfg, meta, num_blocks = _build(case)
    res = A.schedule_check(cfg, meta, num_blocks, max_q_len=1)
    assert np.all(res["poisoned"][1:] == 1) and np.all(res["poisoned"][0] == 0)
    assert np.all(res["direct_writes"][1:] == 0) and np.all(res["direct_writes"][0] == 1)
