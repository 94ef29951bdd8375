"""Run one attention case a few times, for a profiler (Nsight Compute) to catch one launch.

    ncu --profile-from-start off --launch-skip 3 --launch-count 1 --set full \
        python benchmarks/profile_attention.py prefill

Only the timed launches run inside a profiler range (cudaProfilerStart / Stop), so ``--profile-from-start off``
skips the step's set-up kernels (random values, page shuffles) whatever their names, and ``--launch-skip`` counts
the case's own launches (a peer's step may be more than one kernel: print them with ``--print-summary per-kernel``).

Cases are bench_attention.py's: ``prefill`` (4 x 2048 over 8192, page 16; ``--prefill 1``: 1 x 8192 over 0;
``--cache fp8``: over an fp8 e4m3 cache), ``decode`` (bf16, 64 x 4096, page 16) and ``fp8`` (the same with an fp8
e4m3 cache); ``--batch`` / ``--kv-len`` pick another decode shape (e.g.
16 x 8192, one unsplit wave), ``--page`` the page size and ``--head-dim`` another head dim (bench_attention.py's
``headdim`` rows: D = 64's prefill trails fa3). ``--impl tc_fa2`` / ``xqa`` launches that FlashInfer
decode path on the same step instead of ours (its kernels: ``regex:BatchPrefillWithPagedKVCache`` for tc_fa2), to
profile both side by side; ``--impl fa3`` launches FlashInfer's FlashAttention-3 prefill on a prefill case instead
(e.g. to compare D = 64's warp states with ours). The timing figures belong to bench_attention.py; this script only
launches.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import launch_in_profiler_range  # noqa: E402
from bench_attention import PREFILLS, Peers, Step  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=["prefill", "decode", "fp8"])
    ap.add_argument("--launches", type=int, default=6)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--prefill", type=int, choices=range(len(PREFILLS)), default=0,
                    help="prefill: which of bench_attention.py's prefill shapes (0: 4 x 2048 over 8192, 1: 1 x 8192)")
    ap.add_argument("--batch", type=int, default=64, help="decode / fp8: sequences in the step")
    ap.add_argument("--kv-len", type=int, default=4096, help="decode / fp8: each sequence's KV length after the step")
    ap.add_argument("--cache", choices=["bf16", "fp8"], default="bf16",
                    help="prefill: the cache dtype (fp8: e4m3, its 8-bit tiles converted in shared memory)")
    ap.add_argument("--impl", choices=["ours", "tc_fa2", "xqa", "fa3"], default="ours",
                    help="whose kernels to launch (the peers: FlashInfer's, on the same K/V values; tc_fa2 and xqa "
                         "decode, fa3 prefill)")
    ap.add_argument("--head-dim", type=int, default=None,
                    help="the head dim (default: bench_attention.py's 128); one the kernels are compiled for")
    args = ap.parse_args()
    if args.impl in ("tc_fa2", "xqa") and args.case != "decode":
        ap.error(f"--impl {args.impl}: only with the decode case")
    if args.impl == "fa3" and args.case != "prefill":
        ap.error("--impl fa3: only with the prefill case")
    if args.cache != "bf16" and args.case != "prefill":
        ap.error(f"--cache {args.cache}: only with the prefill case (the fp8 case is the decode's)")
    for name in ("page", "batch", "kv_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected >= 1")
    dims = {}
    if args.head_dim is not None:
        from pagedkv.capabilities import capabilities

        if args.head_dim not in capabilities().head_dims:
            ap.error(f"--head-dim={args.head_dim}: expected one of {capabilities().head_dims}")
        dims = dict(head_dim=args.head_dim)
    import torch

    if args.case == "prefill":
        shape = PREFILLS[args.prefill]
        step = Step(torch, num_seqs=shape["num_seqs"], q_len=shape["chunk"], past_len=shape["cached"],
                    page_size=args.page, cache=args.cache, seed=7, **dims)
    else:
        step = Step(torch, num_seqs=args.batch, q_len=1, past_len=args.kv_len - 1, page_size=args.page,
                    cache="fp8" if args.case == "fp8" else "bf16", **dims)
    if args.impl == "ours":
        launch = step.our_launcher()
    else:
        import flashinfer

        peers = Peers(torch, flashinfer)
        launch = peers.prefill(step, "fa3") if args.impl == "fa3" else peers.decode(step, args.impl)
    launch_in_profiler_range(launch, args.launches, torch)
    print(f"{args.case} ({args.impl}): {args.launches} launches" +
          (f", plan {launch.plan}" if args.impl == "ours" else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
