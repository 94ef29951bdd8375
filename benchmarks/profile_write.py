"""Run one QKV-write case a few times, for a profiler (Nsight Compute) to catch one launch.

    ncu --profile-from-start off --launch-skip 3 --launch-count 1 --set full \
        python benchmarks/profile_write.py decode --cache fp8 --q-fp8

Only the timed launches run inside a profiler range (cudaProfilerStart / Stop), so ``--profile-from-start off``
skips the set-up kernels (random activations, page shuffles); FlashInfer's unfused bf16 pipeline is two kernels a
launch (RoPE, then append: ``--launch-skip`` counts kernels).

Shapes are bench_write.py's: ``decode`` (``--batch`` sequences x 1 new token over 4096 cached; 64 by default) and
``prefill`` (1 x 16384 new tokens). ``--impl flashinfer`` launches FlashInfer's rope + append over a bf16 cache,
``--impl flashinfer_fp8`` its fused rope + fp8 quantize + append (q out in fp8 too: compare it with ours under
``--cache fp8 --q-fp8``). The timing figures belong to bench_write.py; this script only launches.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import launch_in_profiler_range  # noqa: E402
from bench_write import Shape, Step, flashinfer_fp8_launcher, flashinfer_launcher, our_launcher  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=["decode", "prefill"])
    ap.add_argument("--launches", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64, help="decode: sequences in the step")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--cache", choices=["bf16", "fp8"], default="bf16", help="the pool's dtype (fp8: e4m3)")
    ap.add_argument("--layout", choices=["HND", "NHD"], default="HND", help="ours: the pool's page layout")
    ap.add_argument("--q-fp8", action="store_true", help="ours: q out in fp8 e4m3 (WriteConfig.q_out_fp8)")
    ap.add_argument("--impl", choices=["ours", "flashinfer", "flashinfer_fp8"], default="ours",
                    help="whose kernels to launch (FlashInfer's on the same activations and block table)")
    args = ap.parse_args()
    for name in ("launches", "batch", "page"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}={getattr(args, name)}: expected >= 1")
    if args.impl == "flashinfer" and args.cache != "bf16":
        ap.error(f"--impl flashinfer: its append copies into a bf16 cache, not --cache {args.cache} "
                 "(--impl flashinfer_fp8 quantizes)")
    if args.impl == "flashinfer_fp8" and args.cache != "fp8":
        ap.error("--impl flashinfer_fp8: only with --cache fp8")
    if args.q_fp8 and args.impl != "ours":
        ap.error(f"--q-fp8: only with --impl ours (--impl {args.impl} decides its own q dtype)")
    import torch

    if args.case == "decode":
        shape = Shape(f"decode {args.batch}x1 @4096 P{args.page}", args.batch, 1, 4096, args.page)
    else:
        shape = Shape(f"prefill 1x16384 P{args.page}", 1, 16384, 0, args.page)
    step = Step(shape, torch)
    if args.impl == "ours":
        launch, _, _, keep = our_launcher(step, torch, args.cache, args.layout, q_fp8=args.q_fp8)
    elif args.impl == "flashinfer":
        import flashinfer

        launch, _, _, keep = flashinfer_launcher(step, torch, flashinfer)
    else:
        import flashinfer

        launch, _, keep = flashinfer_fp8_launcher(step, torch, flashinfer)
    launch_in_profiler_range(launch, args.launches, torch)
    print(f"{shape.name} ({args.impl}, cache {args.cache}{', q fp8' if args.q_fp8 else ''}): {args.launches} launches")
    del keep
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
