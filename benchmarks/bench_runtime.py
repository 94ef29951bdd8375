"""Host time of one decode step of the runtime (budget: resolve <= 0.5 ms, goal <= 0.2 ms per step at 64 and
256 running sequences; issue 15).

What one decode step costs the host, everything but the device's work: the scheduler (picking the decodes,
``reserve_many`` of their KV slots), the step metadata (``build_step_many``) and the engine inputs bound by
name (``Executor.feed``: input ids, block tables, logits rows), the sampling head's inputs (each request's
parameter row and its seeded uniform), and after the step ``commit_many``, the new tokens, stop checks and
frees. The device is stood in for by ``HostOnly``, an executor that returns a next token per row without
computing (its time is reported apart and is not host overhead); its graph is a ``RewrittenGraph`` of the
chosen model's KV geometry with no layers. Each sequence holds ``--context`` cached tokens (prompts prefilled
by the stand-in first), 16-token pages; the first page-boundary crossings, allocation and (with
``--prefix-reuse``) page hashing happen inside the timed steps as they would in a real run. The packing into
pinned memory a TensorRT step adds (one staging copy of the inputs) is measured too, with a numpy buffer in
place of pinned memory.

``--backend cuda`` (on a GPU) adds the device side of a decode step at the same sequence counts: the plugin
kernels of every layer (the QKV write, then the paged attention) on the KV manager's device pools and its step
metadata, launched eagerly (the C API's launchers called once per kernel from Python, parameters prepared, as a
plugin's ``enqueue`` calls them) and as one CUDA graph replaying the same launches (what ``TrtExecutor`` does for
decode steps). It reports the host time to issue a step, the device time per step back to back, and what the
graph saves. TensorRT is not needed: this is the kernels' part of a decode step, without the projections and
MLPs an engine adds around them. ``--device-context`` (default 1024) keeps 256 sequences of llama3-8b's cache
within an H200 (32 GiB).

Reproduce: python benchmarks/bench_runtime.py [--seqs 64,256 --context 4096 --steps 200 --prefix-reuse]
           python benchmarks/bench_runtime.py --backend cuda [--device-context 1024 --json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from pagedkv import engine_io
from pagedkv.kvcache import KVCacheManager, PoolGroup
from pagedkv.layout import KVLayout
from pagedkv.runtime.engine import Engine
from pagedkv.runtime.executor import Executor, StepOutputs
from pagedkv.runtime.graph import RewrittenGraph
from pagedkv.runtime.sampling import SamplingParams
from pagedkv.runtime.scheduler import SchedulerConfig

MODELS = {  # KV geometry and vocabulary (the host cost depends on sequences and pages, barely on these)
    "llama3-8b": dict(num_layers=32, num_kv_heads=8, head_dim=128, vocab=128256),
    "qwen2-7b": dict(num_layers=28, num_kv_heads=4, head_dim=128, vocab=152064),
}
QUERY_HEADS = {"llama3-8b": 32, "qwen2-7b": 28}
ROPE_THETA = {"llama3-8b": 500000.0, "qwen2-7b": 1000000.0}
RESOLVE_MS, GOAL_MS = 0.5, 0.2


class HostOnly(Executor):
    """Stands in for the device: binds the step's engine inputs (``feed``, host work, timed apart) and answers
    a token per logits row without computing anything. Not a runtime backend: a benchmark harness."""

    name = "host-only"

    def __init__(self, group: PoolGroup, num_blocks: int, vocab: int, prefix_reuse: bool):
        self.graph = RewrittenGraph(model=None, layers=(), groups=(group,), input_names=(), output_names=(),
                                    logits=engine_io.LOGITS, explicit_positions=False, vocab=vocab, sampling=True,
                                    num_top_logprobs=1, max_blocks=None)
        self.manager = KVCacheManager([group], num_blocks, storage="none", enable_prefix_reuse=prefix_reuse)
        self._pools = np.zeros((1, 4), np.int64)
        self.feed_seconds = 0.0
        self.staging = np.empty(1 << 24, dtype=np.uint8)
        self.pack_seconds = 0.0

    def kv_pools(self):
        return self._pools

    def execute(self, inputs):
        t0 = time.perf_counter()
        feed = self.feed(inputs)
        t1 = time.perf_counter()
        offset = 0  # what TrtExecutor does next: every input into one staging buffer (then one copy)
        for array in feed.values():
            raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            self.staging[offset:offset + raw.size] = raw
            offset += -(-raw.size // 256) * 256
        t2 = time.perf_counter()
        self.feed_seconds, self.pack_seconds = t1 - t0, t2 - t1
        rows = len(inputs.logits_rows)
        tokens = (inputs.input_ids[inputs.logits_rows] * 7 + 1) % 1000  # any token: nothing is computed
        return StepOutputs(None, tokens.astype(np.int32), np.zeros(rows, np.float32), np.zeros((rows, 1), np.int32),
                           np.zeros((rows, 1), np.float32))


def measure(model: str, seqs: int, context: int, steps: int, prefix_reuse: bool, page_size: int = 16) -> dict:
    geo = dict(MODELS[model])
    vocab = geo.pop("vocab")
    group = PoolGroup(model, KVLayout(page_size=page_size, **geo))
    pages = -(-(context + steps + 1) // page_size) + 1
    ex = HostOnly(group, int(seqs * pages * 1.05) + 16, vocab, prefix_reuse)  # (+ the admission watermark)
    engine = Engine(ex, SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=max(seqs, 16384), chunk_size=0),
                    eos_token_ids=(vocab - 1,))
    rng = np.random.default_rng(0)
    params = SamplingParams(max_new_tokens=steps + 2 * seqs, temperature=0.8, top_p=0.95, ignore_eos=False)
    for i in range(seqs):
        engine.add_request(i, rng.integers(0, vocab - 1, context), params)
    while any(r.num_computed < len(r.prompt) for r in engine.requests.values()):
        engine.step()  # prefill through the stand-in
    for _ in range(5):
        engine.step()  # warm-up
    phases = {k: [] for k in ("schedule", "prepare", "feed", "pack", "finish", "host", "stand_in")}
    for _ in range(steps):
        engine.step()
        t = engine.timing
        assert len(engine.scheduler.running) == seqs, engine.scheduler.stats
        host = t.schedule + t.prepare + ex.feed_seconds + t.finish
        for key, value in (("schedule", t.schedule), ("prepare", t.prepare), ("feed", ex.feed_seconds),
                           ("pack", ex.pack_seconds), ("finish", t.finish), ("host", host),
                           ("stand_in", t.execute - ex.feed_seconds - ex.pack_seconds)):
            phases[key].append(value * 1e3)
    return {k: statistics.median(v) for k, v in phases.items()} | {"p90_host": float(np.percentile(phases["host"], 90))}


class DeviceDecodeStep:
    """One decode step of the plugin kernels on the GPU (module docstring): ``seqs`` sequences of ``context``
    cached tokens in a device KV manager, one new token each; every layer's QKV write and paged attention,
    their parameters prepared once. ``launch()`` issues the step on the manager's stream."""

    def __init__(self, model: str, seqs: int, context: int, page_size: int = 16, seed: int = 0):
        from pagedkv import cuda
        from pagedkv.config import AttentionConfig, PoolConfig, RopeConfig, WriteConfig
        from pagedkv.kernels import attention as katt
        from pagedkv.kernels import write as kwrite

        geo = dict(MODELS[model])
        geo.pop("vocab")
        layers, kv_heads, head_dim = geo["num_layers"], geo["num_kv_heads"], geo["head_dim"]
        heads = QUERY_HEADS[model]
        group = PoolGroup(model, KVLayout(page_size=page_size, **geo))
        pages = -(-(context + 1) // page_size)
        self.manager = KVCacheManager([group], seqs * pages + 8, storage="device", enable_prefix_reuse=False)
        self.stream = self.manager.stream
        self._buffers = []
        mgr = self.manager
        mgr.storage.primary[0].fill_bytes(0, self.stream)  # finite K/V everywhere (the pools start as NaN)
        for i in range(seqs):
            mgr.add_sequence(i)
        batch = mgr.seq_batch(list(range(seqs)))
        mgr.reserve_many(batch, context)
        mgr.commit_many(batch, context)
        mgr.reserve_many(batch, 1)
        step = mgr.build_step_many(batch, np.ones(seqs, np.int64), page_indices=False)
        meta = step.meta(0)

        def device(array):
            buf = cuda.DeviceBuffer.from_array(np.ascontiguousarray(array), self.stream)
            self._buffers.append(buf)
            return buf

        rng = np.random.default_rng(seed)
        fp16 = np.float16
        qkv = device(rng.standard_normal((seqs, (heads + 2 * kv_heads) * head_dim)).astype(fp16))
        q = device(np.zeros((seqs, heads * head_dim), fp16))
        out = device(np.zeros((seqs, heads * head_dim), fp16))
        status = device(np.zeros(4, np.int32))
        table, cu, past = device(meta.block_table), device(meta.cu_q_lens), device(meta.past_lens)
        pools = mgr.kv_pools_device()
        ptrs = kwrite.StepPointers(pools.ptr, table.ptr, cu.ptr, past.ptr, num_seqs=seqs, num_tokens=seqs,
                                   max_blocks=meta.max_blocks)
        max_kv = meta.max_blocks * page_size  # the plugin's bounds: max_q_len = T, max_kv_len = MB * P
        ws_bytes = katt.attention_workspace_bytes(seqs, seqs, heads, head_dim, max_kv, page_size)
        ws = cuda.DeviceBuffer(max(ws_bytes, 16))
        self._buffers.append(ws)
        self.params = []
        for layer in range(layers):
            pool = PoolConfig(num_kv_heads=kv_heads, head_dim=head_dim, page_size=page_size, num_layers=layers,
                              layer_index=layer)
            wcfg = WriteConfig(num_q_heads=heads, pool=pool, rope=RopeConfig(theta=ROPE_THETA[model]))
            acfg = AttentionConfig(num_q_heads=heads, pool=pool)
            self.params.append((kwrite.write_params(wcfg, kwrite.IODType.FP16, qkv=qkv.ptr, q_out=q.ptr,
                                                    status=status.ptr, meta=ptrs),
                                katt.attention_params(acfg, io_dtype=kwrite.IODType.FP16, num_tokens=seqs,
                                                      num_seqs=seqs, max_blocks=meta.max_blocks, max_q_len=seqs,
                                                      max_kv_len=max_kv, q=q.ptr, out=out.ptr,
                                                      pool_descs=pools.ptr, block_table=table.ptr,
                                                      cu_q_lens=cu.ptr, past_lens=past.ptr, workspace=ws.ptr,
                                                      workspace_bytes=ws_bytes)))
        self.layers, self.seqs, self.context = layers, seqs, context
        self.out = out  # the last layer's attention output [seqs, heads * head_dim] fp16
        self.out_shape = (seqs, heads * head_dim)
        self.stream.synchronize()

    def output(self) -> np.ndarray:
        return self.out.download(self.out_shape, np.float16, self.stream)

    def launch(self) -> None:
        from pagedkv.kernels import attention as katt
        from pagedkv.kernels import write as kwrite

        handle = self.stream.handle
        for write, attention in self.params:
            kwrite.launch(write, handle)
            katt.launch_attention(attention, handle)

    def close(self) -> None:
        self.stream.synchronize()
        for buf in self._buffers:
            buf.close()
        self.manager.close()


def measure_device(model: str, seqs: int, context: int, steps: int) -> dict:
    """Eager launches vs one CUDA graph for ``DeviceDecodeStep``: host ms to issue a step, device ms per step
    back to back (CUDA events around ``steps`` steps), for both."""
    from pagedkv import cuda

    rt = cuda._rt()
    step = DeviceDecodeStep(model, seqs, context)
    start, end = cuda.Event(timing=True), cuda.Event(timing=True)
    try:
        def timed(issue) -> tuple[float, float]:
            issue()
            step.stream.synchronize()  # warm-up
            host = []
            start.record(step.stream)
            for _ in range(steps):
                t = time.perf_counter()
                issue()
                host.append(time.perf_counter() - t)
            end.record(step.stream)
            return statistics.median(host) * 1e3, start.elapsed_ms(end) / steps

        eager_host, eager_device = timed(step.launch)
        out = {"model": model, "seqs": seqs, "context": context, "kernels_per_step": 2 * step.layers,
               "eager_host_ms": eager_host, "eager_step_ms": eager_device}
        graph = instance = None
        try:
            cuda.check(rt.cudaStreamBeginCapture(step.stream.raw,
                                                 rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal),
                       "cudaStreamBeginCapture")
            try:
                step.launch()
            finally:
                graph = cuda.check(rt.cudaStreamEndCapture(step.stream.raw), "cudaStreamEndCapture")
            instance = cuda.check(rt.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
            graph_host, graph_device = timed(lambda: cuda.check(rt.cudaGraphLaunch(instance, step.stream.raw),
                                                                "cudaGraphLaunch"))
            out.update(graph_host_ms=graph_host, graph_step_ms=graph_device, graph_error=None)
        except Exception as exc:  # noqa: BLE001 - reported in the table: the eager figures stand
            out.update(graph_host_ms=None, graph_step_ms=None, graph_error=f"{type(exc).__name__}: {exc}")
        finally:
            if instance is not None:
                cuda.check(rt.cudaGraphExecDestroy(instance), "cudaGraphExecDestroy")
            if graph is not None:
                cuda.check(rt.cudaGraphDestroy(graph), "cudaGraphDestroy")
        return out
    finally:
        start.close()
        end.close()
        step.close()


def print_device(rows: list[dict], args) -> None:
    print(f"# device: one decode step of the plugin kernels, {args.model} ({rows[0]['kernels_per_step']} launches: "
          f"QKV write + attention per layer), {args.device_context} cached tokens per sequence, fp16 cache; "
          f"medians / means of {args.steps} steps, ms")
    print(f"{'seqs':>5} {'eager: issue':>13} {'step':>8} {'graph: issue':>13} {'step':>8} {'saved/step':>11}")
    for r in rows:
        if r["graph_error"]:
            print(f"{r['seqs']:>5} {r['eager_host_ms']:13.3f} {r['eager_step_ms']:8.3f}   graph capture failed: "
                  f"{r['graph_error']}")
            continue
        print(f"{r['seqs']:>5} {r['eager_host_ms']:13.3f} {r['eager_step_ms']:8.3f} {r['graph_host_ms']:13.3f} "
              f"{r['graph_step_ms']:8.3f} {r['eager_step_ms'] - r['graph_step_ms']:11.3f}")
    print("# issue = host time to enqueue a step (eager: one C-API launch per kernel from Python; graph: one "
          "cudaGraphLaunch); step = device time per step, steps issued back to back")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    parser.add_argument("--seqs", default="64,256", help="running sequences, comma-separated")
    parser.add_argument("--context", type=int, default=4096, help="cached tokens per sequence")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps")
    parser.add_argument("--prefix-reuse", action="store_true", help="register full pages for prefix reuse")
    parser.add_argument("--check", action="store_true", help=f"exit 1 if a median exceeds {RESOLVE_MS} ms")
    parser.add_argument("--backend", choices=["host", "cuda"], default="host",
                        help="cuda: also the kernels' decode step on the GPU, eager vs CUDA graph")
    parser.add_argument("--device-context", type=int, default=1024, help="cached tokens per sequence (--backend cuda)")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args(argv)
    if args.backend == "cuda":
        from pagedkv import cuda

        reason = cuda.why_no_gpu()
        if reason:
            print(f"bench_runtime: --backend cuda needs a GPU ({reason})", file=sys.stderr)
            return 2
    print(f"# runtime host time per decode step, {args.model}, {args.context} cached tokens per sequence, page 16, "
          f"prefix reuse {'on' if args.prefix_reuse else 'off'}; medians of {args.steps} steps, ms")
    print(f"{'seqs':>5} {'schedule':>9} {'prepare':>8} {'feed':>7} {'finish':>7} {'HOST':>7} {'p90':>7} "
          f"{'(+pack)':>8} {'(stand-in)':>10}")
    worst = 0.0
    host_rows = []
    for seqs in (int(s) for s in args.seqs.split(",")):
        m = measure(args.model, seqs, args.context, args.steps, args.prefix_reuse)
        host_rows.append({"seqs": seqs} | m)
        worst = max(worst, m["host"])
        print(f"{seqs:>5} {m['schedule']:9.3f} {m['prepare']:8.3f} {m['feed']:7.3f} {m['finish']:7.3f} "
              f"{m['host']:7.3f} {m['p90_host']:7.3f} {m['pack']:8.3f} {m['stand_in']:10.3f}")
    print(f"# HOST = schedule + prepare + feed + finish (budget: resolve <= {RESOLVE_MS} ms, goal <= {GOAL_MS} ms); "
          "pack = the inputs into one staging buffer (TensorRT executor), stand-in = the fake device")
    print(f"# reproduce: python benchmarks/bench_runtime.py --model {args.model} --seqs {args.seqs} "
          f"--context {args.context} --steps {args.steps}{' --prefix-reuse' if args.prefix_reuse else ''}")
    device_rows = []
    if args.backend == "cuda":
        device_rows = [measure_device(args.model, int(n), args.device_context, args.steps)
                       for n in args.seqs.split(",")]
        print_device(device_rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "context": args.context, "steps": args.steps,
                                               "prefix_reuse": args.prefix_reuse, "host": host_rows,
                                               "device": device_rows}, indent=2) + "\n")
    if args.check and worst > RESOLVE_MS:
        print(f"FAIL: host median {worst:.3f} ms > {RESOLVE_MS} ms", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
