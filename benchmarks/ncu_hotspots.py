"""Where a kernel's warps stall, per SASS instruction, from an Nsight Compute source export.

On the GPU machine (``benchmarks/profile_attention.py`` launches the case)::

    ncu --profile-from-start off --kernel-name regex:attentionMulti --launch-skip 1 --launch-count 1 --set full \\
        --import-source yes -o prof python3 benchmarks/profile_attention.py prefill --head-dim 64 --launches 3
    ncu -i prof.ncu-rep --page source --csv --print-source sass > sass.csv

then, anywhere: ``python benchmarks/ncu_hotspots.py sass.csv [--top 40]``. It prints the kernel's stall samples by
reason and the ``--top`` instructions with the most samples (address, samples, share, warp-level executions, the two
largest reasons, the instruction). ``--range 0x116c0:0x21be0`` keeps the instructions at those offsets from the
kernel's first one (a loop, a warp role's code: read the offsets off ``cuobjdump -sass``), and ``--by-opcode`` adds
their samples summed per opcode (HGMMA, MUFU, FMNMX, ..., the waits as WARPGROUP.DEPBAR / SYNCS.PHASECHK), which is
how two kernels' loops compare when their instructions do not line up.
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


def opcode(source: str) -> str:
    """The instruction's opcode without its modifiers (a predicate skipped); the two wait families keep their first
    modifier, which says what they wait for (WARPGROUP.DEPBAR: an MMA; SYNCS.PHASECHK: an mbarrier)."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    if not words:
        return "?"
    parts = words[0].rstrip(";").split(".")
    return ".".join(parts[:2]) if parts[0] in ("WARPGROUP", "SYNCS") else parts[0]


def in_range(instructions: list[Instruction], start: int, end: int) -> list[Instruction]:
    """The instructions at offsets [start, end) from the kernel's first one."""
    if not instructions:
        return []
    base = int(instructions[0].address, 16)
    return [i for i in instructions if start <= int(i.address, 16) - base < end]


def report(kernel: str, instructions: list[Instruction], top: int, by_opcode: bool = False, span: str = "") -> str:
    total = sum(i.samples for i in instructions)
    by_reason: Counter[str] = Counter()
    for i in instructions:
        by_reason.update(i.stalls)

    def share(n: int) -> float:
        return 100 * n / total if total else 0.0

    def top2(stalls: dict[str, int]) -> str:  # the two largest reasons
        return ", ".join(f"{r} {n}" for r, n in sorted(stalls.items(), key=lambda kv: -kv[1])[:2])

    lines = [f"# {kernel}", f"# {span}{len(instructions)} SASS instructions, {total} samples",
             "# samples by reason: " + ", ".join(f"{r} {n}" for r, n in by_reason.most_common())]
    if by_opcode:
        samples: Counter[str] = Counter()
        executed: Counter[str] = Counter()
        reasons_by_op: dict[str, Counter[str]] = {}
        for i in instructions:
            op = opcode(i.source)
            samples[op] += i.samples
            executed[op] += i.executed
            reasons_by_op.setdefault(op, Counter()).update(i.stalls)
        lines.append(f"{'opcode':>18} {'samples':>8} {'%':>5} {'executed':>10}  top stall reasons")
        for op, n in samples.most_common():
            lines.append(f"{op:>18} {n:8d} {share(n):5.1f} {executed[op]:10d}  {top2(reasons_by_op[op])}")
    lines.append(f"{'address':>18} {'samples':>8} {'%':>5} {'executed':>10}  {'top stall reasons':40s} instruction")
    for i in sorted(instructions, key=lambda i: -i.samples)[:top]:
        lines.append(f"{i.address:>18} {i.samples:8d} {share(i.samples):5.1f} {i.executed:10d}  "
                     f"{top2(i.stalls):40s} {i.source.strip()}")
    return "\n".join(lines)


def parse_range(text: str) -> tuple[int, int]:
    """START:END, each hexadecimal (0x...) or decimal, START < END; ValueError otherwise."""
    start, sep, end = text.partition(":")
    if not sep:
        raise ValueError(text)
    lo, hi = int(start, 0), int(end, 0)
    if not 0 <= lo < hi:
        raise ValueError(text)
    return lo, hi


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export", type=Path, help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=40, help="instructions listed (default %(default)s)")
    ap.add_argument("--range", default=None, metavar="START:END",
                    help="only the instructions at these offsets from the kernel's first one (hex 0x... or decimal)")
    ap.add_argument("--by-opcode", action="store_true", help="also the samples summed per opcode")
    args = ap.parse_args()
    if args.top < 1:
        ap.error(f"--top={args.top}: expected >= 1")
    span = None
    if args.range is not None:
        try:
            span = parse_range(args.range)
        except ValueError:
            ap.error(f"--range={args.range}: expected START:END offsets with 0 <= START < END (e.g. 0x116c0:0x21be0)")
    try:
        kernel, instructions = read_export(args.export)
    except (OSError, ValueError) as exc:
        print(f"ncu_hotspots.py: {exc}", file=sys.stderr)
        return 2
    label = ""
    if span is not None:
        instructions = in_range(instructions, *span)
        label = f"offsets [{span[0]:#x}, {span[1]:#x}): "
    print(report(kernel, instructions, args.top, args.by_opcode, label))
    return 0


if __name__ == "__main__":
    sys.exit(main())
