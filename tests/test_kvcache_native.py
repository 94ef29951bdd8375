"""Differential test: one random request trace through the C++ KV manager (``NativeKVManager``,
``plugins/runtime``) and the Python ``KVCacheManager`` (host model), compared after every operation.

Operations: add (prompts sharing prefixes, salts), reserve (prefill chunks, decode tokens, speculative and
oversized reservations that exhaust a pool, negative counts), commit (all or part of a reservation, with the
prompt's ids, generated ids, wrong ids or none), steps (any mix of sequences and counts, repeats, sequences
without a reservation), batched decode (the C++ side in one reserve_many / commit_many call, or all-or-nothing
on both sides: Python reserve_many against C++ reserve_all), fork, free,
unreserve, swap out/in, unknown sequences. The Python manager is the oracle; after each operation both must
agree on:

* the outcome: the same return value, or the same exception type with the same message (which names the
  sequence and the values; for exhaustion: needed, free, group, tier, sequence, operation);
* the state: sequence ids in order, lengths, reservations, swap states, every block list of every group,
  both tiers' free lists (so the same blocks are handed out next), the cached prefix blocks, the recorded
  block copies; both doctors clean;
* every step's metadata, byte for byte (every array's dtype, shape and bytes).

``hypothesis`` drives a state machine over six configurations (the property test's three: FULL groups of two
page sizes with prefix reuse, RELEASE and CYCLIC windows with sinks; the first with larger pools; a tiny pool
that keeps running out; three groups with a non-power-of-two page); a long seeded run covers 10^4 operations
per configuration more.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from conftest import built_file
from pagedkv import _lib
from pagedkv.kvcache import KVCacheError, KVCacheManager, PoolGroup, Tier, pool_descriptors
from pagedkv.kvcache.native import NativeKVManager
from pagedkv.layout import KVLayout

from test_kvcache_support import CONFIGS as PROPERTY_CONFIGS



@pytest.fixture(autouse=True, scope="module")
def runtime_library():
    """CI builds the runtime library: its absence fails, it is not skipped."""
    built_file(_lib.RUNTIME_NAME)

# The property test's configurations, and: the first with room enough to keep prefixes cached, a pool that
# keeps running out, three groups with a non-power-of-two page.
CONFIGS = {
    **PROPERTY_CONFIGS,
    "roomy": (PROPERTY_CONFIGS["prefix"][0], [40, 24], [10, 6], True),
    "tiny": ([PoolGroup("t2", KVLayout(1, 1, 2, 1))], [7], [3], True),
    "three": ([PoolGroup("a4", KVLayout(1, 1, 4, 1)),
               PoolGroup("w5", KVLayout(1, 1, 5, 1), window=6, attention_sinks=1),
               PoolGroup("r4", KVLayout(1, 1, 4, 1, ring_sink_tokens=1, cyclic_len=12), window=6, attention_sinks=1)],
              [30, 30, 12], [12, 12, 6], False),
}
UNKNOWN = 10 ** 9  # a sequence id that is never added
ERRORS = (KVCacheError, ValueError, KeyError)


def outcome(fn):
    """("ok", result) or ("error", type, message) of a call."""
    try:
        return ("ok", fn())
    except ERRORS as exc:
        return ("error", type(exc), str(exc))


def assert_same_step(a, b) -> None:
    assert a.seq_ids == b.seq_ids and (a.max_q_len, a.max_kv_len) == (b.max_q_len, b.max_kv_len)
    for name in ("cu_q_lens", "past_lens", "q_lens", "kv_lens", "token_seq", "positions"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes()), name
    assert len(a.groups) == len(b.groups)
    for ga, gb in zip(a.groups, b.groups):
        assert (ga.name, ga.pool_index) == (gb.name, gb.pool_index)
        for name in ("block_table", "num_pages", "last_page_lens", "kv_indptr", "kv_indices"):
            x, y = getattr(ga, name), getattr(gb, name)
            assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes()), f"{ga.name}: {name}"


class Twin:
    """The Python and the C++ manager side by side; every call goes to both and is compared."""

    def __init__(self, config: str, seed: int):
        groups, blocks, host, prefix = CONFIGS[config]
        self.py = KVCacheManager(groups, blocks, host_blocks=host, storage="none", enable_prefix_reuse=prefix,
                                 debug_validate=False)
        self.cc = NativeKVManager(groups, blocks, host_blocks=host, enable_prefix_reuse=prefix)
        self.rng = np.random.default_rng(seed)
        self.next_id = 0
        self.prompts: list[list[int]] = []
        self.ops = 0

    def call(self, name: str, *args):
        """``name(*args)`` on both managers, compared."""
        return self.compare(f"{name}{args}", lambda: getattr(self.py, name)(*args),
                            lambda: getattr(self.cc, name)(*args), step=name == "build_step")

    def compare(self, what: str, python, native, step: bool = False):
        self.ops += 1
        a, b = outcome(python), outcome(native)
        if step and a[0] == b[0] == "ok":
            assert_same_step(a[1], b[1])
        else:
            assert a == b, f"{what}: python {a}, C++ {b}"
        return a

    def check_state(self) -> None:
        py, cc = self.py, self.cc
        assert py.sequences == cc.sequences
        for sid in py.sequences:
            assert (py.length(sid), py.reserved(sid), py.is_swapped(sid), py.prefill_remaining(sid)) == \
                   (cc.length(sid), cc.reserved(sid), cc.is_swapped(sid), cc.prefill_remaining(sid)), sid
            for g in range(len(py.groups)):
                a, b = py.block_row(sid, g), cc.block_row(sid, g)
                assert a.dtype == b.dtype and np.array_equal(a, b), f"sequence {sid} group {g}: {a} vs {b}"
        for g in range(len(py.groups)):
            assert list(py.allocators[g].free_list()) == cc.free_list(g, Tier.PRIMARY), f"group {g} free list"
            assert list(py.host_allocators[g].free_list()) == cc.free_list(g, Tier.SECONDARY), f"group {g} host"
            if py.prefix is not None:
                assert sorted(py.prefix[g].cached_blocks()) == cc.cached_blocks(g), f"group {g} cached blocks"
        assert py.drain_copies() == cc.drain_copies()
        py.validate()
        cc.validate()

    # ---- choices ---------------------------------------------------------------------------------------
    def pick(self, k: int, live_only: bool = False) -> int:
        ids = [s for s in self.py.sequences if not (live_only and self.py.is_swapped(s))]
        if not ids or k % 11 == 10:  # now and then a sequence the managers do not know
            return UNKNOWN
        return ids[k % len(ids)]

    def tokens_for(self, sid: int, n: int, wrong: bool = False) -> list[int]:
        """Ids for the next n tokens: the known ones (prompt), then a small alphabet (so that generated
        blocks of different sequences repeat and become prefix hits); ``wrong`` breaks a known one."""
        st_ = self.py.state(sid)
        L = self.py.length(sid)
        known = st_.known_tokens()[L:L + n].tolist()
        out = known + [int(t) for t in self.rng.integers(1, 4, size=n - len(known))]
        if wrong and known:
            out[0] += 1000
        return out

    # ---- operations (arguments are plain ints, from hypothesis or a seeded generator) ----------------------
    def add(self, source: int, keep: int, extra: int, salt: int) -> None:
        prompt, live = [], self.py.sequences
        if live and source % 3 == 1:  # start like what a sequence has in the cache (prefix hits)
            sid = live[source % len(live)]
            base = self.py.state(sid).known_tokens()[:self.py.length(sid)].tolist()
            prompt = base[:len(base) - keep % 3]
        elif self.prompts and source % 3 == 2:  # like an earlier prompt (hits while its blocks stay cached)
            base = self.prompts[source % len(self.prompts)]
            prompt = base[:keep % (len(base) + 1)]
        # extra 0: exactly a cached prefix, whose last token must still be computed
        prompt += [int(t) for t in self.rng.integers(1, 4, size=extra if prompt else max(extra, 1))]
        self.prompts.append(prompt)
        if source % 17 == 16 and self.py.sequences:
            sid = self.py.sequences[0]  # an existing id
        else:
            sid, self.next_id = self.next_id, self.next_id + 1
        salt = b"" if salt % 8 else b"s%d" % (salt % 16 // 8)
        self.compare(f"add_sequence({sid}, {prompt}, salt={salt})",
                     lambda: self.py.add_sequence(sid, prompt, salt=salt),
                     lambda: self.cc.add_sequence(sid, prompt, salt=salt))

    def reserve(self, k: int, n: int) -> None:
        self.call("reserve", self.pick(k), n)

    def commit(self, k: int, fraction: int, mode: int) -> None:
        sid = self.pick(k)
        n = self.py.reserved(sid) * fraction // 4 if sid in self.py else fraction
        if mode % 4 == 3 and sid in self.py:
            n += 1  # more than reserved
        ids = None
        if sid in self.py and mode % 8 != 0:  # now and then no ids: later blocks are not registered
            ids = self.tokens_for(sid, max(n, 0), wrong=mode % 8 == 5)
            if mode % 16 == 6:
                ids = ids[:-1] or [1, 2]  # wrong count
        self.call("commit", sid, n, ids)

    def step(self, k: int, width: int, counts: list[int]) -> None:
        entries = []
        for i in range(width):
            sid = self.pick(k + 3 * i, live_only=True)
            c = counts[i % len(counts)]
            entries.append(sid if c < 0 else (sid, c))
        if self.call("build_step", entries)[0] == "ok" and k % 2:
            for e in entries:  # run it: commit what the step wrote
                sid, n = (e, self.py.reserved(e)) if not isinstance(e, tuple) else e
                self.call("commit", sid, n, self.tokens_for(sid, n))

    def decode(self, k: int, chunk: int, mode: int) -> None:
        """A scheduler's step: reserve for a few live sequences, build the step, commit it. ``mode`` 0: one call
        per sequence on both sides; 1: the C++ reserve_many (stops at the first failure) against one Python call
        per sequence; 2: all-or-nothing on both sides (Python reserve_many, C++ reserve_all)."""
        batched = mode == 1
        live = [s for s in self.py.sequences if not self.py.is_swapped(s)]
        chosen = live[k % max(len(live), 1):][:1 + k % 5]
        if mode == 2 and k % 7 == 3 and chosen:
            chosen = chosen + chosen[:1]  # a repeated sequence: both refuse the batch
        counts = [max(1, min(chunk, self.py.prefill_remaining(s))) for s in chosen]
        if mode == 2:
            if self.compare(f"reserve_all({chosen}, {counts})", lambda: self.py.reserve_many(chosen, counts),
                            lambda: self.cc.reserve_all(chosen, counts))[0] != "ok":
                return
        elif batched:  # the C++ batch call equals one Python call per sequence, stopping at the first failure
            def reserve_each():
                for s, n in zip(chosen, counts):
                    self.py.reserve(s, n)
            if self.compare(f"reserve_many({chosen}, {counts})", reserve_each,
                            lambda: self.cc.reserve_many(chosen, counts))[0] != "ok":
                return
        else:
            for s, n in zip(chosen, counts):
                if self.call("reserve", s, n)[0] != "ok":
                    return
        if self.call("build_step", list(zip(chosen, counts)))[0] != "ok":
            return
        tokens = [self.tokens_for(s, n) for s, n in zip(chosen, counts)]
        if batched:
            def commit_each():
                for s, n, ts in zip(chosen, counts, tokens):
                    self.py.commit(s, n, ts)
            flat = [t for ts in tokens for t in ts]
            self.compare(f"commit_many({chosen}, {counts})", commit_each,
                         lambda: self.cc.commit_many(chosen, counts, flat))
        else:
            for s, n, ts in zip(chosen, counts, tokens):
                self.call("commit", s, n, ts)

    def fork(self, k: int) -> None:
        dst = self.py.sequences[0] if k % 9 == 8 and self.py.sequences else self.next_id
        if dst == self.next_id:
            self.next_id += 1
        self.call("fork", self.pick(k), dst)

    def free(self, k: int) -> None:
        self.call("free", self.pick(k))

    def unreserve(self, k: int) -> None:
        self.call("unreserve", self.pick(k))

    def swap_out(self, k: int) -> None:
        self.call("swap_out", self.pick(k))

    def swap_in(self, k: int) -> None:
        self.call("swap_in", self.pick(k))

    def finish(self) -> None:
        """Free everything: both end with every block free, in the same order."""
        for sid in list(self.py.sequences):
            self.call("free", sid)
        self.check_state()
        for g in range(len(self.py.groups)):
            assert self.cc.num_free(g) == self.py.num_blocks[g]


ints = st.integers(0, 10 ** 6)


class DifferentialMachine(RuleBasedStateMachine):
    @initialize(config=st.sampled_from(sorted(CONFIGS)), seed=st.integers(0, 2 ** 32 - 1))
    def setup(self, config, seed):
        self.twin = Twin(config, seed)

    @rule(source=ints, keep=st.integers(0, 40), extra=st.integers(0, 20), salt=ints)
    def add(self, source, keep, extra, salt):
        if len(self.twin.py.sequences) < 8:
            self.twin.add(source, keep, extra, salt)

    @rule(k=ints, n=st.one_of(st.integers(0, 9), st.integers(10, 80), st.just(-1)))
    def reserve(self, k, n):
        self.twin.reserve(k, n)

    @rule(k=ints, fraction=st.integers(0, 4), mode=ints)
    def commit(self, k, fraction, mode):
        self.twin.commit(k, fraction, mode)

    @rule(k=ints, width=st.integers(0, 4), counts=st.lists(st.integers(-1, 6), min_size=1, max_size=4))
    def step(self, k, width, counts):
        self.twin.step(k, width, counts)

    @rule(k=ints, chunk=st.integers(1, 9), mode=st.integers(0, 2))
    def decode(self, k, chunk, mode):
        self.twin.decode(k, chunk, mode)

    @rule(k=ints, which=st.integers(0, 4))
    def lifecycle(self, k, which):
        [self.twin.fork, self.twin.free, self.twin.unreserve, self.twin.swap_out, self.twin.swap_in][which](k)

    @invariant()
    def same_state(self):
        if hasattr(self, "twin"):
            self.twin.check_state()

    def teardown(self):
        if hasattr(self, "twin"):
            self.twin.finish()


def test_native_manager_matches_python_on_random_traces():
    run_state_machine_as_test(DifferentialMachine, settings=settings(
        max_examples=60, stateful_step_count=120, deadline=None, database=None,
        suppress_health_check=list(HealthCheck)))


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_native_manager_matches_python_on_a_long_seeded_trace(config):
    """10^4 operations per configuration (about half of them steps and decode steps), state compared after each."""
    twin = Twin(config, seed=sorted(CONFIGS).index(config))
    rng = np.random.default_rng(1234 + len(config))
    while twin.ops < 10_000:
        k = int(rng.integers(0, 10 ** 6))
        op = int(rng.integers(0, 10))
        if op == 0 and len(twin.py.sequences) < 8:
            twin.add(k, int(rng.integers(0, 41)), int(rng.integers(0, 21)), int(rng.integers(0, 8)))
        elif op == 1:
            twin.reserve(k, int(rng.choice([int(rng.integers(0, 10)), int(rng.integers(10, 80)), -1])))
        elif op == 2:
            twin.commit(k, int(rng.integers(0, 5)), int(rng.integers(0, 64)))
        elif op == 3:
            twin.step(k, int(rng.integers(0, 5)), rng.integers(-1, 7, size=3).tolist())
        elif op in (4, 5, 6):
            twin.decode(k, int(rng.integers(1, 10)), [0, 1, 2][op - 4] if k % 3 else 2)
        else:
            [twin.fork, twin.free, twin.unreserve, twin.swap_out, twin.swap_in][int(rng.integers(0, 5))](k)
        twin.check_state()
    twin.finish()


def test_pool_descriptors_match():
    groups, blocks, host, _ = CONFIGS["three"]
    cc = NativeKVManager(groups, blocks, host_blocks=host)
    addresses = [0x7F00_0000_1000, 0x7F00_2000_0000, 2 ** 63 + 4096]  # the last one wraps to a negative int64
    got = cc.pool_descriptors(addresses)
    want = pool_descriptors(addresses, blocks)
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


def test_native_errors_are_the_python_types():
    cc = NativeKVManager([PoolGroup("g", KVLayout(1, 1, 4, 1))], 4, host_blocks=1)
    with pytest.raises(KeyError, match="sequence 3 is not in the KV manager"):
        cc.free(3)
    cc.add_sequence(1, [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="prompt_tokens: token ids must fit int32"):
        cc.add_sequence(2, [2 ** 31])
    cc.reserve(1, 5)
    with pytest.raises(ValueError, match=r"commit: token_ids has 2 entries for 5 tokens \(sequence 1\)"):
        cc.commit(1, 5, [1, 2])
    cc.commit(1, 5)
    from pagedkv.kvcache import KVCacheExhaustedError

    with pytest.raises(KVCacheExhaustedError) as exc:
        cc.swap_out(1)
    assert (exc.value.needed, exc.value.free, exc.value.group, exc.value.tier, exc.value.seq) == \
           (2, 1, "g", "secondary", 1)
    with pytest.raises(ValueError, match="groups: names must be unique"):
        NativeKVManager([PoolGroup("g", KVLayout(1, 1, 4, 1))] * 2, 4)


def test_close_is_idempotent_and_a_closed_manager_refuses_calls():
    with NativeKVManager([PoolGroup("g", KVLayout(1, 1, 4, 1))], 4) as cc:
        cc.add_sequence(1, [1, 2, 3])
        assert 1 in cc and cc.num_free(0) == 4
    cc.close()  # a second close does nothing
    assert 1 not in cc  # (pagedkv_kv_contains answers 0 for a NULL manager)
    with pytest.raises(ValueError, match="^manager: null pointer$"):
        cc.reserve(1, 1)
    with pytest.raises(ValueError, match="^manager: null pointer$"):
        cc.num_free(0)
