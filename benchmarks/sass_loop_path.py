"""Instructions per iteration of the QKV write kernel's pass loop, counted in its SASS (benchmarks/NOTES-write.md,
round 4): the shortest path through one iteration of the loop that holds the ring wait (``DEPBAR.LE SB0, 0x3``)
that contains the opcodes a kind of pass must execute and none of those it must not, for a Q pass (shuffle, FFMA
rotation, q store ``STG.E.128``), a K pass (rotation, pool store), a V pass (pool store only) and a Q pass that
enters a token (``MUFU``: its cos/sin). Inner loops (the cursor's token wrap, the V tail) count as not taken, so the
counts are what a pass issues in the common case (predicated-off instructions included: they issue too).

Needs ``cuobjdump`` (the CUDA toolkit's, or pip's nvidia-cuda-cuobjdump). Run on an object file of the build:
    python benchmarks/sass_loop_path.py BUILD/plugins/CMakeFiles/pagedkv_kernels.dir/kernels/qkv_write_bf16.cu.o
prints, for each sm_90 kernel instance, the four counts and the average over a token of H=32, KVH=8, D=128
(16 Q, 4 K, 4 V passes); ``--show KIND`` prints one path.
"""

from __future__ import annotations

import argparse
import functools
import re
import subprocess
import sys

# per kind of pass: (opcodes the path must contain, opcodes it must not); "=OP" matches OP exactly, else a prefix
KINDS = {
    "q": (["SHFL", "STG.E.128", "FFMA"], ["MUFU", "ATOMG", "BAR", "STG.E.64", "{pool}"]),
    "k": (["SHFL", "{pool}", "FFMA"], ["MUFU", "ATOMG", "BAR", "STG.E.128"]),
    "v": (["{pool}"], ["SHFL", "MUFU", "ATOMG", "BAR", "STG.E.128", "FFMA"]),
    "q+entry": (["MUFU", "SHFL", "STG.E.128"], ["ATOMG", "BAR", "{pool}"]),
}


def functions(sass: str, arch: str) -> list[tuple[str, list[tuple[int, str]]]]:
    """(name, [(address, instruction)]) of every kernel of `arch` in cuobjdump -sass output."""
    out = []
    for part in sass.split("\n\tcode for ")[1:]:
        if not part.startswith(arch):
            continue
        for fn in part.split("Function : ")[1:]:
            name = fn.splitlines()[0].strip()
            ins = [(int(m.group(1), 16), m.group(2).strip())
                   for m in re.finditer(r"/\*([0-9a-f]{4,5})\*/\s+(.*?)\s*;", fn)]
            out.append((name, ins))
    return out


def loop_path(ins: list[tuple[int, str]], require: list[str], forbid: list[str]) -> tuple[int, list[int]] | None:
    addr = {a: i for i, (a, _) in enumerate(ins)}

    def target(t: str) -> int | None:
        m = re.search(r"(0x[0-9a-f]+)\s*$", t)
        return int(m.group(1), 16) if m and re.search(r"\bBRA\b", t) else None

    waits = [a for a, t in ins if t.startswith("DEPBAR.LE SB0, 0x3")]
    back = [(a, target(t)) for a, t in ins if t.startswith("@") and target(t) is not None and target(t) < a
            and any(target(t) <= w <= a for w in waits)]
    end, head = min(back, key=lambda e: e[0] - e[1])  # the innermost loop around the wait
    leaders = {head}
    for i, (a, t) in enumerate(ins):
        if target(t) is not None:
            leaders.add(target(t))
            if i + 1 < len(ins):
                leaders.add(ins[i + 1][0])
    blocks: dict[int, list[tuple[int, str]]] = {}
    current = None
    for a, t in ins:
        if head <= a <= end:
            if a in leaders or current is None:
                current = a
                blocks[a] = []
            blocks[current].append((a, t))

    def op(t: str) -> str:
        return re.sub(r"^@!?U?P\w+\s+", "", t).split()[0]

    def hit(o: str, pattern: str) -> bool:
        return o == pattern[1:] if pattern.startswith("=") else o.startswith(pattern)

    def successors(b: int) -> list[int]:
        last_a, last = blocks[b][-1]
        nxt = ins[addr[last_a] + 1][0] if addr[last_a] + 1 < len(ins) else None
        out = []
        tg = target(last)
        if tg is not None and "BRA.DIV" not in last and (tg > last_a or last_a == end):
            out.append(tg)
        unconditional = last.startswith("BRA ") or last.startswith("EXIT") or last.startswith("RET")
        if not unconditional and nxt is not None and nxt not in out:
            out.append(nxt)
        return [s for s in out if s in blocks and s != head]

    @functools.lru_cache(maxsize=None)
    def best(b: int, got: int) -> tuple[int, tuple[int, ...]] | None:
        ops = [op(t) for _, t in blocks[b]]
        if any(hit(o, f) for o in ops for f in forbid):
            return None
        for i, r in enumerate(require):
            if any(hit(o, r) for o in ops):
                got |= 1 << i
        n = len(blocks[b])
        if blocks[b][-1][0] == end:
            return (n, (b,)) if got == (1 << len(require)) - 1 else None
        found = None
        for s in successors(b):
            r = best(s, got)
            if r and (found is None or r[0] + n < found[0]):
                found = (r[0] + n, (b,) + r[1])
        return found

    sys.setrecursionlimit(100_000)
    found = best(head, 0)
    if found is None:
        return None
    return found[0], [a for b in found[1] for a, _ in blocks[b]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("object", help="an object file or cubin holding qkvWriteKernel instances")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--show", choices=sorted(KINDS), help="print the path of this kind for every instance")
    args = ap.parse_args()
    sass = subprocess.run(["cuobjdump", "-sass", args.object], check=True, capture_output=True, text=True).stdout
    for name, ins in functions(sass, args.arch):
        if "qkvWriteKernel" not in name:
            continue
        one_byte = re.search(r"CacheDTypeE[23]", name) is not None  # fp8 / int8 caches store 8 B per lane
        pool = "ST.E.64" if one_byte else "ST.E.128"
        counts = {}
        for kind, (require, forbid) in KINDS.items():
            found = loop_path(ins, [r.format(pool=pool) for r in require], [f.format(pool=pool) for f in forbid])
            counts[kind] = found[0] if found else None
            if args.show == kind and found:
                text = dict(ins)
                print("\n".join(f"  {a:#06x} {text[a]}" for a in found[1]))
        avg = (16 * counts["q"] + 4 * counts["k"] + 4 * counts["v"]) / 24 if None not in counts.values() else None
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in counts.items()) +
              (f"; per pass over a token {avg:.1f}" if avg is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
