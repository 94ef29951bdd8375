"""Host time of one decode step of the KV manager: C++ (goal of issue #16: <= 50 us at 256 running sequences)
next to the Python manager, for the same step.

A step, per sequence: commit the previous token and reserve the next (the bookkeeping), then every metadata
array of the step (block table, cu_q_lens, past_lens, positions, kv_indptr, kv_indices, last_page_lens, ...)
in one staging buffer:

  C++            ``pagedkv_runtime_check bench`` (plugins/runtime/tests/bench.cpp): plan_step + write_step into
                 a 256-byte aligned staging buffer, commit + reserve in C++
  C++ (ctypes)   the same manager from Python (``NativeKVManager``: commit_many, reserve_many, build_step into
                 fresh numpy arrays, pack_into): adds the binding's per-call, allocation and packing cost
  Python         ``KVCacheManager``: commit + reserve per sequence, build_step, pack_into a staging buffer

and the whole host side of a C++ engine step, the issue's measure (``pagedkv_runtime_check bench-engine``,
plugins/runtime/tests/bench_engine.cpp): the scheduler (decodes, reserveMany), every engine input of the step
(block table, cu_q_lens, past_lens, input ids, logits rows, sampling rows with their draws), commit, tokens and
stops, with prefix reuse off and on — benchmarks/bench_runtime.py measures the same for the Python engine.

Medians over the timed steps. Reproduce: python benchmarks/bench_cpp_kv.py [--seqs 256 --context 4096 --page-size 16]
"""

from __future__ import annotations

import argparse
import re
import subprocess

import numpy as np
from _bench_common import median_ms

from pagedkv import _lib
from pagedkv.kvcache import KVCacheManager, PoolGroup
from pagedkv.kvcache.native import NativeKVManager
from pagedkv.kvcache.upload import pack_into, pack_layout, step_arrays
from pagedkv.layout import KVLayout

GOAL_US = 50.0


def decode_step(mgr, ids, batched: bool, staging: np.ndarray):
    """One step of the benchmark on ``mgr`` (every sequence has one reserved slot on entry and exit)."""
    arrays = step_arrays(mgr.build_step(ids))
    offsets, size = pack_layout(arrays)
    if staging.size < size:
        staging.resize(size, refcheck=False)
    pack_into(staging, arrays, offsets)
    ones = [1] * len(ids)
    if batched:
        mgr.commit_many(ids, ones, [7] * len(ids))
        mgr.reserve_many(ids, ones)
    else:
        for s in ids:
            mgr.commit(s, 1, [7])
        for s in ids:
            mgr.reserve(s, 1)


def python_side(cls, args, repeat: int, batched: bool) -> float:
    spec = PoolGroup("llama3-8b", KVLayout(32, 8, args.page_size, 128))
    pages = -(-(args.context + repeat + 2) // args.page_size) + 1
    mgr = cls([spec], args.seqs * pages)
    ids = list(range(args.seqs))
    prompt = np.arange(args.context, dtype=np.int32) % 32000 + 1
    for s in ids:
        mgr.add_sequence(s, prompt + s)
        mgr.reserve(s, args.context)
        mgr.commit(s, args.context)
        mgr.reserve(s, 1)
    staging = np.empty(1, dtype=np.uint8)
    return median_ms(lambda: decode_step(mgr, ids, batched, staging), repeat) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--context", type=int, default=4096, help="cached tokens per sequence")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200, help="timed steps of the C++ benchmark")
    args = parser.parse_args(argv)

    exe = _lib.require_file(_lib.RUNTIME_CHECK_NAME)
    out = subprocess.run([str(exe), "bench", "--seqs", str(args.seqs), "--context", str(args.context), "--page-size",
                          str(args.page_size), "--steps", str(args.steps)], capture_output=True, text=True, check=True)
    print(out.stdout, end="")
    cpp = float(re.search(r"step total\s+median\s+([\d.]+) us", out.stdout).group(1))
    engine = {}
    for prefix in ("0", "1"):
        run = subprocess.run([str(exe), "bench-engine", "--seqs", str(args.seqs), "--context", str(args.context),
                              "--page-size", str(args.page_size), "--steps", str(args.steps), "--prefix", prefix],
                             capture_output=True, text=True, check=True)
        print(run.stdout, end="")
        engine[prefix] = float(re.search(r"engine host\s+median\s+([\d.]+) us", run.stdout).group(1))
    ctypes_us = python_side(NativeKVManager, args, repeat=50, batched=True)
    python_us = python_side(KVCacheManager, args, repeat=10, batched=False)
    print(f"# the same decode step, {args.seqs} sequences x {args.context} cached tokens, page {args.page_size}")
    print(f"C++ engine step  median {engine['0']:8.1f} us   (goal {GOAL_US:.0f} us: "
          f"{'met' if engine['0'] <= GOAL_US else 'NOT met'}; {engine['1']:.1f} us with prefix reuse)")
    print(f"C++ KV manager   median {cpp:8.1f} us   (commit + reserve + every metadata array)")
    print(f"C++ via ctypes   median {ctypes_us:8.1f} us   (NativeKVManager: 4 calls, numpy arrays, pack)")
    print(f"Python           median {python_us:8.1f} us   (KVCacheManager: commit + reserve + build_step + pack)")
    print(f"# reproduce: python benchmarks/bench_cpp_kv.py --seqs {args.seqs} --context {args.context} "
          f"--page-size {args.page_size}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
