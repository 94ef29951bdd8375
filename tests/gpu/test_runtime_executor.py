"""The C++ runtime's own device executor runs a model made of the two plugins, over continuous-batching traces.

``pagedkv_testhost run-engine`` builds a ``pagedkv::runtime::Engine`` (scheduler, KV manager with prefix reuse,
step builder) over the test host's ``PluginsExecutor``: a ``DeviceExecutor`` — the runtime's NaN-poisoned device
pools, its pinned staging of the step inputs uploaded in one copy, decode steps padded to buckets and replayed as
CUDA graphs, the KV manager's block copies (swap out / in, copy-on-write) on the device — whose model is, per
layer, the QKV-write plugin then the attention plugin, created, configured over the executor's limits,
serialized, deserialized and attached through IPluginV3 as an engine does, and enqueued on the executor's stream.
The model's QKV rows and sampling head are those of test_runtime_plugins.py; the executor dumps every step's engine
inputs (before padding) and each layer's q and attention output.

Checked at every step: each row's input token is the request's known token at that position, q is the float64
rotated query, every attention output row equals float64 dense attention over K/V rebuilt from the request's whole
token history with no paging — so a wrong block table, a swapped-in block with the wrong contents, a padding row
that wrote a request's slot or a graph replay with stale addresses shows up as a mismatch — and each sampled token
is the sampling head's pick of the row that produced it. At the end: every request finished with its tokens, the
KV manager's validator ran after every step, no block is leaked, and the trace went through what it is meant to
exercise (graph captures and replays, swaps, recompute preemptions, prefix reuse).
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from test_plugins_enqueue import HOST_TIMEOUT_S, exact_qkv, host  # noqa: F401  (host: the fixture)
from test_runtime_plugins import (ATTN, HEAD_DIM, HEADS, IO, LAYERS, MAX_NEW, MAX_POS, POSITION_ROWS, PREFIX,
                                  PROMPTS, TOKEN_ROWS, VOCAB, WIDTH, WRITE, expected_attention, qkv_rows)

from pagedkv.tolerances import TOLERANCES

pytestmark = pytest.mark.gpu

LIMITS = {"max_tokens": 32, "max_seqs": 4, "max_blocks": 8}
SCHEDULER = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "chunk_size": 16}

# {id: (arrival step, prompt, max_new_tokens)}: test_runtime_plugins' six requests (shared prefix, a repeated
# prompt, arrivals mid-stream), and ten longer ones arriving every other step (every third shares the prefix)
# that a pool of 8 usable blocks cannot hold at once.
LIGHT = {rid: (arrival, prompt, MAX_NEW) for rid, (arrival, prompt) in PROMPTS.items()}
_rng = np.random.default_rng(17)
HEAVY = {}
for _i in range(10):
    _n = int(_rng.integers(12, 50))
    _prompt = [int(t) for t in _rng.integers(0, VOCAB, _n)]
    HEAVY[10 + _i] = (2 * _i, PREFIX[:32] + _prompt[:_n // 2] if _i % 3 == 0 else _prompt, int(_rng.integers(8, 20)))

# name: (requests, device blocks, host blocks, preemption, CUDA graphs, what the trace must have gone through).
# With CUDA graphs the executor's padding sequence holds one block, so "swap" has 8 usable blocks like
# "recompute-eager" (the C++ scheduler, run on these traces without a device, swaps 5 times / preempts 5 times).
TRACES = {
    "graphs": (LIGHT, 48, 0, "recompute", True, {"replays", "captures", "prefix_reuse"}),
    "swap": (HEAVY, 9, 24, "swap", True, {"replays", "captures", "swaps", "prefix_reuse"}),
    "recompute-eager": (HEAVY, 8, 0, "recompute", False, {"preemptions", "prefix_reuse"}),
}


def run_engine(host, tmp_path, requests, num_blocks, host_blocks, preemption, graphs):
    exe, lib = host
    (tmp_path / "tok.bin").write_bytes(np.ascontiguousarray(TOKEN_ROWS, np.float32).tobytes())
    (tmp_path / "pos.bin").write_bytes(np.ascontiguousarray(POSITION_ROWS, np.float32).tobytes())
    attrs = WRITE[0].to_attributes()
    plan = {
        "model": {"layers": LAYERS, "vocab": VOCAB, "qkv_width": WIDTH, "max_position": MAX_POS, "io_type": "kHALF",
                  "token_rows": "tok.bin", "position_rows": "pos.bin",
                  "write_attrs": [w.to_attributes() for w in WRITE],
                  "attention_attrs": [a.to_attributes() for a in ATTN]},
        "group": {k: attrs[k] for k in ("num_layers", "num_kv_heads", "page_size", "head_dim", "page_layout",
                                        "cache_dtype")},
        "num_blocks": num_blocks, "host_blocks": host_blocks, "prefix_reuse": True, "cuda_graphs": graphs,
        "limits": LIMITS, "scheduler": {**SCHEDULER, "preemption": preemption},
        "requests": [{"id": rid, "arrival": arrival, "prompt": prompt, "max_new_tokens": max_new}
                     for rid, (arrival, prompt, max_new) in requests.items()],
        "max_steps": 400,
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([exe, "run-engine", "--lib", lib, "--plan", str(tmp_path / "plan.json"), "--out", str(out)],
                          capture_output=True, text=True, timeout=HOST_TIMEOUT_S)
    if proc.returncode < 0:
        pytest.fail(f"the test host crashed (signal {-proc.returncode}): {proc.stderr}")
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"], report.get("error")
    return report, out


def load(step_dir, name, dtype, shape=(-1,)):
    return np.fromfile(step_dir / f"{name}.bin", dtype=dtype).reshape(shape)


@pytest.mark.parametrize("trace", list(TRACES))
def test_device_executor_runs_the_plugins_over_continuous_batching(host, tmp_path, trace):
    requests, num_blocks, host_blocks, preemption, graphs, exercised = TRACES[trace]
    report, out = run_engine(host, tmp_path, requests, num_blocks, host_blocks, preemption, graphs)
    outputs = {int(rid): r["output"] for rid, r in report["requests"].items()}
    assert sorted(outputs) == sorted(requests)
    full = {rid: list(prompt) + outputs[rid] for rid, (_, prompt, _) in requests.items()}
    sampled = {rid: 0 for rid in requests}  # output tokens checked so far
    atol, rtol = TOLERANCES[IO.name]
    for meta in report["steps"]:
        d = out / f"step{meta['step']}"
        ids = load(d, "input_ids", np.int64)
        cu, past = load(d, "cu_q_lens", np.int32), load(d, "past_lens", np.int32)
        assert ids.size == meta["num_tokens"] == cu[-1] and past.size == len(meta["request_ids"])
        pos = np.concatenate([past[b] + np.arange(cu[b + 1] - cu[b]) for b in range(past.size)])
        for layer in range(LAYERS):
            q = load(d, f"q{layer}", np.float16, (ids.size, HEADS, HEAD_DIM)).astype(np.float64)
            o = load(d, f"out{layer}", np.float16, (ids.size, HEADS, HEAD_DIM)).astype(np.float64)
            exact_q, _, _ = exact_qkv(WRITE[layer], qkv_rows(layer, ids, pos), None, pos)
            np.testing.assert_allclose(q, exact_q, atol=atol, rtol=rtol, err_msg=f"step {meta['step']} q{layer}")
            for b, rid in enumerate(meta["request_ids"]):
                rows = np.arange(cu[b], cu[b + 1])
                assert ids[rows].tolist() == full[rid][pos[rows[0]]:pos[rows[-1]] + 1], (meta, rid)
                expected = expected_attention(layer, full[rid], q[rows], pos[rows])
                np.testing.assert_allclose(o[rows], expected, atol=atol, rtol=rtol,
                                           err_msg=f"{trace}: step {meta['step']}, request {rid}, layer {layer}")
        for b, rid in enumerate(meta["request_ids"]):  # a row that reached the known end sampled the next token
            last = cu[b + 1] - 1
            if pos[last] == len(requests[rid][1]) + sampled[rid] - 1:
                assert outputs[rid][sampled[rid]] == (ids[last] * 7 + last * 3 + 5) % VOCAB, (meta, rid)
                sampled[rid] += 1
    assert sampled == {rid: max_new for rid, (_, _, max_new) in requests.items()}, sampled

    kv, stats, steps = report["kv"], report["stats"], report["steps"]
    assert kv["num_free"] == kv["num_blocks"] - kv["held_by_executor"], kv  # nothing leaked
    assert kv["host_free"] == kv["host_blocks"], kv
    replays = sum(s["decode_only"] and s["enqueues"] == 0 for s in steps)
    captures = sum(s["decode_only"] and s["enqueues"] == 2 for s in steps)
    if graphs:
        assert report["graphs_off"] == "" and report["graphs"] == captures and kv["held_by_executor"] >= 1, report
    else:
        assert report["graphs"] == 0 and "turned off" in report["graphs_off"]
        assert all(s["enqueues"] == 1 for s in steps)
    seen = {"replays": replays > 0, "captures": captures > 0, "prefix_reuse": stats["prefix_tokens_reused"] >= 32,
            "swaps": stats["swaps_out"] > 0 and stats["swaps_in"] > 0, "preemptions": stats["preemptions"] > 0}
    assert all(seen[what] for what in exercised), (seen, stats, replays, captures)
