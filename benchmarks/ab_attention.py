"""A/B timing of the attention kernels of the pagedkv build installed here, for comparing builds (kernel variants).

One process times one build; a variant is another build (``.ci/gpu-ab.sh`` builds each variant in turn on the GPU
machine and runs this once per build). The cases are bench_attention.py's (same shapes, values and seeds):
``prefill`` = 4 x 2048 over 8192 and 1 x 8192 over 0, ``decode`` = the six decode shapes, each at pages of 16 and 64;
``fp8prefill`` = the two prefills over an fp8 e4m3 cache (8-bit tiles converted in shared memory), at both pages;
``prefill64`` = the two prefills at head dim 64 (where the softmax's exponentials weigh most against the MMAs);
``prefill32`` = the same at head dim 32 (rows padded to 64 elements in the Hopper kernel's tiles);
``plugin`` = the 64 x 4K and 256 x 1K decodes at both pages under the attention plugin's bounds (maxQLen = T, maxKVLen
= the block table's reach: the multi-token kernel is launched too and finds nothing to do), bench_attention.py's
"plugin bounds" rows.
The rounds go over every case before the next round starts, so a drift of the machine (clocks, temperature) spreads
over all cases instead of landing on one; each time is a ``triton.testing.do_bench`` median (L2 flushed between
repetitions). With ``--outputs DIR`` the first build run with that DIR stores each case's output there and every
later build reports its max |difference| to it: a timing-only experiment shows up as a large difference, a
candidate must stay within the dtype's tolerance.

    python benchmarks/ab_attention.py --label base --cases prefill [--rounds 3] [--rep 200] [--outputs DIR]
                                      [--json results.jsonl]

Each case prints one line, ``label case: round times (us), median, max|diff|``; ``--json`` appends one JSON object per
case (label, case, us per round, median, max_diff) to the file, so that the builds of one session collect in it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench_attention import DECODE_SHAPES, PREFILLS, Step, decode_case, prefill_case, time_us

PAGES = (16, 64)
PREFILL_HEAD_DIMS = {"prefill64": 64, "prefill32": 32}  # the prefills at another head dim than bench_attention's 128
CASES = ("prefill", "decode", "fp8prefill", "plugin", *PREFILL_HEAD_DIMS)
PLUGIN_DECODES = ((64, 4096), (256, 1024))  # bench_attention.py's "plugin bounds" rows


def steps_for(torch, which: list[str]) -> dict[str, tuple[Step, bool]]:
    """The cases' steps, named as bench_attention.py names its rows, each with whether it runs under the plugin's
    bounds."""
    cases: list[tuple[str, Step, bool]] = []
    for kind in which:
        for page in PAGES:
            if kind == "plugin":
                cases += [(f"{name} plugin bounds", step, True) for name, step in
                          (decode_case(torch, batch, length, page) for batch, length in PLUGIN_DECODES)]
                continue
            if kind == "prefill":
                named = [prefill_case(torch, shape, page) for shape in PREFILLS]
            elif kind == "fp8prefill":
                named = [prefill_case(torch, shape, page, cache="fp8") for shape in PREFILLS]
            elif kind in PREFILL_HEAD_DIMS:
                named = [prefill_case(torch, shape, page, head_dim=PREFILL_HEAD_DIMS[kind]) for shape in PREFILLS]
            else:
                named = [decode_case(torch, batch, length, page) for batch, length in DECODE_SHAPES]
            cases += [(name, step, False) for name, step in named]
    return {name: (step, loose) for name, step, loose in cases}


def max_diff_to_stored(torch, out, path: Path) -> float | None:
    """Max |out - the output stored at path| (stored first when absent: then None)."""
    got = out.float().cpu()
    if not path.exists():
        torch.save(got, path)
        return None
    ref = torch.load(path)
    if ref.shape != got.shape:
        return float("inf")
    return float((got - ref).abs().nan_to_num(nan=float("inf")).max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", required=True, help="the build's name in the output (base, variant, ...)")
    ap.add_argument("--cases", default="prefill", help=f"comma-separated subset of: {', '.join(CASES)}")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all cases (default %(default)s)")
    ap.add_argument("--rep", type=int, default=200, help="do_bench's repetition time per case, ms (default %(default)s)")
    ap.add_argument("--outputs", help="directory of the first build's outputs, to compare the later builds' with")
    ap.add_argument("--json", help="append one JSON line per case to this file")
    args = ap.parse_args()
    which = [c for c in args.cases.split(",") if c]
    if not which or set(which) - set(CASES):
        ap.error(f"--cases={args.cases}: expected a comma-separated subset of {', '.join(CASES)}")
    if args.rounds < 1:
        ap.error(f"--rounds={args.rounds}: expected >= 1")
    if args.rep < 1:
        ap.error(f"--rep={args.rep}: expected >= 1 (ms)")

    from pagedkv import cuda

    why = cuda.why_no_gpu()
    if why is not None:
        print(f"ab_attention needs a GPU: {why}", file=sys.stderr)
        return 2
    import torch
    import triton

    steps = steps_for(torch, which)
    launchers = {case: step.our_launcher(plugin_bounds=loose) for case, (step, loose) in steps.items()}
    times: dict[str, list[float]] = {case: [] for case in steps}
    for _ in range(args.rounds):
        for case, launch in launchers.items():
            times[case].append(time_us(launch, torch, triton, rep=args.rep))

    outputs = Path(args.outputs) if args.outputs else None
    if outputs is not None:
        outputs.mkdir(parents=True, exist_ok=True)
    width = max(len(case) for case in steps)
    for case, (step, _) in steps.items():
        diff = None
        if outputs is not None:
            launchers[case]()
            torch.cuda.synchronize()
            diff = max_diff_to_stored(torch, step.out, outputs / (case.replace(" ", "_") + ".pt"))
        median = statistics.median(times[case])
        rounds = " ".join(f"{t:8.1f}" for t in times[case])
        note = "" if diff is None else f"  max|diff| {diff:.4g}"
        print(f"{args.label} {case:<{width}}: {rounds}  median {median:8.1f}{note}")
        if args.json:
            with open(args.json, "a") as f:
                row = {"label": args.label, "case": case, "us": times[case], "median": median, "max_diff": diff}
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
