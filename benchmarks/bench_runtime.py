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

Reproduce: python benchmarks/bench_runtime.py [--seqs 64,256 --context 4096 --steps 200 --prefix-reuse]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    parser.add_argument("--seqs", default="64,256", help="running sequences, comma-separated")
    parser.add_argument("--context", type=int, default=4096, help="cached tokens per sequence")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps")
    parser.add_argument("--prefix-reuse", action="store_true", help="register full pages for prefix reuse")
    parser.add_argument("--check", action="store_true", help=f"exit 1 if a median exceeds {RESOLVE_MS} ms")
    args = parser.parse_args(argv)
    print(f"# runtime host time per decode step, {args.model}, {args.context} cached tokens per sequence, page 16, "
          f"prefix reuse {'on' if args.prefix_reuse else 'off'}; medians of {args.steps} steps, ms")
    print(f"{'seqs':>5} {'schedule':>9} {'prepare':>8} {'feed':>7} {'finish':>7} {'HOST':>7} {'p90':>7} "
          f"{'(+pack)':>8} {'(stand-in)':>10}")
    worst = 0.0
    for seqs in (int(s) for s in args.seqs.split(",")):
        m = measure(args.model, seqs, args.context, args.steps, args.prefix_reuse)
        worst = max(worst, m["host"])
        print(f"{seqs:>5} {m['schedule']:9.3f} {m['prepare']:8.3f} {m['feed']:7.3f} {m['finish']:7.3f} "
              f"{m['host']:7.3f} {m['p90_host']:7.3f} {m['pack']:8.3f} {m['stand_in']:10.3f}")
    print(f"# HOST = schedule + prepare + feed + finish (budget: resolve <= {RESOLVE_MS} ms, goal <= {GOAL_MS} ms); "
          "pack = the inputs into one staging buffer (TensorRT executor), stand-in = the fake device")
    print(f"# reproduce: python benchmarks/bench_runtime.py --model {args.model} --seqs {args.seqs} "
          f"--context {args.context} --steps {args.steps}{' --prefix-reuse' if args.prefix_reuse else ''}")
    if args.check and worst > RESOLVE_MS:
        print(f"FAIL: host median {worst:.3f} ms > {RESOLVE_MS} ms", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
