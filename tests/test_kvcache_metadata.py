"""Step metadata against the layout contract's Python mapping, for random mixed batches (linear, released
window and cyclic groups); the device packing; a loose host-time guard for the 1 ms budget."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pagedkv.kvcache import KVCacheManager, PoolGroup, pool_descriptors
from pagedkv.kvcache.upload import ALIGN, pack_into, pack_layout, step_arrays
from pagedkv.layout import INVALID_BLOCK, KVLayout, PageLayout, length_from_pages
from pagedkv.step import POOL_DESC_ADDRESS, POOL_DESC_FIELDS, POOL_DESC_NUM_BLOCKS

GROUPS = [
    PoolGroup("full16", KVLayout(2, 2, 16, 8)),
    PoolGroup("full6", KVLayout(1, 1, 6, 4, PageLayout.NHD)),  # non-power-of-two page: divmod path
    PoolGroup("release", KVLayout(1, 1, 8, 4), window=20, attention_sinks=3),
    PoolGroup("ring", KVLayout(1, 1, 8, 4, ring_sink_tokens=5, cyclic_len=48), window=40, attention_sinks=5),
]


def _random_manager(rng, num_seqs):
    """A host-model manager whose sequences have random lengths, then a random mix of prefill chunks and
    decode tokens reserved for the next step."""
    mgr = KVCacheManager(GROUPS, 4096, storage="none")
    entries = []
    for s in range(num_seqs):
        mgr.add_sequence(s)
        L = int(rng.integers(0, 200))
        while mgr.length(s) < L:  # grow in steps the ring accepts (<= 48 - 40 + 1 = 9 tokens)
            n = min(9, L - mgr.length(s))
            mgr.reserve(s, n)
            mgr.commit(s, n)
        n = int(rng.choice([1, 1, 2, 5, 7]))  # + up to 2 extra reserved: <= 9
        mgr.reserve(s, n + int(rng.integers(0, 3)))  # sometimes reserve more than the step uses
        entries.append((s, n))
    order = rng.permutation(num_seqs)
    return mgr, [entries[i] for i in order]


@pytest.mark.parametrize("seed", range(6))
def test_step_arrays_follow_the_layout_contract(seed):
    rng = np.random.default_rng(seed)
    mgr, entries = _random_manager(rng, int(rng.integers(1, 12)))
    step = mgr.build_step(entries)
    mgr.validate_step(step)
    B = len(entries)
    # shared arrays, from the entries by plain loops
    q = [n for _, n in entries]
    past = [mgr.length(s) for s, _ in entries]
    assert step.q_lens.tolist() == q and step.past_lens.tolist() == past
    assert step.cu_q_lens.tolist() == [0] + list(np.cumsum(q)) and step.kv_lens.tolist() == [p + n for p, n in zip(past, q)]
    assert step.token_seq.tolist() == [b for b in range(B) for _ in range(q[b])]
    assert step.positions.tolist() == [past[b] + i for b in range(B) for i in range(q[b])]
    assert step.position_ids is None and step.meta(0).position_ids is None
    for g, spec in enumerate(mgr.groups):
        lay, gs = spec.layout, step.groups[g]
        assert gs.block_table.dtype == np.int32 and gs.block_table.shape == (B, int(gs.num_pages.max()))
        for b, (s, n) in enumerate(entries):
            kv = past[b] + n
            pages = int(lay.pages_needed(kv))
            assert gs.num_pages[b] == pages
            assert int(length_from_pages(pages, gs.last_page_lens[b], lay.page_size)) == int(lay.slots_used(kv))
            row = mgr.block_row(s, g)
            assert gs.block_table[b, :pages].tolist() == row[:pages].tolist()
            assert np.all(gs.block_table[b, pages:] == INVALID_BLOCK)
            assert gs.kv_indices[gs.kv_indptr[b]:gs.kv_indptr[b + 1]].tolist() == row[:pages].tolist()
            # every position the step writes, located through the step's table, is the manager's block
            pos = np.arange(past[b], kv)
            block, offset, _ = lay.locate(gs.block_table[b], pos, mgr.num_blocks[g])
            page, off = lay.slot_to_page(lay.token_slot(pos))
            assert np.all(block >= 0) and block.tolist() == row[page].tolist() and offset.tolist() == off.tolist()
        assert np.all(np.diff(gs.kv_indptr) >= 0) and gs.kv_indptr[-1] == gs.kv_indices.size
    assert np.all(step.groups[0].kv_indices >= 0)  # full attention: no holes


def test_empty_step_and_uniform_decode_fast_path():
    mgr = KVCacheManager(GROUPS[:1], 64, storage="none")
    empty = mgr.build_step([])
    assert empty.num_seqs == 0 and empty.num_tokens == 0 and empty.groups[0].block_table.shape == (0, 0)
    for s in range(3):
        mgr.add_sequence(s)
        mgr.reserve(s, 33)
        mgr.commit(s, 32)
    step = mgr.build_step(range(3))  # all 33 tokens -> 3 pages each: the unmasked path
    assert step.groups[0].kv_indices.tolist() == step.groups[0].block_table.reshape(-1).tolist()
    mgr.validate_step(step)


def test_pool_descriptors():
    desc = pool_descriptors([0x7F00_0000_1000, 2 ** 63 + 4096], [10, 20])
    assert desc.shape == (2, POOL_DESC_FIELDS) and desc.dtype == np.int64
    assert desc[0, POOL_DESC_ADDRESS] == 0x7F00_0000_1000 and desc[:, POOL_DESC_NUM_BLOCKS].tolist() == [10, 20]
    assert int(np.uint64(desc[1, POOL_DESC_ADDRESS].view(np.uint64))) == 2 ** 63 + 4096  # same 64 bits
    with pytest.raises(ValueError, match="2 addresses for 1 pools"):
        pool_descriptors([1, 2], [3])


def test_packing_for_the_upload_round_trips():
    rng = np.random.default_rng(3)
    mgr, entries = _random_manager(rng, 7)
    step = mgr.build_step(entries, position_ids=np.arange(sum(n for _, n in entries)) * 3)
    arrays = step_arrays(step)
    offsets, size = pack_layout(arrays)
    assert all(off % ALIGN == 0 for off in offsets.values()) and size % ALIGN == 0
    spans = sorted((offsets[name], offsets[name] + arr.nbytes) for name, arr in arrays)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
    buf = np.full(size, 0xAB, dtype=np.uint8)
    pack_into(buf, arrays, offsets)
    for name, arr in arrays:
        back = buf[offsets[name]:offsets[name] + arr.nbytes].view(arr.dtype).reshape(arr.shape)
        np.testing.assert_array_equal(back, arr, err_msg=name)
    assert {"cu_q_lens", "past_lens", "position_ids", "block_table[3]", "kv_indices[2]"} <= set(offsets)


def test_decode_step_host_time_guard():
    """The 1 ms budget (256 sequences x 4096 cached tokens, page 16, one decode token each) is measured by
    benchmarks/bench_metadata.py; here only a loose guard (20 ms, shared CI cores) against regressions such as
    a per-token Python loop."""
    mgr = KVCacheManager([PoolGroup("g", KVLayout(32, 8, 16, 128))], 256 * 257, storage="none")
    for s in range(256):
        mgr.add_sequence(s)
        mgr.reserve(s, 4096)
        mgr.commit(s, 4096)
        mgr.reserve(s, 1)
    ids = list(range(256))
    times = []
    for _ in range(15):
        t = time.perf_counter()
        step = mgr.build_step(ids)
        times.append(time.perf_counter() - t)
    assert step.num_tokens == 256 and step.groups[0].kv_indices.size == 256 * 257
    assert float(np.median(times)) < 0.020, f"median build_step {np.median(times) * 1e3:.2f} ms"
