"""KV manager operations on numpy pools (CPU): sequences, chunked prefill, fork and copy-on-write, prefix
reuse, released and cyclic windows, offload/reload, errors. Contents are checked through the block tables
with the helpers of ``test_kvcache_support``."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.kvcache import (BlockCopy, KVCacheExhaustedError, KVCacheManager, PoolGroup, Tier, apply_copies)
from pagedkv.layout import INVALID_BLOCK, KVLayout, PageLayout

from test_kvcache_support import check_contents, snapshot, write_step


def run(mgr, entries):
    """Reserve, build, write, commit one step. ``entries``: [(seq_id, token ids)]."""
    for sid, toks in entries:
        mgr.reserve(sid, len(toks))
    step = mgr.build_step([(sid, len(toks)) for sid, toks in entries])
    mgr.validate_step(step)
    write_step(mgr, step, dict(entries))
    for sid, toks in entries:
        mgr.commit(sid, len(toks), toks)
    return step


FULL = PoolGroup("full", KVLayout(2, 2, 4, 3))


def test_sequence_lifecycle_and_chunked_prefill_past_lengths():
    mgr = KVCacheManager([FULL], 16, storage="numpy", debug_validate=True)
    prompt = list(range(1, 12))  # 11 tokens, chunks of 4: past lengths 0, 4, 8
    mgr.add_sequence("a", prompt)
    pasts = []
    while mgr.prefill_remaining("a"):
        n = min(4, mgr.prefill_remaining("a"))
        L = mgr.length("a")
        step = run(mgr, [("a", prompt[L:L + n])])
        pasts.append(int(step.past_lens[0]))
    assert pasts == [0, 4, 8] and mgr.length("a") == 11 and mgr.num_pages("a") == 3
    check_contents(mgr, "a", prompt)
    run(mgr, [("a", [50])])  # decode: token 11 lands at offset 3 of page 2
    check_contents(mgr, "a", prompt + [50])
    assert mgr.num_free() == 13
    mgr.free("a")
    assert mgr.num_free() == 16 and "a" not in mgr


def test_errors_name_the_sequence_and_values():
    mgr = KVCacheManager([FULL], 4, storage="none")
    mgr.add_sequence(1)
    with pytest.raises(ValueError, match="sequence 1 exists already"):
        mgr.add_sequence(1)
    with pytest.raises(KeyError, match="sequence 2 is not in the KV manager"):
        mgr.reserve(2, 1)
    with pytest.raises(ValueError, match=r"num_tokens must be >= 0, got -1 \(sequence 1\)"):
        mgr.reserve(1, -1)
    mgr.reserve(1, 3)
    with pytest.raises(ValueError, match=r"sequence 1 has 3 reserved slot\(s\), cannot commit 4"):
        mgr.commit(1, 4)
    with pytest.raises(ValueError, match="token_ids has 1 entries for 2 tokens"):
        mgr.commit(1, 2, [5])
    with pytest.raises(ValueError, match="token_ids of sequence 1 must fit int32"):
        mgr.commit(1, 1, [2 ** 31])  # not wrapped into a negative id
    assert mgr.state(1).known_tokens().size == 0
    free_rows = len(mgr._free_rows)
    with pytest.raises(ValueError, match="prompt_tokens: token ids must fit int32"):
        mgr.add_sequence(3, [1, -2 ** 31 - 1])
    assert len(mgr._free_rows) == free_rows and 3 not in mgr  # the refused sequence took no table row
    with pytest.raises(ValueError, match=r"sequence 1 has 3 reserved slot\(s\) for 5 new token"):
        mgr.build_step([(1, 5)])
    with pytest.raises(ValueError, match="appears twice"):
        mgr.build_step([1, 1])
    with pytest.raises(ValueError, match="fork: sequence 1 has 3 reserved"):
        mgr.fork(1, 2)
    with pytest.raises(RuntimeError, match="kv_pools: needs device pools"):
        mgr.kv_pools()
    with pytest.raises(ValueError, match="storage: expected one of"):
        KVCacheManager([FULL], 4, storage="gpu")
    with pytest.raises(ValueError, match="names must be unique"):
        KVCacheManager([FULL, FULL], 4)
    with pytest.raises(ValueError, match=r"num_blocks: expected one value per pool group \(2\), got 3"):
        KVCacheManager([FULL, PoolGroup("b", KVLayout(1, 1, 4, 1))], [1, 2, 3])


def test_exhaustion_is_all_or_nothing_across_groups():
    small = PoolGroup("small", KVLayout(1, 1, 2, 1))
    mgr = KVCacheManager([FULL, small], [8, 3], storage="numpy")
    mgr.add_sequence("a")
    before = snapshot(mgr)
    with pytest.raises(KVCacheExhaustedError, match="pool group 'small'") as e:
        mgr.reserve("a", 7)  # 2 pages of 4 fit 'full', 4 pages of 2 do not fit 'small'
    assert (e.value.needed, e.value.free, e.value.seq, e.value.tier) == (4, 3, "a", "primary")
    assert snapshot(mgr) == before
    mgr.reserve("a", 6)
    assert mgr.num_free(0) == 6 and mgr.num_free(1) == 0


def test_fork_shares_blocks_and_copy_on_write_copies_only_committed_tokens():
    mgr = KVCacheManager([FULL], 12, storage="numpy", debug_validate=True)
    mgr.add_sequence("p", list(range(1, 7)))
    run(mgr, [("p", list(range(1, 7)))])  # 6 tokens: page 0 full, page 1 holds 2
    mgr.drain_copies()
    mirror = [mgr.pool(0).copy()]
    mgr.fork("p", "c")
    assert mgr.block_row("c").tolist() == mgr.block_row("p").tolist()
    assert [mgr.allocators[0].refcount(int(b)) for b in mgr.block_row("p")] == [2, 2]
    run(mgr, [("c", [40])])  # the child writes first: it gets the private copy of page 1
    copies = mgr.drain_copies()
    [cow] = copies
    assert (cow.src_block, cow.num_tokens) == (mgr.block_row("p")[1], 2) and cow.dst_block == mgr.block_row("c")[1]
    assert mgr.block_row("c")[0] == mgr.block_row("p")[0]  # the full page stays shared
    run(mgr, [("p", [41])])  # the parent is now the only holder of its page 1: no copy
    assert mgr.drain_copies() == []
    check_contents(mgr, "p", list(range(1, 7)) + [41])
    check_contents(mgr, "c", list(range(1, 7)) + [40])
    # the copy log replayed on a host mirror reproduces the copy (the host model stays exact)
    apply_copies(mgr.groups, copies, mirror)
    c1 = mgr.block_row("c")[1]
    np.testing.assert_array_equal(mirror[0][c1, :, :, :, :2].view(np.uint16),
                                  mgr.pool(0)[c1, :, :, :, :2].view(np.uint16))
    mgr.free("p")
    mgr.free("c")
    assert mgr.num_free() == 12


def test_prefix_reuse_hits_caps_and_copies_on_write():
    mgr = KVCacheManager([FULL], 16, storage="numpy", enable_prefix_reuse=True, debug_validate=True)
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15]  # 9 tokens: pages [7..10] [11..14] full, [15] partial
    assert mgr.add_sequence("a", prompt) == 0
    run(mgr, [("a", prompt)])
    # same first 8 tokens + another tail: both full pages are reused, the tail is computed
    assert mgr.add_sequence("b", prompt[:8] + [30, 31]) == 8
    assert mgr.block_row("b").tolist() == mgr.block_row("a")[:2].tolist()
    check_contents(mgr, "b", prompt[:8])
    run(mgr, [("b", [30, 31])])
    check_contents(mgr, "b", prompt[:8] + [30, 31])
    # exactly the 8 cached tokens as prompt: never all of it, the last token is recomputed, and it lands in
    # a shared page -> copy-on-write of its 3 committed tokens
    assert mgr.add_sequence("c", prompt[:8]) == 7
    mgr.drain_copies()
    run(mgr, [("c", prompt[7:8])])
    [cow] = mgr.drain_copies()
    assert cow.num_tokens == 3 and cow.src_block == mgr.block_row("a")[1]
    check_contents(mgr, "c", prompt[:8])
    check_contents(mgr, "a", prompt)
    # another salt (e.g. another adapter) never matches
    assert mgr.add_sequence("d", prompt, salt=b"lora-2") == 0


def test_prefix_blocks_survive_their_holders_until_evicted():
    mgr = KVCacheManager([FULL], 6, storage="numpy", enable_prefix_reuse=True, debug_validate=True)
    prompt = list(range(1, 10))
    mgr.add_sequence("a", prompt)
    run(mgr, [("a", prompt)])
    mgr.free("a")
    assert mgr.num_free() == 6  # cached blocks count as free
    assert mgr.add_sequence("b", prompt) == 8  # ... and are still reusable
    check_contents(mgr, "b", prompt[:8])
    mgr.free("b")
    mgr.add_sequence("x", [50] * 24)  # 6 pages: every free block is handed out, cached ones evicted
    run(mgr, [("x", [50] * 24)])
    mgr.free("x")
    assert mgr.add_sequence("c", prompt) == 0


def test_prefix_reuse_aligns_groups_with_different_page_sizes():
    g4, g8 = PoolGroup("p4", KVLayout(1, 1, 4, 2)), PoolGroup("p8", KVLayout(1, 2, 8, 1, PageLayout.NHD))
    mgr = KVCacheManager([g4, g8], [16, 8], storage="numpy", enable_prefix_reuse=True, debug_validate=True)
    prompt = list(range(1, 15))  # 14 tokens: p4 caches 3 full pages (12), p8 one (8)
    mgr.add_sequence("a", prompt)
    run(mgr, [("a", prompt)])
    assert mgr.add_sequence("b", prompt + [20]) == 8  # the common prefix: 8 tokens
    assert mgr.num_pages("b", 0) == 2 and mgr.num_pages("b", 1) == 1
    run(mgr, [("b", prompt[8:] + [20])])
    check_contents(mgr, "b", prompt + [20])
    with pytest.raises(ValueError, match=r"enable_prefix_reuse: pool group\(s\) \['w'\] have an attention window"):
        KVCacheManager([g4, PoolGroup("w", KVLayout(1, 1, 4, 1), window=8)], 4, enable_prefix_reuse=True)


def test_released_window_frees_pages_and_keeps_sinks():
    win = PoolGroup("win", KVLayout(1, 1, 4, 2), window=6, attention_sinks=2)
    mgr = KVCacheManager([FULL, win], [16, 16], storage="numpy", debug_validate=True)
    toks = list(range(1, 21))
    mgr.add_sequence("a", toks)
    run(mgr, [("a", toks[:10])])
    # length 10: next query at 10 sees 5..9 plus sinks 0,1: page 0 (sinks) kept, page 1 (4..7) still needed
    assert mgr.block_row("a", 1)[:2].tolist() != [INVALID_BLOCK, INVALID_BLOCK]
    run(mgr, [("a", toks[10:14])])
    # length 14: first needed 9 -> pages 1 (4..7) released, page 0 (sinks) and 2.. kept
    row = mgr.block_row("a", 1)
    assert row[1] == INVALID_BLOCK and row[0] >= 0 and np.all(row[2:] >= 0)
    assert mgr.num_free(1) == 16 - 3
    check_contents(mgr, "a", toks[:14])
    for t in toks[14:]:
        run(mgr, [("a", [t])])
    check_contents(mgr, "a", toks)
    mgr.reserve("a", 1)
    step = mgr.build_step(["a"])
    gs = step.groups[1]
    assert gs.kv_indices.tolist() == mgr.block_row("a", 1).tolist() and INVALID_BLOCK in gs.kv_indices.tolist()
    mgr.validate_step(step)
    assert step.groups[0].kv_indices.min() >= 0


def test_cyclic_ring_wraps_in_place_and_validates_the_step_size():
    ring = PoolGroup("ring", KVLayout(1, 1, 4, 2, ring_sink_tokens=2, cyclic_len=8), window=5, attention_sinks=2)
    mgr = KVCacheManager([ring], 8, storage="numpy", debug_validate=True)
    assert ring.ring_pages == 3  # sinks 2 + bubble 2 + ring 8 = 12 slots
    toks = list(np.arange(1, 31))
    mgr.add_sequence("a", toks)
    run(mgr, [("a", toks[:4])])  # the largest step: cyclic_len 8 >= window 5 + 4 - 1
    before = snapshot(mgr)
    with pytest.raises(ValueError, match=r"cyclic_len=8 of pool group 'ring' is too short for a step of 5 new "
                                         r"tokens with window=5: .* >= window \+ new_tokens - 1 = 9"):
        mgr.reserve("a", 5)
    assert snapshot(mgr) == before
    L = 4
    while L < 30:
        n = min(4, 30 - L)
        run(mgr, [("a", toks[L:L + n])])
        L += n
        assert mgr.num_pages("a") == min(3, -(-int(ring.layout.slots_used(L)) // 4))
        check_contents(mgr, "a", toks[:L])
    assert mgr.num_free() == 8 - 3


def test_fork_of_a_ring_copies_whole_blocks_on_write():
    ring = PoolGroup("ring", KVLayout(1, 1, 4, 2, cyclic_len=8), window=6)
    mgr = KVCacheManager([ring], 8, storage="numpy", debug_validate=True)
    toks = list(range(1, 12))
    mgr.add_sequence("a", toks)
    for lo in range(0, 11, 3):  # steps of at most cyclic_len - window + 1 = 3 tokens; 11 tokens wrap the ring
        run(mgr, [("a", toks[lo:lo + 3])])
    mgr.drain_copies()
    mgr.fork("a", "b")
    run(mgr, [("b", [40, 41, 42])])  # writes slots 3, 4, 5 -> pages 0 and 1, both shared -> whole copies
    copies = mgr.drain_copies()
    assert len(copies) == 2 and all(c.whole for c in copies)
    check_contents(mgr, "a", toks)
    check_contents(mgr, "b", toks + [40, 41, 42])


def test_swap_out_and_in_round_trip():
    mgr = KVCacheManager([FULL], 8, host_blocks=4, storage="numpy", debug_validate=True)
    toks = list(range(1, 11))
    mgr.add_sequence("a", toks)
    run(mgr, [("a", toks)])  # 3 pages, the last with 2 tokens
    mgr.drain_copies()
    mgr.swap_out("a")
    copies = mgr.drain_copies()
    assert [c.num_tokens for c in copies] == [0, 0, 2] and all(c.dst_tier == Tier.SECONDARY for c in copies)
    assert mgr.num_free() == 8 and mgr.is_swapped("a")
    with pytest.raises(ValueError, match="swapped out; swap_in first"):
        mgr.reserve("a", 1)
    with pytest.raises(ValueError, match="swapped out"):
        mgr.build_step(["a"])
    mgr.add_sequence("filler", [9] * 24)
    run(mgr, [("filler", [9] * 24)])  # overwrite the primary blocks
    with pytest.raises(KVCacheExhaustedError, match=r"needs 3 block.*\(primary tier\) \(swap_in\)"):
        mgr.swap_in("a")
    mgr.free("filler")
    mgr.swap_in("a")
    check_contents(mgr, "a", toks)
    mgr.add_sequence("b", [1] * 20)
    run(mgr, [("b", [1] * 20)])
    with pytest.raises(KVCacheExhaustedError, match=r"\(secondary tier\)"):
        mgr.swap_out("b")  # 5 pages, 4 host blocks
    mgr.swap_out("a")
    mgr.free("a")
    assert mgr.host_allocators[0].num_free == 4


def test_build_step_mixed_batch_and_explicit_positions():
    mgr = KVCacheManager([FULL], 16, storage="numpy", debug_validate=True)
    for sid, n in (("a", 5), ("b", 2)):
        mgr.add_sequence(sid)
        run(mgr, [(sid, list(range(1, n + 1)))])
    mgr.add_sequence("c")
    mgr.reserve("a", 1)
    mgr.reserve("b", 3)
    mgr.reserve("c", 6)
    step = mgr.build_step(["a", ("b", 2), "c"], position_ids=[100, 7, 8, 0, 1, 2, 3, 4, 5])
    assert step.cu_q_lens.tolist() == [0, 1, 3, 9] and step.past_lens.tolist() == [5, 2, 0]
    assert step.positions.tolist() == [5, 2, 3, 0, 1, 2, 3, 4, 5]
    assert step.meta(0).position_ids.tolist() == [100, 7, 8, 0, 1, 2, 3, 4, 5]
    assert step.token_seq.tolist() == [0, 1, 1, 2, 2, 2, 2, 2, 2]
    # b reserved 3 but steps 2: its table row shows only the pages 4 tokens need
    assert step.groups[0].num_pages.tolist() == [2, 1, 2] and step.groups[0].block_table[1, 1] == INVALID_BLOCK
    assert (step.max_q_len, step.max_kv_len) == (6, 6)
    with pytest.raises(ValueError, match=r"position_ids: expected shape \(9,\)"):
        mgr.build_step(["a", ("b", 2), "c"], position_ids=[1, 2])


def test_unreserve_returns_the_extra_pages():
    mgr = KVCacheManager([FULL], 8, storage="none", debug_validate=True)
    mgr.add_sequence("a")
    mgr.reserve("a", 9)
    assert mgr.num_pages("a") == 3
    mgr.commit("a", 2)
    mgr.unreserve("a")
    assert mgr.num_pages("a") == 1 and mgr.reserved("a") == 0 and mgr.num_free() == 7


def test_host_model_records_copies_without_memory():
    mgr = KVCacheManager([FULL], 8, host_blocks=2, storage="none", debug_validate=True)
    mgr.add_sequence("a")
    mgr.reserve("a", 3)
    mgr.commit("a", 3)
    mgr.fork("a", "b")
    mgr.reserve("b", 1)
    mgr.swap_out("a")
    log = mgr.drain_copies()
    assert log == [BlockCopy(0, Tier.PRIMARY, 0, Tier.PRIMARY, 1, 3), BlockCopy(0, Tier.PRIMARY, 0, Tier.SECONDARY, 0, 3)]
    with pytest.raises(RuntimeError, match="only numpy storage exposes pool arrays"):
        mgr.pool(0)


def test_debug_switch_catches_corruption_at_the_next_operation(monkeypatch):
    from pagedkv.kvcache import KVInvariantError

    monkeypatch.setenv("PAGEDKV_KV_DEBUG", "1")
    mgr = KVCacheManager([FULL], 8)
    assert mgr.debug_validate
    mgr.add_sequence("a")
    mgr.reserve("a", 4)
    mgr.allocators[0]._refcount[0] += 1  # corrupt: a holder that does not exist
    with pytest.raises(KVInvariantError, match="refcount-holders"):
        mgr.commit("a", 4)
    monkeypatch.setenv("PAGEDKV_KV_DEBUG", "0")
    assert not KVCacheManager([FULL], 8).debug_validate


def test_close_is_idempotent_and_a_context_manager():
    with KVCacheManager([FULL], 4, storage="numpy") as mgr:
        mgr.add_sequence(0)
    assert mgr.storage is None
    mgr.close()
