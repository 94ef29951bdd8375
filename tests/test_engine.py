"""The engine and its scheduler on a synthetic decoder (reference executor, CPU).

Every batched, chunked, preempted or prefix-sharing run must give each request exactly the greedy tokens it
gets alone (one request in a fresh engine, whole-prompt prefill): the schedule may change when tokens are
computed, never what they are. The engine's own greedy tokens equal the original graph's
(``DenseSession``, dense past KV). Along the way: steps respect the token budget and the sequence limit and
put decodes first, the KV validator is clean after every step, aborts free blocks at once, the context limit
is an error naming the numbers, and generation stops at EOS / stop tokens / stop strings / max_new_tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from runtime_support import SMALL, needs_tokenizers, random_prompts, synthetic_rewritten, tokenizer_dir

from pagedkv.runtime import (ContextLengthError, DenseSession, Engine, OrtExecutor, SamplingParams, SchedulerConfig,
                             StepInputs)
from pagedkv.runtime.executor import last_token_rows, pad_decode_step
from pagedkv.runtime.loop import generate_greedy
from pagedkv.onnx_export.synthetic import make_synthetic_model

GREEDY8 = SamplingParams(max_new_tokens=8)


def _executor(num_blocks=256, **kw):
    return OrtExecutor(synthetic_rewritten(SMALL, **kw.pop("options", {})), num_blocks=num_blocks,
                       manager_kwargs=kw)


def _alone(prompts, params=GREEDY8) -> list[list[int]]:
    """Each prompt alone in a fresh engine, whole prompt in one step."""
    out = []
    for p in prompts:
        with _executor() as ex:
            engine = Engine(ex, SchedulerConfig(chunk_size=0))
            r = engine.add_request("x", p, params)
            engine.run()
            out.append(r.output)
    return out


class StepLog:
    """Observes the executor's steps (sizes, entry order) around the real ``execute``."""

    def __init__(self, executor):
        self.steps = []
        run = executor.execute

        def execute(inputs):
            b = inputs.batch
            self.steps.append((b.num_seqs, b.num_tokens, b.q_lens.tolist()))
            return run(inputs)

        executor.execute = execute


def _check_decode_ids(engine) -> list[bool]:
    """Check every plan's ``decode_ids`` (what the engine's batched KV calls take) against its decodes: their ids
    in order, or None after one was preempted. Returns, per plan without them, whether it had decodes."""
    schedule, dropped = engine.scheduler.schedule, []

    def checked():
        plan = schedule()
        if plan.decode_ids is None:
            dropped.append(bool(plan.decodes))
        else:
            assert plan.decode_ids == tuple(r.id for r in plan.decodes)
        return plan

    engine.scheduler.schedule = checked
    return dropped


def _run(engine, manager) -> None:
    """Step to the end, the KV validator after every step."""
    while engine.has_unfinished:
        engine.step()
        manager.validate()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(np.random.default_rng(0), [5, 17, 33, 12, 26, 9, 40, 3], SMALL.vocab)


@pytest.fixture(scope="module")
def alone(prompts):
    return _alone(prompts)


def test_greedy_tokens_equal_the_original_graph(prompts, alone):
    dense = generate_greedy(DenseSession(make_synthetic_model(SMALL)), prompts, max_new_tokens=8)
    assert alone == dense


@pytest.mark.parametrize("chunk,budget,seqs", [(0, 2048, 64), (8, 24, 4), (5, 16, 3)],
                         ids=["whole-prompts", "chunk8-budget24-seqs4", "chunk5-budget16-seqs3"])
def test_batched_and_chunked_equal_alone(prompts, alone, chunk, budget, seqs):
    with _executor(debug_validate=False) as ex:
        log = StepLog(ex)
        engine = Engine(ex, SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, chunk_size=chunk))
        reqs = [engine.add_request(i, p, GREEDY8) for i, p in enumerate(prompts)]
        _run(engine, ex.manager)
        assert [r.output for r in reqs] == alone
        assert all(r.finish_reason.value == "length" for r in reqs)
        assert not ex.manager.sequences and ex.manager.num_free(0) == ex.manager.num_blocks[0]
    for num_seqs, num_tokens, q_lens in log.steps:
        assert num_seqs <= seqs and num_tokens <= budget
        decodes = [q == 1 for q in q_lens]
        assert decodes == sorted(decodes, reverse=True), f"decodes must come first: {q_lens}"
        if chunk:
            assert max(q_lens) <= chunk
    mixed = [q for _, _, q in log.steps if 1 in q and max(q) > 1]
    assert mixed or not chunk, "no step mixed prefill chunks with decodes"


def test_requests_arriving_mid_stream_equal_alone(prompts, alone):
    arrivals = {0: [0, 1], 3: [2, 3, 4], 7: [5, 6, 7]}
    with _executor(debug_validate=True) as ex:
        engine = Engine(ex, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, chunk_size=8))
        got, step = {}, 0
        while step <= max(arrivals) or engine.has_unfinished:
            for i in arrivals.get(step, []):
                got[i] = engine.add_request(i, prompts[i], GREEDY8)
                assert got[i].state.value == "waiting"
            engine.step()
            step += 1
        assert got[2].arrival > got[1].arrival and not ex.manager.sequences
    assert [got[i].output for i in range(len(prompts))] == alone


def test_shared_prefix_skips_its_prefill_and_changes_nothing():
    rng = np.random.default_rng(1)
    head = rng.integers(0, SMALL.vocab, 40)
    prompts = [np.concatenate([head, rng.integers(0, SMALL.vocab, n)]) for n in (3, 11, 1, 20)]
    expect = _alone(prompts)
    with _executor(enable_prefix_reuse=True, debug_validate=True) as ex:
        log = StepLog(ex)
        engine = Engine(ex, SchedulerConfig(max_num_seqs=8, chunk_size=16))
        first = engine.add_request(0, prompts[0], GREEDY8)
        engine.run()  # the prefix is now cached (full 16-token pages: 32 of its 40 tokens)
        others = [engine.add_request(i, p, GREEDY8) for i, p in enumerate(prompts[1:], 1)]
        _run(engine, ex.manager)
        assert engine.scheduler.stats.prefix_tokens_reused == 3 * 32
    assert [first.output] + [r.output for r in others] == expect
    prefilled = sum(t for _, t, _ in log.steps)
    assert prefilled < sum(len(p) for p in prompts) + 4 * 8 - 3 * 32 + 1


@pytest.mark.parametrize("policy,host_blocks", [("recompute", 0), ("swap", 64), ("swap", 3)],
                         ids=["recompute", "swap", "swap-host-tier-full"])
def test_preemption_under_pool_pressure_changes_nothing(prompts, policy, host_blocks):
    params = SamplingParams(max_new_tokens=24)
    expect = _alone(prompts, params)
    with _executor(num_blocks=9, host_blocks=host_blocks, debug_validate=True) as ex:
        engine = Engine(ex, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, chunk_size=16,
                                            preemption=policy))
        reqs = [engine.add_request(i, p, params) for i, p in enumerate(prompts)]
        dropped = _check_decode_ids(engine)
        _run(engine, ex.manager)
        stats = engine.scheduler.stats
        assert [r.output for r in reqs] == expect
        mgr = ex.manager
        assert not mgr.sequences and mgr.num_free(0) == 9 and mgr.host_allocators[0].num_free == host_blocks
    if policy == "recompute" or host_blocks < 4:
        assert stats.preemptions > 0
        assert any(dropped), "no decode was preempted after its reservation: the decode_ids reset went untested"
    if policy == "swap":
        assert stats.swaps_out > 0 and stats.swaps_in == stats.swaps_out


def test_a_step_of_unfinished_prefill_chunks_samples_nothing(prompts, alone):
    """After a request finishes, a step that holds only prefill chunks short of their prompt's end runs one
    placeholder row: nobody takes its token, and the finished request's sampling rows are not read again."""
    with _executor(num_blocks=64) as ex:
        engine = Engine(ex, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, chunk_size=8))
        short = engine.add_request("short", prompts[7], SamplingParams(max_new_tokens=2))  # 3 tokens: done in step 2
        long = engine.add_request("long", prompts[6], GREEDY8)  # 40 tokens: chunks only in steps 3-5
        engine.step()
        engine.step()
        assert short.finished and len(short.output) == 2
        assert engine.step() == [] and long.output == []
        engine.run()
        ex.manager.validate()
    assert short.output == alone[7][:2] and long.output == alone[6]


def test_abort_frees_blocks_at_once(prompts):
    with _executor(num_blocks=64, host_blocks=16) as ex:
        mgr = ex.manager
        engine = Engine(ex, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, chunk_size=8))
        running = engine.add_request("run", prompts[6], GREEDY8)
        waiting = [engine.add_request(f"w{i}", p, GREEDY8) for i, p in enumerate(prompts[:3])]
        engine.step()
        held = mgr.num_blocks[0] - mgr.num_free(0)
        assert held > 0 and "run" in mgr
        assert engine.abort("run") is running
        assert "run" not in mgr and mgr.num_blocks[0] - mgr.num_free(0) < held
        assert running.finish_reason.value == "abort" and running.finished
        assert engine.abort("w2") is waiting[2] and engine.abort("w2") is None and engine.abort("nope") is None
        engine.step()
        mgr.swap_out(waiting[0].id)  # a swapped request: its host blocks come back too
        engine.scheduler.running.remove(waiting[0])
        waiting[0].state = waiting[0].state.SWAPPED
        engine.scheduler.swapped.append(waiting[0])
        assert mgr.host_allocators[0].num_free < 16
        engine.abort(waiting[0].id)
        assert mgr.host_allocators[0].num_free == 16
        engine.run()
        mgr.validate()
        assert not mgr.sequences and mgr.num_free(0) == 64


def test_context_limit_is_enforced_with_a_clear_error():
    with _executor(num_blocks=8) as ex:  # 8 blocks of 16 tokens: 128 tokens at most
        engine = Engine(ex, max_model_len=100)
        assert engine.max_model_len == 100
        with pytest.raises(ContextLengthError, match=r"request 'a': prompt of 95 tokens \+ max_new_tokens 8 exceed "
                                                     r"the context limit of 100 tokens"):
            engine.add_request("a", np.ones(95, np.int64), GREEDY8)
        with pytest.raises(ContextLengthError, match="prompt of 100 tokens"):
            engine.add_request("b", np.ones(100, np.int64), SamplingParams(max_new_tokens=None))
        r = engine.add_request("c", np.ones(90, np.int64), SamplingParams(max_new_tokens=None))  # up to the limit
        engine.run()
        assert len(r.output) == 10 and r.finish_reason.value == "length"
        assert Engine(ex, max_model_len=10 ** 6).max_model_len == 128  # the pool's room bounds it
        for bad, match in (([], "prompt: it is empty"), ([3, 999], r"token 999 at position 1 is outside the "
                                                                   r"vocabulary \[0, 128\)"), ([0.5], "integers")):
            with pytest.raises(ValueError, match=match):
                engine.add_request("d", bad, GREEDY8)
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            engine.add_request("e", [1, 2], SamplingParams(stop=("x",)))
        engine.add_request("f", [1, 2], GREEDY8)
        with pytest.raises(ValueError, match="unfinished request has this id"):
            engine.add_request("f", [1, 2], GREEDY8)


def test_stop_tokens_eos_and_ignore_eos(prompts, alone):
    eos = alone[2][4]  # the fifth greedy token of prompt 2
    at = alone[2].index(eos)
    with _executor() as ex:
        engine = Engine(ex, eos_token_ids=(eos,))
        a = engine.add_request("eos", prompts[2], GREEDY8)
        b = engine.add_request("ignore", prompts[2], SamplingParams(max_new_tokens=8, ignore_eos=True))
        c = engine.add_request("stop-id", prompts[3], SamplingParams(max_new_tokens=8, stop_token_ids=(alone[3][1],)))
        engine.run()
    assert a.output == alone[2][:at + 1] and a.finish_reason.value == "stop"
    assert b.output == alone[2] and b.finish_reason.value == "length"
    assert c.output == alone[3][:alone[3].index(alone[3][1]) + 1] and c.finish_reason.value == "stop"


@needs_tokenizers
def test_stop_strings_cut_the_text(tmp_path):
    from pagedkv.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tokenizer_dir(tmp_path / "tok"))
    prompt = tok.encode("the quick brown fox")
    with _executor() as ex:
        full = Engine(ex, tokenizer=tok)
        r = full.add_request("full", prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
        full.run()
    text = r.text
    assert len(text) > 4, text
    stop = text[2:4]
    for include in (False, True):
        with _executor() as ex:
            engine = Engine(ex, tokenizer=tok)
            s = engine.add_request("s", prompt, SamplingParams(max_new_tokens=12, ignore_eos=True, stop=(stop, "zzzz"),
                                                               include_stop_str_in_output=include))
            engine.run()
        cut = text.index(stop) + (len(stop) if include else 0)
        assert s.text == text[:cut] and s.finish_reason.value == "stop"
        assert s.output == r.output[:len(s.output)] and len(s.output) < 12


def test_graph_without_sampling_head_samples_on_the_host(prompts):
    sp = [GREEDY8, SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.8, seed=5, logprobs=3)]
    outs = []
    for sampling in (True, False):
        with _executor(options={"sampling": sampling}) as ex:
            assert ex.graph.sampling == sampling
            engine = Engine(ex)
            reqs = [engine.add_request(i, prompts[i], p) for i, p in enumerate(sp)]
            engine.run()
            outs.append([(r.output, [(lp.token, [t for t, _ in lp.top]) for lp in r.logprobs]) for r in reqs])
    assert outs[0] == outs[1]


def test_a_padded_decode_step_gives_the_same_rows(prompts):
    """What CUDA-graph buckets feed an engine (``pad_decode_step``), checked on the reference executor."""
    with _executor() as ex:
        mgr = ex.manager
        for i in range(3):
            ex.step([(i, prompts[i])])
        for i in range(3):
            mgr.reserve(i, 1)
        batch = mgr.build_step_many([0, 1, 2], 1)
        inputs = StepInputs(batch, np.array([5, 6, 7]), last_token_rows(batch.cu_q_lens), want_logits=True)
        plain = ex.execute(inputs)
        pad_rows = ex.pad_blocks(20)  # 17 padding rows: two pages of the pad sequence
        padded = pad_decode_step(inputs, batch=20, width=batch.meta(0).max_blocks + 3, pad_rows=pad_rows)
        assert padded.batch.num_seqs == 20 and padded.batch.meta(0).block_table.shape[1] == batch.meta(0).max_blocks + 3
        out = ex.execute(padded)
        np.testing.assert_array_equal(out.logits[:3], plain.logits)
        assert np.isfinite(out.logits).all()  # padding rows read only what they wrote
        with pytest.raises(ValueError, match="batch 2 < the step's 3 sequences"):
            pad_decode_step(inputs, batch=2, width=8, pad_rows=pad_rows)
