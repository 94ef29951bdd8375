"""The KV manager's batched operations (``reserve_many``, ``commit_many``, ``build_step_many``) against the
per-sequence ones they replace in the scheduler's steps.

Two managers see the same random workload (prompts with shared prefixes, chunked prefill mixed with decodes,
forks, frees, pool pressure): one through ``reserve``/``commit``/``build_step`` per sequence, one through the
batched calls. After every step both hold the same tables, lengths, reservations, allocator state, prefix
cache and copy log, the validator is clean, and the step metadata is identical; a batched reserve that cannot
be satisfied raises and changes nothing. Pool groups cover full attention, a released window (linear) and a
ring (cyclic: the sequential path).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_kvcache_support import snapshot

from pagedkv.kvcache import KVCacheExhaustedError, KVCacheManager, PoolGroup
from pagedkv.layout import KVLayout

GROUPS = {  # name -> (groups, blocks per group: few enough that the workload runs the pool out)
    "full": ([PoolGroup("full", KVLayout(2, 2, 4, 8))], 24),
    "full+window": ([PoolGroup("full", KVLayout(2, 2, 4, 8)), PoolGroup("win", KVLayout(1, 1, 8, 8), window=9)], 26),
    "ring": ([PoolGroup("ring", KVLayout(1, 1, 4, 8, cyclic_len=24), window=8)], 24),
}


def _state(mgr) -> tuple:
    """The bookkeeping both managers must share (known token counts may lag in the batched one)."""
    snap = snapshot(mgr)
    seqs = tuple((s[0], s[1], s[4], s[5], s[6]) for s in snap[8])
    # copies of different groups are independent: the order within each group is what must agree
    copies = sorted(((c.group, i, c.src_block, c.dst_block, c.num_tokens) for i, c in enumerate(mgr.copy_log)))
    return snap[:8] + (seqs,), [(g, src, dst, n) for g, _, src, dst, n in copies]


def _steps_equal(a, b) -> None:
    assert a.seq_ids == b.seq_ids
    for name in ("cu_q_lens", "past_lens", "q_lens", "kv_lens", "token_seq", "positions"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    for ga, gb in zip(a.groups, b.groups):
        for name in ("num_pages", "last_page_lens", "kv_indptr", "kv_indices"):
            np.testing.assert_array_equal(getattr(ga, name), getattr(gb, name), err_msg=name)
        np.testing.assert_array_equal(ga.block_table, gb.block_table)


@pytest.mark.parametrize("groups", list(GROUPS))
@pytest.mark.parametrize("seed", range(6))
def test_batched_operations_equal_the_sequential_ones(groups, seed):
    rng = np.random.default_rng(seed)
    coin = np.random.default_rng(seed + 1000)  # (its own stream: the workload stays that of rng alone)
    prefix_reuse = groups == "full"
    make = lambda: KVCacheManager(GROUPS[groups][0], GROUPS[groups][1], storage="none",  # noqa: E731
                                  enable_prefix_reuse=prefix_reuse, debug_validate=True)
    seq, bat = make(), make()
    shared = rng.integers(1, 50, 12)
    tokens: dict[int, list[int]] = {}  # every token of each live sequence (prompt + fed)
    prompt_len: dict[int, int] = {}
    next_id = 0
    exhausted = one_count = 0
    for _ in range(60):
        while len(tokens) < 6:  # new sequences, half of them with a shared prefix
            head = shared[:rng.integers(0, 12)] if rng.random() < 0.5 else np.zeros(0, np.int64)
            prompt = np.concatenate([head, rng.integers(1, 50, rng.integers(1, 14))]).astype(np.int64)
            assert seq.add_sequence(next_id, prompt) == bat.add_sequence(next_id, prompt)
            tokens[next_id], prompt_len[next_id] = list(prompt), len(prompt)
            next_id += 1
        ids = [s for s in tokens if rng.random() < 0.8]
        counts = []
        for s in ids:
            left = prompt_len[s] - seq.length(s)
            counts.append(int(min(left, rng.integers(1, 7))) if left > 0 else 1)
        # one count for all (as a scheduler's decodes pass it) half the time the counts agree
        batched = counts[0] if len(set(counts)) == 1 and coin.random() < 0.5 else counts
        one_count += isinstance(batched, int)
        before = _state(bat)
        try:
            bat.reserve_many(ids, batched)
        except KVCacheExhaustedError:
            exhausted += 1
            assert _state(bat) == before, "a failed reserve_many changed the manager"
            victim = max(tokens)  # free the newest sequence, as a scheduler's preemption would
            seq.free(victim)
            bat.free(victim)
            del tokens[victim]
            continue
        for s, n in zip(ids, counts):
            seq.reserve(s, n)
        assert _state(bat) == _state(seq)
        if not ids:
            continue
        _steps_equal(bat.build_step_many(ids, batched), seq.build_step(list(zip(ids, counts))))
        fed = {}
        for s, n in zip(ids, counts):
            start = seq.length(s)
            if start + n > len(tokens[s]):  # decode: a new token after the known ones
                tokens[s].append(int(rng.integers(1, 50)))
            fed[s] = tokens[s][start:start + n]
            seq.commit(s, n, token_ids=fed[s])
        bat.commit_many(ids, batched, tokens_of=lambda i, start, end: tokens[ids[i]][start:end])
        assert _state(bat) == _state(seq)
        for s in [s for s in tokens if rng.random() < 0.08]:
            seq.free(s)
            bat.free(s)
            del tokens[s]
        if tokens and rng.random() < 0.3:  # a fork shares the partial last page: copy-on-write in the batch
            parent = int(rng.choice(list(tokens)))
            seq.fork(parent, next_id)
            bat.fork(parent, next_id)
            tokens[next_id], prompt_len[next_id] = list(tokens[parent]), prompt_len[parent]
            next_id += 1
    assert exhausted, "the workload never ran the pool out: the all-or-nothing path was not exercised"
    assert any(c.src_tier == c.dst_tier for c in bat.copy_log), "no copy-on-write happened in a batch"
    assert one_count, "no batched call got one count for all its sequences"
    if prefix_reuse:
        assert len(bat.prefix[0]) > 0, "no block was ever registered for prefix reuse"


def test_batched_calls_name_bad_input():
    mgr = KVCacheManager(GROUPS["full"][0], 8, storage="none")
    mgr.add_sequence("a")
    with pytest.raises(KeyError, match="reserve_many: sequence 'b' is not in the KV manager"):
        mgr.reserve_many(["a", "b"], 1)
    with pytest.raises(ValueError, match="reserve_many: a sequence appears twice"):
        mgr.reserve_many(["a", "a"], 1)
    with pytest.raises(ValueError, match=r"num_tokens must be >= 0, got -1 \(sequence 'a'\)"):
        mgr.reserve_many(["a"], [-1])
    mgr.reserve_many(["a"], 3)
    with pytest.raises(ValueError, match="commit_many: sequence 'a' has 3 reserved slot"):
        mgr.commit_many(["a"], 4)
    mgr.commit_many(["a"], 3)
    assert mgr.length("a") == 3 and mgr.reserved("a") == 0
