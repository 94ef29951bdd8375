"""The fused QKV write kernel's walk over (token, head-row pass) pairs, replayed on the CPU (no GPU needed).

``pagedkv_qkv_write_schedule_check`` runs the kernel's own grid sizing (``qkvWriteGrid``), group and walk
functions (``qkvWriteGroup``, ``qkvWriteWalk``, ``QKVWriteCursor::advance``) and its chunked token records loop
(qkv_write_params.cuh, qkv_write_kernel.cuh) for every warp of the grid. The contract: every pair is visited
exactly once whatever the group size W (1, 2, 4, 8, or the launcher's choice), the head shape, the step size and
the number of resident warps, and every visited pair's token is in the chunk of records its group has set up.
The GPU tests (tests/gpu/test_write_kernel.py) then run the kernel itself with each W.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import _lib
from pagedkv.config import PoolConfig, WriteConfig
from pagedkv.kernels import write

H200_RESIDENT_WARPS = 132 * 24  # 132 SMs x 3 CTAs x 8 warps


def cfg_of(heads: int, kv_heads: int, head_dim: int) -> WriteConfig:
    return WriteConfig(num_q_heads=heads, pool=PoolConfig(num_kv_heads=kv_heads, head_dim=head_dim, page_size=16,
                                                           num_layers=1, layer_index=0))


# (H, KVH, D): P = ceil((H + 2 KVH) / floor(32 / (D / 8))) passes per token: 24 (the benchmark's Llama-like
# shape), 40 (64/8 heads), 16 (D = 80: 3 rows a pass), 24 on 24 lanes (D = 96), 6 (D = 32: 8 rows a pass),
# 5 (Qwen-0.5B-like 14/2 heads at D = 64: a step of 8 pairs crosses two tokens), 1 (3 rows of D = 32 in one
# pass: every step of a group crosses tokens), 3 (D = 256: one row a pass).
SHAPES = [(32, 8, 128), (64, 8, 128), (32, 8, 80), (32, 8, 96), (32, 8, 32), (14, 2, 64), (1, 1, 32), (1, 1, 256)]


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES, ids=[f"H{h}-KVH{k}-D{d}" for h, k, d in SHAPES])
@pytest.mark.parametrize("tokens", [1, 3, 64, 256, 801, 2048, 16384])
@pytest.mark.parametrize("group_warps", [0, *write.GROUP_WARPS])
def test_every_pair_is_visited_exactly_once(heads, kv_heads, head_dim, tokens, group_warps):
    visits, walk = write.schedule_check(cfg_of(heads, kv_heads, head_dim), tokens, group_warps=group_warps,
                                        resident_warps=H200_RESIDENT_WARPS)
    assert visits.shape[0] == tokens
    np.testing.assert_array_equal(visits, 1)
    assert walk["pairs"] == visits.size
    assert walk["warps"] <= H200_RESIDENT_WARPS  # one wave


@settings(max_examples=60, deadline=None)
@given(shape=st.sampled_from(SHAPES), tokens=st.integers(1, 40_000), group_warps=st.sampled_from([0, 1, 2, 4, 8]),
       resident_ctas=st.integers(1, 600))
def test_any_step_any_grid_visits_every_pair_once(shape, tokens, group_warps, resident_ctas):
    visits, walk = write.schedule_check(cfg_of(*shape), tokens, group_warps=group_warps,
                                        resident_warps=8 * resident_ctas)
    np.testing.assert_array_equal(visits, 1)
    assert walk["pairs"] == visits.size


def test_launcher_picks_warp_ranges_for_decode_and_cta_groups_for_prefill():
    cfg = cfg_of(32, 8, 128)
    for tokens, expected in [(1, 1), (64, 1), (256, 1), (792, 1), (793, 8), (16384, 8)]:
        _, walk = write.schedule_check(cfg, tokens, resident_warps=H200_RESIDENT_WARPS)
        assert walk["group_warps"] == expected, (tokens, walk)
    # decode: every warp has passes of one token only (a single token entry each), as in rounds 2-3
    _, walk = write.schedule_check(cfg, 256, resident_warps=H200_RESIDENT_WARPS)
    assert walk["token_entries"] == walk["warps"] == 256 * 12


def test_cta_groups_set_up_tokens_in_chunks_of_64():
    """16K tokens over 396 CTAs: windows of ~42 tokens, one chunk of records each; 64K tokens: windows of ~166,
    three chunks each (each warp enters every token of its CTA's window: 8 entries per token plus the edges)."""
    cfg = cfg_of(32, 8, 128)
    for tokens, chunks_per_cta in [(16384, 1), (65536, 3)]:
        visits, walk = write.schedule_check(cfg, tokens, group_warps=8, resident_warps=H200_RESIDENT_WARPS)
        np.testing.assert_array_equal(visits, 1)
        assert walk["record_chunks"] == 396 * chunks_per_cta, walk
        assert 8 * tokens <= walk["token_entries"] <= 8 * tokens + 8 * 396, walk
    # groups of one warp: a warp's ~5 tokens fit one chunk of 8 records; at 64K (~21 tokens) three chunks
    _, walk = write.schedule_check(cfg, 65536, group_warps=1, resident_warps=H200_RESIDENT_WARPS)
    assert walk["record_chunks"] == 3168 * 3, walk


@pytest.mark.parametrize("group_warps", [-1, 3, 16])
def test_bad_group_size_is_rejected_naming_it(group_warps):
    with pytest.raises(_lib.CapiError, match=f"group_warps={group_warps}: expected 0 \\(auto\\), 1, 2, 4 or 8"):
        write.schedule_check(cfg_of(32, 8, 128), 100, group_warps=group_warps)
    meta = write.StepPointers(1 << 16, 1 << 16, 1 << 16, 1 << 16, num_seqs=1, num_tokens=1, max_blocks=1)
    params = write.write_params(cfg_of(32, 8, 128), write.IODType.BF16, qkv=1 << 16, q_out=1 << 16, status=1 << 16,
                                meta=meta)
    with pytest.raises(_lib.CapiError, match=f"group_warps={group_warps}"):  # before any CUDA call
        write.launch(params, group_warps=group_warps)


def test_bad_resident_warps_is_rejected():
    with pytest.raises(_lib.CapiError, match="resident_warps=12: expected a positive multiple of 8"):
        write.schedule_check(cfg_of(32, 8, 128), 100, resident_warps=12)
