"""Host time of the KV manager's step metadata (budget: 1 ms for a decode step of 256 sequences with 4096
cached tokens each, 16-token pages).

Measures, as medians over many repetitions:
  build_step     every array of the step (block table, cu_q_lens, past_lens, positions, kv_indptr,
                 kv_indices, last_page_lens, token->sequence), numpy only
  pack           the same arrays packed into one staging buffer (what upload_step does before its single
                 cudaMemcpyAsync; a plain numpy buffer stands in for pinned memory without a GPU)
  upload         upload_step end to end (host side: pack into pinned memory + enqueue), GPU only
  reserve+commit the per-sequence bookkeeping of the same decode step (reserve 1 token, commit it)

Reproduce: python benchmarks/bench_metadata.py [--seqs 256 --context 4096 --page-size 16] [--check]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from _bench_common import median_ms

from pagedkv.kvcache import KVCacheManager, PoolGroup
from pagedkv.kvcache.upload import pack_into, pack_layout, step_arrays
from pagedkv.layout import KVLayout

MODELS = {  # KV geometry of one pool group (the metadata cost does not depend on it, the block bytes do)
    "llama3-8b": dict(num_layers=32, num_kv_heads=8, head_dim=128),
    "llama3-70b": dict(num_layers=80, num_kv_heads=8, head_dim=128),
    "qwen2-7b": dict(num_layers=28, num_kv_heads=4, head_dim=128),
}
BUDGET_MS = 1.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--context", type=int, default=4096, help="cached tokens per sequence")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--check", action="store_true", help=f"exit 1 if build_step's median exceeds {BUDGET_MS} ms")
    args = parser.parse_args(argv)

    spec = PoolGroup(args.model, KVLayout(page_size=args.page_size, **MODELS[args.model]))
    pages = -(-(args.context + 1) // args.page_size)
    device = False
    try:
        from pagedkv import cuda

        device = cuda.why_no_gpu() is None
    except Exception:
        pass
    # the pool itself is not needed for the metadata: the host model keeps the bookkeeping only
    book_repeat = max(10, args.repeat // 10)
    growth = -(-(book_repeat + 1) // args.page_size) + 1  # pages the timed decode steps add per sequence
    mgr = KVCacheManager([spec], args.seqs * (pages + growth), storage="none")
    ids = list(range(args.seqs))
    for s in ids:
        mgr.add_sequence(s)
        mgr.reserve(s, args.context)
        mgr.commit(s, args.context)
        mgr.reserve(s, 1)

    build = median_ms(lambda: mgr.build_step(ids), args.repeat)
    step = mgr.build_step(ids)
    arrays = step_arrays(step)
    offsets, size = pack_layout(arrays)
    staging = np.empty(size, dtype=np.uint8)
    pack = median_ms(lambda: pack_into(staging, arrays, offsets), args.repeat)

    def bookkeeping():
        for s in ids:
            mgr.commit(s, 1)
        for s in ids:
            mgr.reserve(s, 1)

    book = median_ms(bookkeeping, book_repeat)

    print(f"# KV step metadata, decode: {args.seqs} sequences x {args.context} cached tokens, page {args.page_size} "
          f"({args.model}); {step.groups[0].kv_indices.size} pages in the step")
    print(f"build_step      median {build:8.3f} ms   (budget {BUDGET_MS} ms)")
    print(f"pack            median {pack:8.3f} ms   ({size / 1024:.0f} KiB staged)")
    print(f"build + pack    median {build + pack:8.3f} ms")
    if device:
        dev = KVCacheManager([spec], 8, storage="device")
        try:
            upload = median_ms(lambda: dev.upload_step(step), args.repeat)
            dev.stream.synchronize()
            print(f"upload_step     median {upload:8.3f} ms   (pinned staging + one cudaMemcpyAsync, host side)")
        finally:
            dev.close()
    else:
        print("upload_step     skipped: no CUDA device")
    print(f"reserve+commit  median {book:8.3f} ms   (bookkeeping of the same step, {args.seqs} sequences)")
    print(f"# reproduce: python benchmarks/bench_metadata.py --model {args.model} --seqs {args.seqs} "
          f"--context {args.context} --page-size {args.page_size}")
    if args.check and build > BUDGET_MS:
        print(f"FAIL: build_step median {build:.3f} ms > {BUDGET_MS} ms", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
