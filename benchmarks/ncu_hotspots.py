"""Where a kernel's warps stall, per SASS instruction, from an Nsight Compute source export.

On the GPU machine (``benchmarks/profile_attention.py`` launches the case)::

    ncu --profile-from-start off --kernel-name regex:attentionMulti --launch-skip 1 --launch-count 1 --set full \\
        --import-source yes -o prof python3 benchmarks/profile_attention.py prefill --head-dim 64 --launches 3
    ncu -i prof.ncu-rep --page source --csv --print-source sass > sass.csv

then, anywhere: ``python benchmarks/ncu_hotspots.py sass.csv [--top 40]``. It prints the kernel's stall samples by
reason and the ``--top`` instructions with the most samples (address, samples, share, warp-level executions, the two
largest reasons, the instruction).
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Instruction:
    address: str
    source: str
    samples: int
    executed: int
    stalls: dict[str, int]  # reason (without the stall_ prefix) -> samples


def read_export(path: Path) -> tuple[str, list[Instruction]]:
    """The kernel's name and its instructions, from ``ncu --page source --csv --print-source sass`` output: a
    ``"Kernel Name",<name>`` line, the header, then one row per SASS instruction."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2 or not rows[0] or rows[0][0] != "Kernel Name":
        raise ValueError(f"{path}: not an ncu source export (its first line is not \"Kernel Name\",...)")
    header = rows[1]
    col = {name: i for i, name in enumerate(header)}
    for needed in ("Address", "Source", SAMPLES, EXECUTED):
        if needed not in col:
            raise ValueError(f"{path}: no column {needed!r} (export with --set full and --print-source sass)")
    reasons = [h for h in header if h.startswith("stall_") and not h.endswith("(Not Issued)")]
    def number(row: list[str], name: str) -> int:
        return int(row[col[name]] or 0)  # empty cells are 0

    out = []
    for row in rows[2:]:
        if len(row) < len(header):
            continue
        out.append(Instruction(row[col["Address"]], row[col["Source"]], number(row, SAMPLES), number(row, EXECUTED),
                               {r[len("stall_"):]: number(row, r) for r in reasons if number(row, r) > 0}))
    return rows[0][1], out


def report(kernel: str, instructions: list[Instruction], top: int) -> str:
    total = sum(i.samples for i in instructions)
    by_reason: Counter[str] = Counter()
    for i in instructions:
        by_reason.update(i.stalls)
    lines = [f"# {kernel}", f"# {len(instructions)} SASS instructions, {total} samples",
             "# samples by reason: " + ", ".join(f"{r} {n}" for r, n in by_reason.most_common()),
             f"{'address':>18} {'samples':>8} {'%':>5} {'executed':>10}  {'top stall reasons':40s} instruction"]
    for i in sorted(instructions, key=lambda i: -i.samples)[:top]:
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(i.stalls.items(), key=lambda kv: -kv[1])[:2])
        share = 100 * i.samples / total if total else 0.0
        lines.append(f"{i.address:>18} {i.samples:8d} {share:5.1f} {i.executed:10d}  {reasons:40s} {i.source.strip()}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export", type=Path, help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=40, help="instructions listed (default %(default)s)")
    args = ap.parse_args()
    if args.top < 1:
        ap.error(f"--top={args.top}: expected >= 1")
    try:
        kernel, instructions = read_export(args.export)
    except (OSError, ValueError) as exc:
        print(f"ncu_hotspots.py: {exc}", file=sys.stderr)
        return 2
    print(report(kernel, instructions, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
