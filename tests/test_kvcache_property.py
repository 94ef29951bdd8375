"""Stateful property test of the KV manager against a simple model of the pool.

The model knows, per sequence, its prompt, the tokens committed so far and its reservation; nothing about
blocks. After every operation (add with prefix reuse, prefill chunks, batched decode steps, fork, free,
swap out/in, unreserve, oversized reservations that exhaust the pool) the test checks:

* the validator ("kv doctor") is clean;
* lengths and reservations equal the model's;
* every live position of every sequence reads back its own token's K and V through the block table (the
  kernels' writes are simulated from the step metadata, copy-on-write and offload copies run on numpy
  pools), which catches a shared block written twice, a wrong copy, a wrong prefix hit or a lost page;
* during each step, after its writes, every position the step's queries attend to (``layout.attends``)
  still reads back its token: a ring too short for the step would have overwritten one;
* a failed operation (pool exhausted, ring too short) changed nothing at all;
* the exhaustion rule: a reservation fails only when the pages the model says are new, plus at most one
  copy-on-write copy per page the step writes, exceed the free blocks; a success takes at least the new
  pages from the free list.

At teardown every sequence is freed and every block must be back on the free list (no leak), with the
allocator refusing a double free. The run totals at least 10^5 operations (asserted).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, \
    run_state_machine_as_test

from pagedkv.kvcache import BlockRefcountError, KVCacheExhaustedError, KVCacheManager, WindowMode

from test_kvcache_support import CONFIGS, MAX_TOKEN, check_contents, check_step_reads, snapshot, write_step


MAX_SEQS = 7
OPS = {"count": 0}


class ModelSeq:
    def __init__(self, prompt):
        self.prompt = list(prompt)
        self.tokens: list[int] = []  # committed
        self.reserved = 0


class KVMachine(RuleBasedStateMachine):
    @initialize(config=st.sampled_from(sorted(CONFIGS)), seed=st.integers(0, 2 ** 32 - 1))
    def setup(self, config, seed):
        groups, blocks, host, prefix = CONFIGS[config]
        self.mgr = KVCacheManager(groups, blocks, host_blocks=host, storage="numpy", enable_prefix_reuse=prefix,
                                  debug_validate=False)
        self.model: dict[int, ModelSeq] = {}
        self.swapped: set[int] = set()
        self.prompts: list[list[int]] = []
        self.next_id = 0
        self.rng = np.random.default_rng(seed)
        self.to_check: set | None = None  # sequences whose contents the last operation may have changed (None: all)
        self.ops_since_full_check = 0

    # ---- helpers ---------------------------------------------------------------------------------
    def _pick(self, k, live_only=True):
        ids = sorted(s for s in self.model if not (live_only and s in self.swapped))
        return ids[k % len(ids)] if ids else None

    def _model_need(self, sid, n):
        """(new pages, shared-written upper bound) per group for reserving n more tokens."""
        m = self.model[sid]
        L, R = len(m.tokens), max(m.reserved, n)
        out = []
        for spec in self.mgr.groups:
            cur = int(spec.layout.pages_needed(L + m.reserved))
            out.append(max(0, int(spec.layout.pages_needed(L + R)) - cur))
        return out

    def _reserve(self, sid, n):
        """Reserve through the manager, checking the exhaustion rule and all-or-nothing; returns success."""
        free = [a.num_free for a in self.mgr.allocators]
        new_pages = self._model_need(sid, n)
        before = snapshot(self.mgr)
        try:
            self.mgr.reserve(sid, n)
        except KVCacheExhaustedError as exc:
            assert snapshot(self.mgr) == before, "a failed reserve changed the manager"
            g = [s.name for s in self.mgr.groups].index(exc.group)
            assert exc.free == free[g] and exc.needed > exc.free
            assert exc.needed >= new_pages[g]
            # it may only fail when new pages plus (at most one per written page) copies do not fit
            written = math.ceil(max(self.model[sid].reserved, n) / self.mgr.groups[g].page_size) + 1
            assert new_pages[g] + written > free[g]
            return False
        except ValueError as exc:  # a cyclic ring too short for the step
            assert "cyclic_len" in str(exc), str(exc)
            assert snapshot(self.mgr) == before, "a failed reserve changed the manager"
            ring = [s for s in self.mgr.groups if s.mode == WindowMode.CYCLIC]
            assert ring and any(s.layout.cyclic_len < s.window + max(self.model[sid].reserved, n) - 1 for s in ring)
            return False
        for g in range(len(free)):
            assert free[g] - self.mgr.allocators[g].num_free >= new_pages[g]
        self.model[sid].reserved = max(self.model[sid].reserved, n)
        return True

    def _run_step(self, entries):
        """One engine step: metadata, simulated writes, commit."""
        if not entries:
            return
        step = self.mgr.build_step([(sid, len(toks)) for sid, toks in entries])
        self.mgr.validate_step(step)
        assert step.past_lens.tolist() == [len(self.model[sid].tokens) for sid, _ in entries]
        write_step(self.mgr, step, dict(entries))
        check_step_reads(self.mgr, step, {sid: self.model[sid].tokens + list(toks) for sid, toks in entries})
        for sid, toks in entries:
            m = self.model[sid]
            from_prompt = len(m.tokens) + len(toks) <= len(m.prompt)
            self.mgr.commit(sid, len(toks), None if from_prompt else toks)
            m.tokens += list(toks)
            m.reserved -= len(toks)

    def _next_tokens(self, sid, n):
        m = self.model[sid]
        L = len(m.tokens)
        from_prompt = m.prompt[L:L + n]
        return from_prompt + [int(t) for t in self.rng.integers(1, MAX_TOKEN + 1, size=n - len(from_prompt))]

    # ---- rules -----------------------------------------------------------------------------------
    @precondition(lambda self: len(self.model) < MAX_SEQS)
    @rule(source=st.integers(0, 50), keep=st.integers(0, 40), extra=st.integers(1, 20))
    def add(self, source, keep, extra):
        OPS["count"] += 1
        prompt = []
        if self.prompts and source % 3:  # mostly: start like an earlier prompt (prefix hits)
            base = self.prompts[source % len(self.prompts)]
            prompt = base[:keep % (len(base) + 1)]
        prompt = prompt + [int(t) for t in self.rng.integers(1, MAX_TOKEN + 1, size=extra)]
        sid = self.next_id
        self.next_id += 1
        reused = self.mgr.add_sequence(sid, prompt)
        assert 0 <= reused <= len(prompt) - 1
        if not self.mgr.prefix_reuse:
            assert reused == 0
        self.model[sid] = ModelSeq(prompt)
        self.model[sid].tokens = prompt[:reused]
        self.prompts.append(prompt)
        self.to_check = {sid}  # adopting blocks writes nothing: only the newcomer can read something new

    @rule(k=st.integers(0, 100), chunk=st.integers(1, 9))
    def prefill_chunk(self, k, chunk):
        OPS["count"] += 1
        sid = self._pick(k)
        if sid is None:
            return
        m = self.model[sid]
        n = min(chunk, max(0, len(m.prompt) - len(m.tokens))) or 1  # prompt done: a decode token instead
        if self._reserve(sid, n):
            self._run_step([(sid, self._next_tokens(sid, n))])

    @rule(k=st.integers(0, 100), width=st.integers(2, 4), chunk=st.integers(1, 6))
    def mixed_step(self, k, width, chunk):
        """Several sequences in one step: prefill chunks and decode tokens mixed."""
        OPS["count"] += 1
        entries, seen = [], set()
        for i in range(width):
            sid = self._pick(k + 3 * i)
            if sid is None or sid in seen:
                continue
            seen.add(sid)
            m = self.model[sid]
            n = min(chunk, max(0, len(m.prompt) - len(m.tokens))) or 1
            if self._reserve(sid, n):
                entries.append((sid, self._next_tokens(sid, n)))
        self._run_step(entries)

    @rule(k=st.integers(0, 100), n=st.integers(1, 64))
    def oversized_reserve(self, k, n):
        """Ask for a lot: exhaustion (or a ring too short) must change nothing; a success is undone."""
        OPS["count"] += 1
        sid = self._pick(k)
        if sid is not None and self._reserve(sid, n):
            self.mgr.unreserve(sid)
            self.model[sid].reserved = 0

    @rule(k=st.integers(0, 100))
    def fork(self, k):
        OPS["count"] += 1
        sid = self._pick(k)
        if sid is None or len(self.model) >= MAX_SEQS:
            return
        if self.model[sid].reserved:
            with pytest.raises(ValueError, match="reserved"):
                self.mgr.fork(sid, -1)
            return
        child = self.next_id
        self.next_id += 1
        self.mgr.fork(sid, child)
        parent = self.model[sid]
        self.model[child] = ModelSeq(parent.prompt)
        self.model[child].tokens = list(parent.tokens)
        self.to_check = {child}

    @rule(k=st.integers(0, 100))
    def free(self, k):
        OPS["count"] += 1
        sid = self._pick(k, live_only=False)
        if sid is None:
            return
        self.mgr.free(sid)
        del self.model[sid]
        self.swapped.discard(sid)
        self.to_check = set()  # freeing writes nothing

    @rule(k=st.integers(0, 100))
    def swap_out(self, k):
        OPS["count"] += 1
        sid = self._pick(k)
        if sid is None:
            return
        if self.model[sid].reserved:
            self.mgr.unreserve(sid)
            self.model[sid].reserved = 0
        before = snapshot(self.mgr)
        try:
            self.mgr.swap_out(sid)
        except KVCacheExhaustedError as exc:
            assert exc.tier == "secondary" and snapshot(self.mgr) == before
            return
        self.swapped.add(sid)
        self.to_check = set()  # device -> host copies write no primary block

    @rule(k=st.integers(0, 100))
    def swap_in(self, k):
        OPS["count"] += 1
        ids = sorted(self.swapped)
        if not ids:
            return
        sid = ids[k % len(ids)]
        before = snapshot(self.mgr)
        try:
            self.mgr.swap_in(sid)
        except KVCacheExhaustedError as exc:
            assert exc.tier == "primary" and snapshot(self.mgr) == before
            return
        self.swapped.discard(sid)
        self.to_check = None  # host -> device copies write primary blocks: check everyone

    # ---- invariants ------------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "mgr"):
            return
        self.mgr.validate()
        # Contents: after every operation that writes the pool (steps, copy-on-write, reloads) all sequences,
        # after the others the sequence they created; and everything every 8 operations regardless.
        self.ops_since_full_check += 1
        if self.ops_since_full_check >= 8:
            self.to_check = None
        if self.to_check is None:
            self.ops_since_full_check = 0
        for sid, m in self.model.items():
            assert self.mgr.length(sid) == len(m.tokens)
            assert self.mgr.reserved(sid) == m.reserved
            assert self.mgr.is_swapped(sid) == (sid in self.swapped)
            if sid not in self.swapped and (self.to_check is None or sid in self.to_check):
                check_contents(self.mgr, sid, m.tokens)
        self.to_check = None

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for sid in sorted(self.swapped):
            try:
                self.mgr.swap_in(sid)
            except KVCacheExhaustedError:
                continue
            self.swapped.discard(sid)
        for sid, m in self.model.items():
            if sid not in self.swapped:
                check_contents(self.mgr, sid, m.tokens)
        for sid in list(self.model):
            self.mgr.free(sid)
        self.mgr.validate()
        for g, alloc in enumerate(self.mgr.allocators):
            assert alloc.num_free == self.mgr.num_blocks[g], "leaked primary blocks"
            assert self.mgr.host_allocators[g].num_free == self.mgr.host_blocks[g], "leaked host blocks"
            if alloc.num_blocks:
                with pytest.raises(BlockRefcountError, match="double free"):
                    alloc.decref(0)


TARGET_OPERATIONS = 100_000


def test_kv_manager_state_machine():
    """Hypothesis runs of 110 random examples of up to 260 steps each, repeated until the total reaches
    TARGET_OPERATIONS (about 4 runs; ~2 minutes on one free core)."""
    OPS["count"] = 0
    runs = 0
    while OPS["count"] < TARGET_OPERATIONS:
        run_state_machine_as_test(KVMachine, settings=settings(
            max_examples=110, stateful_step_count=260, deadline=None, database=None,
            suppress_health_check=list(HealthCheck)))
        runs += 1
        assert runs <= 8, f"{OPS['count']} operations after {runs} runs: examples are much shorter than expected"
    print(f"KV manager state machine: {OPS['count']} operations in {runs} runs")
