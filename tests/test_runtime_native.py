"""Differential tests of the C++ runtime's host side against the Python runtime (``pagedkv.runtime.native``).

* **The engine**: one random request trace (arrivals mid-stream, prompts sharing prefixes, chunked prefill,
  pools small enough to preempt by recompute or swap, aborts, EOS and stop tokens, penalties, logprobs, seeds,
  context-limit refusals) runs through the C++ ``Engine`` (its scheduler, KV manager and step inputs) and the
  Python ``Engine`` (``Scheduler`` + ``KVCacheManager``). The device is the same function of the step's inputs on
  both sides (``device``: a token per logits row from its last input token, its uniform draw and its penalty
  row). After every step both must agree on: the schedule (which requests, how many tokens, in order), every
  engine input by name, byte for byte (``Executor.feed`` on the Python side), every request's state, output,
  computed tokens, preemptions, finish reason and logprobs, the KV manager's block lists, both tiers' free
  lists and the cached prefix blocks, and the scheduler's counters. Configurations: one pool with prefix reuse
  that keeps preempting by recompute; swap preemption into a host tier; two groups of different page sizes with
  explicit positions and a static block-table width; released and cyclic windows.
* **Sampling draws**: C++'s SplitMix64 uniforms, their float32 ``u`` column and derived seeds equal Python's bit
  for bit.
* **Copy geometry**: C++'s copy plan equals ``pagedkv.kvcache.copies.copy_plan`` for many layouts and counts.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import built_file
from pagedkv import _lib
from pagedkv import engine_io as io
from pagedkv.kvcache import KVCacheManager, PoolGroup, Tier
from pagedkv.kvcache.copies import copy_plan
from pagedkv.layout import CacheDType, KVLayout, PageLayout
from pagedkv.runtime.engine import Engine
from pagedkv.runtime.executor import Executor
from pagedkv.runtime.graph import RewrittenGraph
from pagedkv.runtime.request import ContextLengthError
from pagedkv.runtime.sampling import SamplingParams, U_MAX, derive_seed
from pagedkv.runtime.sampling import uniforms as py_uniforms
from pagedkv.runtime.scheduler import SchedulerConfig


@pytest.fixture(autouse=True, scope="module")
def runtime_library():
    """CI builds the runtime library: its absence fails, it is not skipped."""
    built_file(_lib.RUNTIME_NAME)


from pagedkv.runtime import native  # noqa: E402  (after the fixture's import guard)

VOCAB, TOP = 40, 3
EOS = (0,)


def device(feed: dict, vocab: int = VOCAB, top: int = TOP):
    """Stands in for the model and its sampling head on both sides: per logits row a token from the row's last
    input token, its uniform draw and the first entry of its penalty row; logprobs from the draw."""
    rows = feed[io.LOGITS_ROWS]
    ids = feed[io.INPUT_IDS].reshape(-1)
    u = feed[io.SAMPLING_PARAMS][:, io.SAMPLING_UNIFORM].astype(np.float64)
    pen = np.maximum(feed[io.PENALTY_TOKENS][:, 0], 0)
    tokens = ((ids[rows] * 7 + np.floor(u * 997).astype(np.int64) + pen) % vocab).astype(np.int32)
    logprobs = (-u).astype(np.float32)
    top_tokens = ((tokens[:, None] + np.arange(1, top + 1)) % vocab).astype(np.int32)
    top_logprobs = (-u[:, None] - np.arange(1, top + 1)).astype(np.float32)
    return tokens, logprobs, top_tokens, top_logprobs


class RecordingExecutor(Executor):
    """The Python side's device: keeps each step's engine inputs (``Executor.feed``) and answers with ``device``.
    A test harness, not a runtime backend."""

    name = "recording"

    def __init__(self, groups, num_blocks, host_blocks, prefix_reuse, explicit_positions, max_blocks):
        self.graph = RewrittenGraph(model=None, layers=(), groups=tuple(groups), input_names=(), output_names=(),
                                    logits=io.LOGITS, explicit_positions=explicit_positions, vocab=VOCAB,
                                    sampling=True, num_top_logprobs=TOP, max_blocks=max_blocks)
        self.manager = KVCacheManager(groups, num_blocks, host_blocks=host_blocks, storage="none",
                                      enable_prefix_reuse=prefix_reuse)
        self.feeds = []

    def kv_pools(self):
        return np.zeros((len(self.graph.groups), 4), np.int64)

    def _run(self, feed, outputs):
        self.feeds.append(feed)
        tokens, logprobs, top_tokens, top_logprobs = device(feed)
        return {io.NEXT_TOKENS: tokens, io.NEXT_LOGPROBS: logprobs, io.TOP_TOKENS: top_tokens,
                io.TOP_LOGPROBS: top_logprobs}


P4 = PoolGroup("p4", KVLayout(2, 2, 4, 8))
CONFIGS = {
    # groups, num_blocks, host_blocks, prefix reuse, scheduler config, explicit positions, static max_blocks
    "prefix-recompute": ([P4], [20], [0], True,
                         SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, chunk_size=8), False, None),
    "swap": ([P4], [16], [6], False,  # (a host tier that fills up: some swaps fall back to recompute)
             SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=20, chunk_size=6, preemption="swap"), False, None),
    "two-groups": ([P4, PoolGroup("p6", KVLayout(1, 1, 6, 4, page_layout=PageLayout.NHD))], [60, 40], [0, 0], True,
                   SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, chunk_size=0), True, 20),
    "windows": ([PoolGroup("rel", KVLayout(1, 2, 4, 8), window=9, attention_sinks=2),
                 PoolGroup("ring", KVLayout(1, 1, 4, 8, ring_sink_tokens=2, cyclic_len=24), window=12,
                           attention_sinks=2)],
                [40, 30], [0, 0], False, SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=16, chunk_size=5),
                False, None),
}


def outcome(fn):
    try:
        return ("ok", fn())
    except (ValueError, KeyError) as exc:
        return ("error", type(exc), str(exc))


class Pair:
    """The Python and the C++ engine on one trace."""

    def __init__(self, config: str, seed: int):
        groups, blocks, host, prefix, cfg, explicit, max_blocks = CONFIGS[config]
        self.ex = RecordingExecutor(groups, blocks, host, prefix, explicit, max_blocks)
        self.py = Engine(self.ex, cfg, eos_token_ids=EOS, seed=seed)
        self.plans = []
        schedule = self.py.scheduler.schedule
        self.py.scheduler.schedule = lambda: self._record(schedule())
        self.cc = native.NativeEngine(groups, blocks, host_blocks=host, enable_prefix_reuse=prefix, vocab=VOCAB,
                                      num_top_logprobs=TOP, explicit_positions=explicit, max_blocks=max_blocks,
                                      config=cfg, eos_token_ids=EOS, seed=seed)
        self.rng = np.random.default_rng(seed)
        self.next_id = 0
        self.bases = [self.rng.integers(1, VOCAB, int(n)).tolist() for n in (9, 14, 4)]
        self.params = {}
        self.steps = 0

    def _record(self, plan):
        self.plans.append(([r.id for r in plan.decodes] + [r.id for r, _ in plan.prefills],
                           [1] * len(plan.decodes) + [n for _, n in plan.prefills]))
        return plan

    # ---- the trace ---------------------------------------------------------------------------------------
    def add(self) -> None:
        rng = self.rng
        base = self.bases[int(rng.integers(0, len(self.bases)))] if rng.random() < 0.7 else []
        prompt = base[:int(rng.integers(0, len(base) + 1))] + rng.integers(1, VOCAB, int(rng.integers(1, 14))).tolist()
        if rng.random() < 0.03:
            prompt[-1] = VOCAB + 3  # outside the vocabulary: both refuse it
        kind = rng.random()
        params = SamplingParams(
            max_new_tokens=int(rng.integers(1, 16)) if rng.random() < 0.95 else 500,  # 500: beyond the context limit
            temperature=float(rng.choice([0.0, 0.7])), top_k=int(rng.choice([0, 5])), top_p=float(rng.choice([1.0, 0.9])),
            repetition_penalty=1.3 if kind < 0.2 else 1.0, presence_penalty=0.5 if 0.2 <= kind < 0.3 else 0.0,
            seed=int(rng.integers(0, 2 ** 63)) if rng.random() < 0.3 else None,
            logprobs=int(rng.integers(0, TOP + 1)) if rng.random() < 0.3 else None,
            stop_token_ids=(5,) if rng.random() < 0.2 else (), ignore_eos=bool(rng.random() < 0.2))
        rid, self.next_id = self.next_id, self.next_id + 1
        a = outcome(lambda: self.py.add_request(rid, prompt, params) and None)
        b = outcome(lambda: self.cc.add_request(rid, prompt, params))
        assert a == b, f"add_request({rid}, {prompt}, {params}): python {a}, C++ {b}"
        if a[0] == "ok":
            self.params[rid] = params

    def abort(self) -> None:
        live = sorted(self.py.requests)
        rid = live[int(self.rng.integers(0, len(live)))] if live and self.rng.random() < 0.9 else 10 ** 6
        py_request = self.py.requests.get(rid)
        assert (self.py.abort(rid) is not None) == self.cc.abort(rid), rid
        if py_request is not None:
            self.check_finished([py_request])

    def step(self) -> None:
        self.steps += 1
        feeds = len(self.ex.feeds)
        samplers = self.py.step()
        cc_step = self.cc.begin_step()
        if len(self.ex.feeds) == feeds:  # nothing scheduled
            assert cc_step is None, f"step {self.steps}: C++ scheduled {cc_step.request_ids}, Python nothing"
            return
        assert cc_step is not None, f"step {self.steps}: Python scheduled {self.plans[-1]}, C++ nothing"
        assert (cc_step.request_ids, cc_step.counts) == self.plans[-1], f"step {self.steps}: schedule"
        want = {k: v for k, v in self.ex.feeds[-1].items() if k != io.KV_POOLS}
        assert sorted(want) == sorted(cc_step.feed), f"step {self.steps}: inputs {sorted(want)} vs {sorted(cc_step.feed)}"
        for name, a in want.items():
            a, b = np.asarray(a), cc_step.feed[name]
            assert (a.dtype, a.shape) == (b.dtype, b.shape) and a.tobytes() == b.tobytes(), \
                f"step {self.steps}: {name}\npython {a}\nC++    {b}"
        self.cc.end_step(*device(cc_step.feed))
        self.check_finished([r for r in samplers if r.finished])

    # ---- comparisons ---------------------------------------------------------------------------------------
    def check_finished(self, finished) -> None:
        assert sorted(self.cc.finished()) == sorted(r.id for r in finished), f"step {self.steps}: finished"
        for r in finished:
            self.check_request(r)
            self.cc.release(r.id)

    def check_request(self, r) -> None:
        c = self.cc.request(r.id)
        assert (c.state, c.finish_reason, c.output, c.num_computed, c.num_preemptions, c.max_tokens, c.seed) == \
               (r.state, r.finish_reason, r.output, r.num_computed, r.num_preemptions, r.max_tokens, r.seed), r.id
        k = r.params.logprobs
        if k is not None:
            assert np.array_equal(c.logprobs, np.array([lp.logprob for lp in r.logprobs], np.float32)), r.id
            tokens, lps = self.cc.top_logprobs(r.id, k)
            assert tokens.tolist() == [[t for t, _ in lp.top] for lp in r.logprobs], r.id
            assert np.array_equal(lps, np.array([[p for _, p in lp.top] for lp in r.logprobs], np.float32).reshape(len(r.logprobs), k))

    def check_state(self) -> None:
        py, cc = self.ex.manager, self.cc.kv
        for r in self.py.requests.values():
            self.check_request(r)
        assert py.sequences == cc.sequences, f"step {self.steps}: sequences"
        for sid in py.sequences:
            assert (py.length(sid), py.reserved(sid), py.is_swapped(sid)) == \
                   (cc.length(sid), cc.reserved(sid), cc.is_swapped(sid)), sid
            for g in range(len(py.groups)):
                assert np.array_equal(py.block_row(sid, g), cc.block_row(sid, g)), f"sequence {sid} group {g}"
        for g in range(len(py.groups)):
            assert list(py.allocators[g].free_list()) == cc.free_list(g, Tier.PRIMARY), f"step {self.steps}: free"
            assert list(py.host_allocators[g].free_list()) == cc.free_list(g, Tier.SECONDARY), f"step {self.steps}"
            if py.prefix is not None:
                assert sorted(py.prefix[g].cached_blocks()) == cc.cached_blocks(g)
        cc.validate()
        s, t = self.py.scheduler.stats, self.cc.stats()
        assert (s.steps, s.preemptions, s.swaps_out, s.swaps_in, s.prefix_tokens_reused) == \
               (t.steps, t.preemptions, t.swaps_out, t.swaps_in, t.prefix_tokens_reused), f"step {self.steps}: stats"
        sch = self.py.scheduler
        assert (len(sch.waiting), len(sch.running), len(sch.swapped)) == (t.waiting, t.running, t.swapped)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_cpp_engine_matches_python_engine_step_for_step(config):
    pair = Pair(config, seed=sorted(CONFIGS).index(config) + 11)
    assert pair.py.max_model_len == pair.cc.stats().max_model_len
    arrivals = 70
    while pair.next_id < arrivals or pair.py.has_unfinished:
        if pair.next_id < arrivals and pair.rng.random() < 0.45:
            for _ in range(int(pair.rng.integers(1, 4))):
                pair.add()
        if pair.rng.random() < 0.04:
            pair.abort()
        pair.step()
        pair.check_state()
        assert pair.steps < 3000, "the engines did not drain the trace"
    stats = pair.py.scheduler.stats
    assert stats.steps > 50
    if config in ("prefix-recompute", "windows"):
        assert stats.preemptions > 0, "the trace never preempted: make the pool smaller"
    if config == "swap":
        assert stats.swaps_out > 0 and stats.swaps_in > 0 and stats.preemptions > 0
    if pair.ex.manager.prefix is not None:
        assert stats.prefix_tokens_reused > 0
    for g in range(len(pair.ex.manager.groups)):  # everything back in the pool
        assert pair.cc.kv.num_free(g) == pair.ex.manager.num_blocks[g]
    pair.cc.close()


def test_cpp_engine_refuses_what_the_python_engine_refuses():
    pair = Pair("prefix-recompute", seed=3)
    cases = [([], SamplingParams()), ([1, 2], SamplingParams(logprobs=TOP + 1)), ([1] * 120, SamplingParams()),
             ([1, 2], SamplingParams(max_new_tokens=None))]
    for i, (prompt, params) in enumerate(cases):
        a = outcome(lambda: pair.py.add_request(i, prompt, params) and None)
        b = outcome(lambda: pair.cc.add_request(i, prompt, params))
        assert a == b
    assert pair.py.requests[3].max_tokens == pair.cc.request(3).max_tokens
    a = outcome(lambda: pair.py.add_request(3, [1], SamplingParams()))
    assert a == outcome(lambda: pair.cc.add_request(3, [1], SamplingParams())) and a[0] == "error"
    with pytest.raises(ContextLengthError, match="exceed the context limit"):
        pair.cc.add_request(9, [1] * 200, SamplingParams())
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        pair.cc.add_request(10, [1], SamplingParams(stop=("x",)))


def test_closing_the_engine_closes_its_kv_view_and_a_closed_engine_refuses_calls():
    eng = native.NativeEngine([PoolGroup("g", KVLayout(1, 1, 4, 1))], 8, vocab=VOCAB)
    kv = eng.kv
    assert eng.kv is kv and kv.num_free(0) == 8
    eng.add_request(1, [3, 4, 5], SamplingParams(max_new_tokens=2))
    with eng:
        assert eng.begin_step() is not None
    eng.close()  # a second close does nothing
    with pytest.raises(ValueError, match="^engine: null pointer$"):
        eng.add_request(2, [3], SamplingParams())
    with pytest.raises(ValueError, match="^engine: null pointer$"):
        eng.kv
    with pytest.raises(ValueError, match="^manager: null pointer$"):  # the view went with the engine
        kv.num_free(0)


def test_sampling_draws_equal_python_bit_for_bit():
    rng = np.random.default_rng(0)
    seeds = np.concatenate([rng.integers(0, 2 ** 63, 5000, dtype=np.uint64) * np.uint64(2) + np.uint64(1),
                            np.array([0, 1, 2 ** 64 - 1], np.uint64)])
    counters = np.concatenate([rng.integers(0, 10 ** 6, seeds.size - 3, dtype=np.uint64),
                               np.array([0, 2 ** 64 - 1, 12345], np.uint64)])
    u, column = native.uniforms(seeds, counters)
    want = py_uniforms(seeds, counters)
    assert u.tobytes() == want.tobytes()
    assert column.tobytes() == np.minimum(want, U_MAX).astype(np.float32).tobytes()
    assert column.max() < 1.0
    index = np.arange(300, dtype=np.uint64)
    for base in (0, 7, 2 ** 64 - 1):
        assert native.derive_seeds(base, index).tolist() == [derive_seed(base, int(i)) for i in index]


@pytest.mark.parametrize("layout", [KVLayout(3, 2, 16, 64), KVLayout(2, 3, 5, 8, page_layout=PageLayout.NHD),
                                    KVLayout(1, 1, 1, 64), KVLayout(4, 2, 12, 16, ring_sink_tokens=3, cyclic_len=24)],
                         ids=["hnd", "nhd-odd-page", "page-1", "ring"])
@pytest.mark.parametrize("dtype", [CacheDType.FP16, CacheDType.FP8_E4M3])
def test_copy_plan_equals_python(layout, dtype):
    group = PoolGroup("g", layout, cache_dtype=dtype, window=layout.cyclic_len,
                      attention_sinks=layout.ring_sink_tokens if layout.cyclic_len else 0)
    for n in range(-1, layout.page_size + 1):
        plan = copy_plan(layout, dtype.itemsize, n)
        assert native.copy_plan(group, n) == (plan.rows, plan.pitch, plan.width), n
    with pytest.raises(ValueError, match=f"exceeds page_size={layout.page_size}"):
        native.copy_plan(group, layout.page_size + 1)
    with pytest.raises(ValueError, match="exceeds page_size"):
        copy_plan(layout, dtype.itemsize, layout.page_size + 1)


def test_python_engine_survives_a_step_that_samples_nothing_after_a_finish():
    """A regression the differential test found in the Python engine: a step of prefill chunks short of their
    prompts' ends right after a step that finished a request read the finished rows' stop limits."""
    ex = RecordingExecutor([P4], [40], [0], False, False, None)
    engine = Engine(ex, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6, chunk_size=4), eos_token_ids=EOS)
    engine.add_request(0, [1, 2], SamplingParams(max_new_tokens=1))
    engine.add_request(1, list(range(1, 21)), SamplingParams(max_new_tokens=2))
    assert [r.id for r in engine.step()] == [0] and engine.requests.keys() == {1}  # 0 done; 1 prefilled 4 of 20
    assert engine.step() == []  # 1's second chunk: nothing sampled
    engine.run()
    assert len(ex.feeds) == 6 and engine.scheduler.stats.steps == 6  # 4 more chunks, then one decode
