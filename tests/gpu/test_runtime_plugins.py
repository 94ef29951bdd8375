"""The C++ runtime drives a model made of the two plugins alone, over many continuous-batching steps.

The C++ engine (``pagedkv.runtime.native.NativeEngine``: the C++ scheduler, KV manager with prefix reuse and
step-metadata builder) schedules every step: arrivals mid-stream, chunked prefill mixed with decodes, prompts
sharing a prefix (later requests reuse its cached blocks) and a repeated prompt. Each step then runs the model —
per layer the QKV-write plugin then the attention plugin, enqueued through IPluginV3 by ``pagedkv_testhost
enqueue`` exactly as an engine would — on the step's engine inputs as the C++ engine wrote them, over one
NaN-poisoned device pool (guard zones around it) carried from step to step. The "model": a token's QKV row of
layer l is a fixed random function of (token id, position, l), so that K/V of a reused prefix block are what the
request would have written itself; the sampled token is a function of the row's last input token.

Checked at every step: the engine's input ids are the request's known tokens, every layer's kv_write_status is
clean, the guards are intact, and every attention output row equals float64 dense attention
(``pagedkv.reference.dense_attention``) over K/V rebuilt from the request's whole token history with no paging
at all — so a wrong block table, a reused block with the wrong contents or a stale page shows up as a mismatch.
The runtime's own ``DeviceExecutor`` (its pools, staged upload, block copies and CUDA graphs) drives the same model
in test_runtime_executor.py; TensorRT is not covered (none here).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_plugins_enqueue import (IO_DTYPES, Plan, add_pools, assert_steps_ok, exact_qkv, host,  # noqa: F401  (host: the fixture)
                                  new_pool, pool_from_dump)

from pagedkv import engine_io as io
from pagedkv.config import ATTENTION_PLUGIN_NAME, WRITE_PLUGIN_NAME, AttentionConfig, WriteConfig
from pagedkv.kvcache import PoolGroup
from pagedkv.layout import CacheDType, KVLayout
from pagedkv.reference import dense_attention, dequantize, quantize
from pagedkv.runtime.sampling import SamplingParams
from pagedkv.runtime.scheduler import SchedulerConfig
from pagedkv.step import STATUS_FIELDS
from pagedkv.tolerances import TOLERANCES

pytestmark = pytest.mark.gpu

LAYERS, HEADS, KV_HEADS, HEAD_DIM, PAGE = 2, 4, 2, 64, 16
VOCAB, MAX_POS, NUM_BLOCKS = 101, 256, 48
IO = IO_DTYPES["fp16"]
WIDTH = (HEADS + 2 * KV_HEADS) * HEAD_DIM
GROUP = PoolGroup("g0", KVLayout(LAYERS, KV_HEADS, PAGE, HEAD_DIM), cache_dtype=CacheDType.FP16)
WRITE = [WriteConfig(num_q_heads=HEADS, pool=GROUP.pool_config(layer, 0)) for layer in range(LAYERS)]
ATTN = [AttentionConfig(num_q_heads=HEADS, pool=w.pool) for w in WRITE]

_rng = np.random.default_rng(16)
TOKEN_ROWS = (0.5 * _rng.standard_normal((LAYERS, VOCAB, WIDTH))).astype(np.float32)
POSITION_ROWS = (0.5 * _rng.standard_normal((LAYERS, MAX_POS, WIDTH))).astype(np.float32)


def qkv_rows(layer: int, tokens, positions) -> np.ndarray:
    """The model's QKV input [n, WIDTH] (fp16) of these tokens at these positions."""
    return (TOKEN_ROWS[layer, tokens] + POSITION_ROWS[layer, positions]).astype(IO)


def sampled(feed) -> np.ndarray:
    """The "sampling head": one token per logits row from the row's last input token and its position."""
    rows = feed[io.LOGITS_ROWS]
    ids = feed[io.INPUT_IDS].reshape(-1)
    return ((ids[rows] * 7 + rows * 3 + 5) % VOCAB).astype(np.int32)


def positions_of(feed) -> np.ndarray:
    cu, past = feed[io.CU_Q_LENS], feed[io.PAST_LENS]
    return np.concatenate([past[b] + np.arange(cu[b + 1] - cu[b]) for b in range(past.size)]).astype(np.int64)


def expected_attention(layer: int, history, q_rows, q_pos) -> np.ndarray:
    """float64 dense attention of the step's queries over the request's K/V of positions 0..q_pos[-1]."""
    pos = np.arange(q_pos[-1] + 1)
    _, k, v = exact_qkv(WRITE[layer], qkv_rows(layer, np.asarray(history[:pos.size]), pos), None, pos)
    cache = CacheDType.FP16
    k = dequantize(quantize(k, cache, 1.0), cache, 1.0)  # stored as fp16
    v = dequantize(quantize(v, cache, 1.0), cache, 1.0)
    return dense_attention(q_rows, k, v, q_pos, pos, softmax_scale=ATTN[layer].resolved_softmax_scale)


PREFIX = [int(t) for t in np.random.default_rng(1).integers(0, VOCAB, 40)]  # 2.5 pages, shared
PROMPTS = {  # id: (arrival step, prompt)
    1: (0, PREFIX + [3, 4, 5]),
    2: (0, [int(t) for t in np.random.default_rng(2).integers(0, VOCAB, 29)]),
    3: (2, PREFIX + [9] * 21),
    4: (4, PREFIX + [3, 4, 5]),  # the same prompt as 1
    5: (4, [7]),
    6: (7, PREFIX[:33]),
}
MAX_NEW = 7


def test_cpp_engine_drives_the_plugins_over_continuous_batching(host, tmp_path):
    from pagedkv.runtime.native import NativeEngine  # noqa: PLC0415  (needs libpagedkv_runtime)

    eng = NativeEngine([GROUP], NUM_BLOCKS, vocab=VOCAB, enable_prefix_reuse=True,
                       config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, chunk_size=16))
    pool = new_pool(GROUP.pool_config(0, 0), NUM_BLOCKS)
    known: dict[int, list[int]] = {}
    atol, rtol = TOLERANCES[IO.name]
    steps = mixed = decode_only = 0
    while steps < 200:
        for rid, (arrival, prompt) in PROMPTS.items():
            if arrival == steps:
                eng.add_request(rid, prompt, SamplingParams(max_new_tokens=MAX_NEW))
                known[rid] = list(prompt)
        step = eng.begin_step()
        if step is None:
            if all(arrival <= steps for arrival, _ in PROMPTS.values()):
                break
            steps += 1
            continue
        feed = step.feed
        ids, pos = feed[io.INPUT_IDS].reshape(-1), positions_of(feed)
        cu = feed[io.CU_Q_LENS]
        for b, rid in enumerate(step.request_ids):  # the engine feeds each request's own tokens
            assert ids[cu[b]:cu[b + 1]].tolist() == known[rid][pos[cu[b]]:pos[cu[b + 1] - 1] + 1], (steps, rid)
        mixed += int(0 < step.num_decodes < len(step.request_ids))
        decode_only += int(step.decode_only)

        plan = Plan(tmp_path / f"step{steps}")
        plan.dir.mkdir()
        add_pools(plan, GROUP.pool_config(0, 0), pool)
        plan.tensor("block_table", feed[io.block_table_name(0)])
        plan.tensor("cu_q_lens", cu)
        plan.tensor("past_lens", feed[io.PAST_LENS])
        for layer in range(LAYERS):
            plan.tensor(f"qkv{layer}", qkv_rows(layer, ids, pos))
            plan.step(WRITE_PLUGIN_NAME, WRITE[layer],
                      [f"qkv{layer}", "kv_pools", "block_table", "cu_q_lens", "past_lens"],
                      [f"q{layer}", f"status{layer}"])
            plan.step(ATTENTION_PLUGIN_NAME, ATTN[layer],
                      [f"q{layer}", "kv_pools", "block_table", "cu_q_lens", "past_lens", f"status{layer}"],
                      [f"out{layer}"])
        report, dumped = plan.run(host)
        assert_steps_ok(report)
        pool = pool_from_dump(dumped, plan, GROUP.pool_config(0, 0), pool).copy()
        for layer in range(LAYERS):
            assert dumped[f"status{layer}"].tolist() == [0] * STATUS_FIELDS, (steps, layer)
            q = dumped[f"q{layer}"].astype(np.float64).reshape(-1, HEADS, HEAD_DIM)
            out = dumped[f"out{layer}"].astype(np.float64).reshape(-1, HEADS, HEAD_DIM)
            for b, rid in enumerate(step.request_ids):
                rows = np.arange(cu[b], cu[b + 1])
                expected = expected_attention(layer, known[rid], q[rows], pos[rows])
                np.testing.assert_allclose(out[rows], expected, atol=atol, rtol=rtol,
                                           err_msg=f"step {steps}, request {rid}, layer {layer}")

        eng.end_step(sampled(feed))
        for rid in step.request_ids:
            known[rid] = list(PROMPTS[rid][1]) + eng.request(rid).output
        steps += 1

    assert sorted(eng.finished()) == sorted(PROMPTS)
    for rid, (_, prompt) in PROMPTS.items():
        r = eng.request(rid)
        assert len(r.output) == MAX_NEW, (rid, r)
        assert known[rid] == list(prompt) + r.output
    assert steps >= 15 and mixed > 0 and decode_only > 0, (steps, mixed, decode_only)
    assert eng.stats().prefix_tokens_reused >= 32  # requests 3, 4 and 6 reused the shared prefix's full pages
    eng.close()
