"""Soak: 10^4 requests through one engine with random arrivals, prompt and output lengths, shared prefixes,
EOS stops, aborts, and a pool so small that preemption (swap, falling back to recompute when the host tier is
full) happens all the time. Every completed request's greedy tokens must equal that request run alone; the KV
validator must be clean after every step; at the end no block is held (0 leaked, both tiers); no step may pass
without progress (no deadlock); and memory stays bounded: the engine keeps no finished request, the manager no
copy log, and the number of live Python objects does not grow over the second half of the run.

Kept fast with a 1-layer synthetic decoder (``runtime_support.TINY``, vocab 64, 4-token pages) and 300 unique
prompts whose alone results are computed once (greedy output of the longest length asked for: a shorter
request's tokens are its prefix). Most of the time goes to the float64 reference attention and write (per
sequence, per step). Marked ``slow`` (about two minutes on the 2-core CI machine); CI runs it.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from runtime_support import TINY, synthetic_rewritten

from pagedkv.runtime import Engine, OrtExecutor, SamplingParams, SchedulerConfig

REQUESTS = 10_000
UNIQUE = 300
MAX_NEW = 12
EOS = 7
OPTIONS = dict(page_size=4, top_logprobs=1, sampling_candidates=64)


def _unique_prompts(rng):
    shared = rng.integers(0, TINY.vocab, 12)
    prompts = []
    for i in range(UNIQUE):
        tail = rng.integers(0, TINY.vocab, int(rng.integers(1, 24)))
        prompts.append(np.concatenate([shared, tail]) if i % 3 == 0 else tail)
    return prompts


def _alone(prompts) -> list[list[int]]:
    with OrtExecutor(synthetic_rewritten(TINY, **OPTIONS), num_blocks=64) as ex:
        engine = Engine(ex, SchedulerConfig(chunk_size=0), eos_token_ids=(EOS,))
        out = []
        for p in prompts:
            r = engine.add_request("alone", p, SamplingParams(max_new_tokens=MAX_NEW))
            engine.run()
            out.append(r.output)
    return out


@pytest.mark.slow
def test_soak_ten_thousand_requests():
    rng = np.random.default_rng(2026)
    prompts = _unique_prompts(rng)
    alone = _alone(prompts)
    num_blocks, host_blocks = 40, 12
    ex = OrtExecutor(synthetic_rewritten(TINY, **OPTIONS), num_blocks=num_blocks,
                     manager_kwargs={"host_blocks": host_blocks, "enable_prefix_reuse": True})
    mgr = ex.manager
    engine = Engine(ex, SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, chunk_size=16,
                                        preemption="swap"), eos_token_ids=(EOS,))
    live: dict[int, tuple] = {}  # request id -> (request, unique prompt, max_new_tokens)
    done = aborted = submitted = steps = idle = 0
    objects = {}
    while submitted < REQUESTS or engine.has_unfinished:
        for _ in range(int(rng.poisson(2.0))):
            if submitted < REQUESTS:
                k, n = int(rng.integers(UNIQUE)), int(rng.integers(1, MAX_NEW + 1))
                live[submitted] = (engine.add_request(submitted, prompts[k], SamplingParams(max_new_tokens=n)), k, n)
                submitted += 1
        if live and rng.random() < 0.08:
            victim = int(rng.choice(list(live)))
            r, _, _ = live.pop(victim)
            assert engine.abort(victim) is r and victim not in mgr  # its blocks are free at once
            aborted += 1
        progressed = engine.step()
        steps += 1
        mgr.validate()
        assert not mgr.copy_log
        idle = 0 if progressed or not engine.has_unfinished else idle + 1
        assert idle < 50, f"no request progressed for {idle} steps: deadlock ({engine.scheduler.stats})"
        for rid in [rid for rid, (r, _, _) in live.items() if r.finished]:
            r, k, n = live.pop(rid)
            expect = alone[k][:n]
            if EOS in expect:
                expect = expect[:expect.index(EOS) + 1]
            assert r.output == expect, f"request {rid} (prompt {k}, {n} tokens): {r.output} != alone {expect}"
            assert r.finish_reason.value == ("stop" if expect[-1] == EOS else "length")
            done += 1
        if submitted >= REQUESTS // 2 and "half" not in objects:
            gc.collect()
            objects["half"] = (len(gc.get_objects()), len(live))
    gc.collect()
    objects["end"] = (len(gc.get_objects()), len(live))
    stats = engine.scheduler.stats
    print(f"soak: {done} completed, {aborted} aborted, {steps} steps, {stats}, live Python objects "
          f"{objects['half'][0]} at half time ({objects['half'][1]} requests in flight), {objects['end'][0]} at the end")
    assert done + aborted == REQUESTS and not live and not engine.requests
    assert stats.swaps_out > 100 and stats.preemptions > 20 and stats.prefix_tokens_reused > 0
    assert not mgr.sequences and mgr.num_free(0) == num_blocks and mgr.host_allocators[0].num_free == host_blocks
    assert objects["end"][0] <= objects["half"][0] + 500, objects  # nothing accumulates per request
    ex.close()
