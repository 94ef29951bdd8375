"""Serving figures of the CUDA-kernel executor (issue 15, "Measured"): tokens/s and TTFT for a batch of requests on
a mid-size random-weight decoder, and the share of each step's time spent in our kernels vs elsewhere.

The model is the synthetic decoder (``pagedkv.onnx_export.synthetic``, random weights) of one of ``CONFIGS``,
rewritten (fp16 KV pages of 16 tokens, sampling head) and run by the engine with continuous batching on the
chosen backend (``cuda``: ONNX Runtime with the plugin ops on the CUDA kernels; ``reference`` for a CPU check of
the script itself). All requests are submitted at once (offline), each generating exactly ``--output-len``
tokens; the step loop records when every request's tokens arrive (``pagedkv.runtime.latency``).

Where the time goes, per step and summed over the run: **kernels** — device time of the QKV-write and
attention launches, CUDA events around each (``pagedkv.runtime.backends.KernelTimer``); **rest of execute** —
everything else the executor does: ONNX Runtime's CPU kernels for the projections, MLP, LM head and sampling head,
and the backend's per-op uploads and downloads (this executor stages every plugin op through host arrays, which
is what an engine avoids); **host** — the runtime's own work (scheduling, KV bookkeeping, step metadata,
sampling rows, commit). The kernels' share is small on this executor by construction; it bounds what the
kernels can gain until the rest runs on the device (a TensorRT engine).

Reproduce (on the GPU machine): python benchmarks/bench_serving.py [--config mid-1024|mid-2048] [--json out.json]
CPU check of the script: python benchmarks/bench_serving.py --backend reference --config tiny
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from pagedkv.onnx_export.synthetic import SyntheticConfig

CONFIGS = {  # random weights; head_dim 128 and GQA as in today's mid-size models
    "mid-1024": SyntheticConfig(num_layers=4, hidden=1024, num_heads=8, num_kv_heads=2, head_dim=128, vocab=32000,
                                intermediate=2816, seed=0),
    "mid-2048": SyntheticConfig(num_layers=6, hidden=2048, num_heads=16, num_kv_heads=4, head_dim=128,
                                vocab=32000, intermediate=5632, seed=0),
    "tiny": SyntheticConfig(num_layers=2, hidden=128, num_heads=2, num_kv_heads=1, head_dim=64, vocab=512,
                            intermediate=256, seed=0),  # a CPU check of the script (--backend reference)
}


def measure(config: str, backend: str, num_prompts: int, input_len: int, output_len: int, max_num_seqs: int,
            max_num_batched_tokens: int, seed: int = 0) -> dict:
    from pagedkv.builder.rewrite import RewriteOptions, rewrite_model
    from pagedkv.onnx_export.synthetic import make_synthetic_model
    from pagedkv.runtime import Engine, OrtExecutor, SamplingParams, SchedulerConfig
    from pagedkv.runtime.backends import KernelTimer
    from pagedkv.runtime.latency import RequestTiming

    cfg = CONFIGS[config]
    t0 = time.perf_counter()
    rewritten = rewrite_model(make_synthetic_model(cfg), RewriteOptions()).model
    build_s = time.perf_counter() - t0
    pages = -(-(input_len + output_len) // 16)
    executor = OrtExecutor(rewritten, backend=backend, num_blocks=num_prompts * (pages + 1) + 64,
                           manager_kwargs={"enable_prefix_reuse": False})
    del rewritten
    with executor:
        engine = Engine(executor, SchedulerConfig(max_num_seqs=max_num_seqs,
                                                  max_num_batched_tokens=max_num_batched_tokens, chunk_size=0))
        timer = None
        if backend == "cuda":
            timer = executor.backend.timer = KernelTimer()
        rng = np.random.default_rng(seed)
        params = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
        warm = engine.add_request("warm-up", rng.integers(0, cfg.vocab, input_len), SamplingParams(max_new_tokens=2))
        engine.run()  # ONNX Runtime's first runs and the kernels' first launches stay out of the figures
        assert warm.finished
        if timer is not None:
            timer.collect()
            timer.ms.clear()
            timer.calls.clear()
        timings = {}
        start = time.perf_counter()
        for i in range(num_prompts):
            engine.add_request(i, rng.integers(0, cfg.vocab, input_len), params)
            timings[i] = RequestTiming(start)
        host = execute = 0.0
        steps = 0
        while engine.has_unfinished:
            got = engine.step()
            now = time.perf_counter()
            for r in got:
                timings[r.id].arrived(1, now)
                if r.finished:
                    timings[r.id].finish(now)
            host += engine.timing.host
            execute += engine.timing.execute
            steps += 1
        wall = time.perf_counter() - start
        kernels = timer.collect() if timer is not None else {}
        calls = dict(timer.calls) if timer is not None else {}
    t = list(timings.values())
    output = sum(x.tokens for x in t)
    kernel_s = sum(kernels.values()) / 1e3
    ttft = np.array([x.ttft for x in t]) * 1e3
    itl = np.array([g for x in t for g in x.gaps]) * 1e3
    return {
        "config": config, "model": {k: getattr(cfg, k) for k in ("num_layers", "hidden", "num_heads", "num_kv_heads",
                                                               "head_dim", "vocab", "intermediate")},
        "backend": backend, "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
        "ort_threads": int(os.environ.get("PAGEDKV_ORT_THREADS", "1")),
        "rewrite_s": build_s, "steps": steps, "wall_s": wall, "output_tokens": output,
        "output_tokens_per_s": output / wall, "total_tokens_per_s": (output + num_prompts * input_len) / wall,
        "ttft_ms": {"mean": float(ttft.mean()), "p50": float(np.percentile(ttft, 50)),
                    "p90": float(np.percentile(ttft, 90)), "p99": float(np.percentile(ttft, 99))},
        "itl_ms": {"mean": float(itl.mean()), "p50": float(np.percentile(itl, 50)),
                   "p90": float(np.percentile(itl, 90)), "p99": float(np.percentile(itl, 99))},
        "time_s": {"kernels": kernel_s if timer is not None else None,
                   "kernels_by_op": {k: v / 1e3 for k, v in kernels.items()}, "kernel_launches": calls,
                   "execute_rest": execute - kernel_s,
                   "execute": execute, "host": host, "other": wall - execute - host},
        "kernel_share": kernel_s / wall if timer is not None else None,
    }


def print_table(r: dict) -> None:
    m = r["model"]
    print(f"# bench_serving: {r['config']} ({m['num_layers']} layers, hidden {m['hidden']}, {m['num_heads']}/"
          f"{m['num_kv_heads']} heads x {m['head_dim']}, vocab {m['vocab']}; random weights), backend {r['backend']}, "
          f"{r['num_prompts']} requests x (input {r['input_len']}, output {r['output_len']}), all at once, "
          f"ONNX Runtime on {r['ort_threads']} CPU threads")
    t = r["time_s"]
    share = (lambda s: f"{100 * s / r['wall_s']:5.1f}%" if s is not None else "  n/a")  # noqa: E731
    secs = (lambda s: f"{s:8.3f}" if s is not None else "     n/a")  # noqa: E731
    print(f"{'steps':>6} {'wall s':>8} {'out tok/s':>10} {'tot tok/s':>10} {'TTFT p50':>9} {'p90':>8} "
          f"{'ITL p50':>8} {'p90':>7}   {'kernels':>8} {'':>6} {'exec rest':>9} {'':>6} {'host':>8} {'':>6}")
    print(f"{r['steps']:>6} {r['wall_s']:8.2f} {r['output_tokens_per_s']:10.1f} {r['total_tokens_per_s']:10.1f} "
          f"{r['ttft_ms']['p50']:9.1f} {r['ttft_ms']['p90']:8.1f} {r['itl_ms']['p50']:8.1f} {r['itl_ms']['p90']:7.1f}"
          f"   {secs(t['kernels'])} {share(t['kernels'])} {secs(t['execute_rest'])} {share(t['execute_rest'])} "
          f"{secs(t['host'])} {share(t['host'])}")
    if t["kernels_by_op"]:
        print("# kernels: " + ", ".join(f"{k} {v * 1e3:.1f} ms over {t['kernel_launches'].get(k, 0)} launches"
                                        for k, v in t["kernels_by_op"].items()))
    print("# kernels = device time of our QKV-write + attention launches (CUDA events); exec rest = ONNX Runtime's "
          "CPU ops and the per-op copies; host = the runtime's scheduling, KV bookkeeping, metadata, commit")
    print(f"# reproduce: python benchmarks/bench_serving.py --backend {r['backend']} --config {r['config']} "
          f"--num-prompts {r['num_prompts']} --input-len {r['input_len']} --output-len {r['output_len']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["cuda", "reference"], default="cuda")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="mid-1024")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--ort-threads", type=int, default=os.cpu_count(),
                        help="ONNX Runtime's CPU threads (PAGEDKV_ORT_THREADS; the runtime's default is 1)")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    os.environ["PAGEDKV_ORT_THREADS"] = str(args.ort_threads)
    if args.backend == "cuda":
        from pagedkv import cuda

        reason = cuda.why_no_gpu()
        if reason:
            print(f"bench_serving: --backend cuda needs a GPU ({reason}); --backend reference checks the script",
                  file=sys.stderr)
            return 2
    result = measure(args.config, args.backend, args.num_prompts, args.input_len, args.output_len, args.max_num_seqs,
                     args.max_num_batched_tokens)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
