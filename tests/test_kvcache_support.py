"""Helpers shared by the KV-manager tests (imported as ``test_kvcache_support``), and tests of the helpers.

The helpers play the kernels' part on a numpy pool: ``write_step`` writes each new token's K and V where the
contract's mapping (``KVLayout.locate`` + ``elem_offset``) puts it, using the step's block tables; values
encode (token, layer, head, dim), so a read that lands on the wrong token, layer or head is caught.
``read_positions`` reads them back the same way. ``expected_live_positions`` is the tests' own statement of
which positions a window keeps (written independently of the manager's ``sequences.live_positions``).
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.kvcache import KVCacheManager, PoolGroup, Tier
from pagedkv.layout import INVALID_BLOCK, KVLayout, PageLayout, attends

MAX_TOKEN = 60  # token ids in [1, MAX_TOKEN]: every encoded value stays an exact fp16 integer (< 2048)

# The random tests' pool configurations (test_kvcache_property, test_kvcache_native):
# name -> (groups, primary blocks, host blocks, prefix reuse)
CONFIGS = {
    # two full-attention groups with different page sizes and layouts: prefix reuse must align them
    "prefix": ([PoolGroup("p4", KVLayout(2, 1, 4, 2)),
                PoolGroup("p8", KVLayout(1, 2, 8, 1, PageLayout.NHD))], [22, 12], [10, 6], True),
    # full group + released sliding window (page 3: the divmod path) with sinks
    "release": ([PoolGroup("full", KVLayout(1, 1, 4, 2)),
                 PoolGroup("win", KVLayout(2, 1, 3, 1, PageLayout.NHD), window=5, attention_sinks=2)],
                [20, 24], [10, 10], False),
    # full group + cyclic ring with sinks and a bubble: sinks 2, bubble 2, ring 8 -> 3 pages
    "cyclic": ([PoolGroup("full", KVLayout(1, 2, 4, 1, PageLayout.NHD)),
                PoolGroup("ring", KVLayout(1, 1, 4, 2, ring_sink_tokens=2, cyclic_len=8), window=5,
                              attention_sinks=2)], [20, 14], [8, 6], False),
}


def element_offsets(layout: KVLayout, block, offset) -> np.ndarray:
    """Flat element offsets [n, 2, L, KVH, D] of the K and V rows of tokens at (block, offset)."""
    block = np.asarray(block, dtype=np.int64)[:, None, None, None]
    offset = np.asarray(offset, dtype=np.int64)[:, None, None, None]
    kv = np.arange(2)[None, :, None, None]
    layer = np.arange(layout.num_layers)[None, None, :, None]
    head = np.arange(layout.num_kv_heads)[None, None, None, :]
    base = layout.elem_offset(block, layer, kv, head, offset)
    return base[..., None] + np.arange(layout.head_dim)


def encode(layout: KVLayout, tokens) -> np.ndarray:
    """Value of each element [n, 2, L, KVH, D]: unique per (token, layer, head, dim); K positive, V negative."""
    tokens = np.asarray(tokens, dtype=np.int64)[:, None, None, None]
    L, H, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
    idx = (np.arange(L)[:, None, None] * H + np.arange(H)[None, :, None]) * D + np.arange(D)[None, None, :]
    value = tokens * (L * H * D) + idx[None]
    assert value.max(initial=0) < 2048, "encoding exceeds exact fp16 integers"
    return np.stack([value, -value], axis=1)


def write_step(mgr: KVCacheManager, step, token_values: dict) -> None:
    """Write the step's new tokens into the manager's numpy pools, as the write kernel would.

    ``token_values[seq_id]``: token ids of the seq's new tokens in this step. Every token must have a valid
    page (asserted); tokens go where ``KVLayout.locate`` puts them.
    """
    for g, gs in enumerate(step.groups):
        lay = mgr.groups[g].layout
        flat = mgr.pool(g).reshape(-1)
        for b, seq_id in enumerate(step.seq_ids):
            lo, hi = int(step.cu_q_lens[b]), int(step.cu_q_lens[b + 1])
            pos = step.positions[lo:hi]
            block, offset, raw = lay.locate(gs.meta.block_table[b], pos, mgr.num_blocks[g])
            assert np.all(block != INVALID_BLOCK), f"seq {seq_id} group {g}: token without page, entries {raw}"
            toks = np.asarray(token_values[seq_id])
            assert toks.shape == (hi - lo,)
            flat[element_offsets(lay, block, offset)] = encode(lay, toks)


def read_positions(mgr: KVCacheManager, seq_id, group: int, positions) -> np.ndarray:
    """K and V values [n, 2, L, KVH, D] stored for ``positions`` of a sequence, through its block list;
    asserts every position has a valid page."""
    lay = mgr.groups[group].layout
    row = mgr.block_row(seq_id, group)
    block, offset, raw = lay.locate(row, positions, mgr.num_blocks[group])
    bad = np.flatnonzero(block == INVALID_BLOCK)
    assert bad.size == 0, f"seq {seq_id} group {group}: live position {positions[bad[0]]} has no page ({raw[bad[0]]})"
    return mgr.pool(group).reshape(-1)[element_offsets(lay, block, offset)].astype(np.float64)


def expected_live_positions(spec: PoolGroup, length: int) -> np.ndarray:
    """Positions a future query may still read: all (full attention), the sinks plus the last window
    (released window), the sinks plus the last ``cyclic_len`` (ring)."""
    keep = np.zeros(length, dtype=bool)
    if spec.window <= 0:
        keep[:] = True
    else:
        keep[:min(spec.attention_sinks, length)] = True
        span = spec.layout.cyclic_len if spec.layout.cyclic_len else spec.window - 1
        keep[max(0, length - span):] = True
    return np.flatnonzero(keep)


def check_contents(mgr: KVCacheManager, seq_id, tokens) -> None:
    """Every live position of ``seq_id`` holds the encoded value of ``tokens[pos]`` in every group."""
    for g, spec in enumerate(mgr.groups):
        pos = expected_live_positions(spec, len(tokens))
        if pos.size == 0:
            continue
        got = read_positions(mgr, seq_id, g, pos)
        want = encode(spec.layout, np.asarray(tokens, dtype=np.int64)[pos])
        if not np.array_equal(got, want):  # (np.testing is slow in hot loops: only for the message)
            np.testing.assert_array_equal(got, want, err_msg=f"K/V of seq {seq_id} group {g}, positions {pos}")


def check_step_reads(mgr: KVCacheManager, step, tokens_after: dict) -> None:
    """After a step's writes (before its commit): every position some query of the step attends to
    (``layout.attends`` with the group's window and sinks) reads back its token. This is what the attention
    kernel needs; for a ring it fails when the step overwrote a slot its first query still sees."""
    for g, spec in enumerate(mgr.groups):
        for b, seq_id in enumerate(step.seq_ids):
            p0, n = int(step.past_lens[b]), int(step.q_lens[b])
            q = np.arange(p0, p0 + n)[:, None]
            kv = np.arange(p0 + n)[None, :]
            seen = np.flatnonzero(attends(q, kv, spec.window, spec.attention_sinks).any(axis=0))
            got = read_positions(mgr, seq_id, g, seen)
            want = encode(spec.layout, np.asarray(tokens_after[seq_id], dtype=np.int64)[seen])
            if not np.array_equal(got, want):
                np.testing.assert_array_equal(got, want, err_msg=f"seq {seq_id} group {spec.name}: a position the "
                                              f"step's queries attend to was overwritten or lost")


def snapshot(mgr: KVCacheManager) -> tuple:
    """Everything the manager's bookkeeping holds (compared around operations that must change nothing)."""
    seqs = tuple(sorted(
        ((repr(s), st.row, st.tokens_known, st.token_gap, tuple(map(tuple, st.hashes)), tuple(st.released_hi),
          repr(st.swapped)) for s, st in mgr._seqs.items())))
    return (tuple(t.tobytes() for t in mgr._tables), tuple(n.tobytes() for n in mgr._npages),
            mgr._length.tobytes(), mgr._reserved.tobytes(), tuple(a.snapshot() for a in mgr.allocators),
            tuple(a.snapshot() for a in mgr.host_allocators),
            tuple(p.snapshot() for p in mgr.prefix) if mgr.prefix else None, len(mgr.copy_log), seqs,
            tuple(bytes(p.view(np.uint8)) for p in mgr.storage.tiers[Tier.PRIMARY]) if mgr.storage_kind == "numpy"
            else None)


# ---- tests of the helpers -------------------------------------------------------------------------------
@pytest.mark.parametrize("page_layout", [PageLayout.HND, PageLayout.NHD])
def test_write_step_touches_exactly_the_located_slots(page_layout):
    spec = PoolGroup("g", KVLayout(2, 2, 4, 3, page_layout))
    mgr = KVCacheManager([spec], 6, storage="numpy")
    mgr.add_sequence("a")
    mgr.reserve("a", 6)
    step = mgr.build_step(["a"])
    before = mgr.pool(0).copy()
    write_step(mgr, step, {"a": np.arange(1, 7)})
    pool = mgr.pool(0)
    changed = ~(np.isnan(pool.astype(np.float64)) & np.isnan(before.astype(np.float64)))
    row = mgr.block_row("a")
    # independent formulation with the 6-D shape: positions 0..5 -> pages 0, 1 at offsets p % 4
    expect = np.zeros_like(changed)
    for p in range(6):
        b, off = row[p // 4], p % 4
        if page_layout == PageLayout.HND:
            expect[b, :, :, :, off, :] = True
            np.testing.assert_array_equal(pool[b, :, :, :, off, :].transpose(1, 0, 2, 3).astype(np.int64),
                                          encode(spec.layout, [p + 1])[0])
        else:
            expect[b, :, :, off, :, :] = True
            np.testing.assert_array_equal(pool[b, :, :, off, :, :].transpose(1, 0, 2, 3).astype(np.int64),
                                          encode(spec.layout, [p + 1])[0])
    np.testing.assert_array_equal(changed, expect)
    check_contents(mgr, "a", list(range(1, 7)))  # not committed yet, but the slots hold them


def test_expected_live_positions_by_mode():
    full = PoolGroup("f", KVLayout(1, 1, 4, 1))
    release = PoolGroup("r", KVLayout(1, 1, 4, 1), window=5, attention_sinks=2)
    ring = PoolGroup("c", KVLayout(1, 1, 4, 1, ring_sink_tokens=2, cyclic_len=8), window=5, attention_sinks=2)
    assert expected_live_positions(full, 5).tolist() == [0, 1, 2, 3, 4]
    assert expected_live_positions(release, 12).tolist() == [0, 1, 8, 9, 10, 11]
    assert expected_live_positions(ring, 14).tolist() == [0, 1, 6, 7, 8, 9, 10, 11, 12, 13]
    assert expected_live_positions(ring, 3).tolist() == [0, 1, 2]
