"""What balancing the decode's work across SMs could give, modelled from measured per-SM rates.

``benchmarks/variants/diag-decode-cta-times.diff`` measures every decode CTA's run and its SM; on the H100s and the
H200 measured so far an SM's rate is a fixed property of the SM (24 of 132 SMs run their CTAs ~25 % faster, launch
after launch), so a launch of equal CTAs ends when the slow SMs do while the fast ones idle. This model takes those
per-SM rates and compares three schedules of one launch's work (``units`` equal (sequence, KV head) units):

* ``static``: what the kernel does now -- one CTA per unit, all CTAs resident at once (``slots`` per SM); the launch
  takes the slowest CTA's run. It should reproduce the measured window: the check of the model.
* ``split n``: each unit cut into n equal pieces, n x units CTAs handed to slots as they free up (the block
  scheduler), each piece paying ``ramp`` (its prologue and pipeline fill, unhidden), then a merge kernel of
  ``merge_per_piece`` x pieces. ``--sweep`` fits ramp and merge_per_piece to a measured split sweep (least squares).
* ``queue f``: persistent takers (one per slot) that take items in order from a queue: the units whole, except the
  last fraction f of the work cut into pieces of ``--piece`` units; a taker pays ``ramp`` once (its later items'
  loads are issued under the current item's tail) plus ``item_cost`` per item, and every piece ``merge_per_piece``
  (read back and folded by the unit's last arrival).

* ``kernel``: the balanced decode as the variants build it (``--unit-grains``: a unit's length in 64-token grains):
  the closed-form guided intervals of ``attention_balance.h`` over the units laid end to end (each interval what is
  left over d x takers, down to a floor, then floor-sized), an interval cut into one segment per unit it overlaps;
  a taker claims an interval when it frees and pays ``item_cost`` for every segment. Reported over a range of
  per-segment costs for the variants' schedule (d = 2, 256-token floor) and a coarser one (d = 1, 512-token floor):
  which cost the measured A/B implies, and what cutting it (or the segment count) would give.

A slot's rate is its SM's: with k CTAs resident on an SM, each of its slots runs at 1/k of what the SM streams, which
is what the measured runs already say (they were measured k at a time). SMs that held no CTA in the measurement get
the median rate. Bandwidth does not shift when SMs idle (the measured groups keep their rates), so this is the bound
side of the estimate, not a prediction of a kernel.

    python benchmarks/decode_balance_model.py benchmarks/results/h100-ec6d24b-diag-decode-cta-64x4K-P16.json \\
        --units 512 --slots 4 --sweep 1:374.4,2:378.3,3:380.7,4:383.5,6:386.2,8:388.2
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import statistics
import sys
from pathlib import Path


def per_sm_runs(path: Path) -> dict[int, float]:
    """SM -> median run of its CTAs (us), from decode_cta_times.py's JSON: its ``raw`` stamps (ns, per launch:
    [index, sm, entry, ready, loop, exit]) or a reduced ``per_sm`` table."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or ("per_sm" not in data and "raw" not in data):
        raise ValueError(f"{path}: neither 'raw' nor 'per_sm' (not a decode_cta_times.py JSON)")
    try:
        if "per_sm" in data:
            runs = {int(sm): float(v["median_run_us"]) for sm, v in data["per_sm"].items()}
        else:
            stamps: dict[int, list[float]] = {}
            for launch in data["raw"]:
                for _index, sm, _entry, ready, _loop, exit_ in launch:
                    stamps.setdefault(int(sm), []).append((exit_ - ready) * 1e-3)
            runs = {sm: statistics.median(v) for sm, v in stamps.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path}: a malformed entry ({type(exc).__name__}: {exc})") from None
    if not runs or min(runs.values()) <= 0:
        raise ValueError(f"{path}: no positive run times")
    return runs


def slot_speeds(runs: dict[int, float], sms: int, slots: int) -> list[float]:
    """Work units (one unit = one CTA's work in the measurement) per us of every slot, in the order the block
    scheduler fills them: every SM's first slot, then every SM's second, ... (so that 512 CTAs over 132 x 4 slots
    leave 16 SMs with 3, as measured)."""
    fallback = statistics.median(runs.values())
    return [1.0 / runs.get(sm, fallback) for _ in range(slots) for sm in range(sms)]


def list_schedule(costs_at, speeds: list[float], count: int) -> float:
    """Items 0..count-1 handed in order to whichever slot frees first; costs_at(i, speed, first) is item i's time on
    a slot of that speed (first: the slot's first item). Returns when the last item ends."""
    free = [(0.0, s) for s in range(len(speeds))]
    heapq.heapify(free)
    started: set[int] = set()
    end = 0.0
    for i in range(count):
        t, s = heapq.heappop(free)
        t += costs_at(i, speeds[s], s not in started)
        started.add(s)
        end = max(end, t)
        heapq.heappush(free, (t, s))
    return end


def static_time(speeds: list[float], units: int) -> float:
    """One CTA a unit, handed out in order (with every CTA resident at once when units <= slots)."""
    return list_schedule(lambda i, v, first: 1.0 / v, speeds, units)


def split_body(speeds: list[float], units: int, n: int, ramp: float) -> float:
    """The pieces' part of a split launch: n pieces a unit handed to slots as they free up, each paying `ramp`."""
    return list_schedule(lambda i, v, first: ramp + (1.0 / n) / v, speeds, units * n)


def tail_items(units: int, tail: float, piece: float) -> list[float]:
    """Whole units for the first 1 - tail of the work, then pieces of `piece` units."""
    whole = round(units * (1.0 - tail))
    per_unit = max(1, round(1.0 / piece))
    return [1.0] * whole + [1.0 / per_unit] * ((units - whole) * per_unit)


def guided_items(units: int, takers: int, divisor: float = 2.0, smallest: float = 1 / 32) -> list[float]:
    """Guided self-scheduling within units: each item is what is left of the whole launch over divisor x takers,
    at least `smallest` and at most what is left of its unit (an item never spans two units)."""
    sizes, left = [], float(units)
    unit_left = 1.0
    while left > 1e-9:
        size = min(unit_left, max(smallest, left / (divisor * takers)))
        sizes.append(size)
        left -= size
        unit_left -= size
        if unit_left <= 1e-9:
            unit_left = 1.0
    return sizes


def queue_time(takers: list[float], sizes: list[float], ramp: float, item_cost: float,
               merge_per_piece: float) -> float:
    """Persistent takers of the given speeds take the items (sizes in units) in order; each taker pays `ramp` once,
    `item_cost` an item and `merge_per_piece` for an item that is less than a whole unit."""
    def cost(i: int, speed: float, first: bool) -> float:
        size = sizes[i]
        return size / speed + item_cost + (merge_per_piece if size < 1.0 else 0.0) + (ramp if first else 0.0)

    return list_schedule(cost, takers, len(sizes))


def kernel_boundaries(total: int, takers: int, divisor: int, floor: int) -> list[int]:
    """attention_balance.h's interval boundaries (balanceIntervals) in grains: guided while first r^k >= floor (first
    = total / (d T), r = 1 - 1 / (d T), d T >= 2), then floor-sized intervals; [0, ..., total]."""
    if total <= 0:
        return [0]
    dt = max(2.0, float(divisor * takers))
    log2r = math.log2(1.0 - 1.0 / dt)
    first = total / dt
    guided = 0
    while first * 2.0 ** (guided * log2r) >= floor:
        guided += 1
    bounds = [0] + [math.floor(total * (1.0 - 2.0 ** (k * log2r))) for k in range(1, guided + 1)]
    while bounds[-1] < total:
        bounds.append(min(total, bounds[-1] + floor))
    return bounds


def kernel_items(units: int, unit_grains: int, takers: int, divisor: int, floor: int) -> list[list[float]]:
    """Per interval (the order takers claim them), its segments' sizes in units: the interval cut at the units' ends."""
    bounds = kernel_boundaries(units * unit_grains, takers, divisor, floor)
    items = []
    for a, b in itertools.pairwise(bounds):
        segments, x = [], a
        while x < b:
            end = min(b, (x // unit_grains + 1) * unit_grains)
            segments.append((end - x) / unit_grains)
            x = end
        items.append(segments)
    return items


def kernel_time(takers: list[float], items: list[list[float]], ramp: float, item_cost: float,
                merge_per_piece: float) -> float:
    """Takers claim intervals in order as they free; every segment costs item_cost plus its streaming, a partial one
    merge_per_piece more; ramp once a taker."""
    def cost(i: int, speed: float, first: bool) -> float:
        return sum(seg / speed + item_cost + (merge_per_piece if seg < 1.0 else 0.0) for seg in items[i]) + (
            ramp if first else 0.0)

    return list_schedule(cost, takers, len(items))


# (d, floor in grains): the schedule of decode-balanced.diff, and a coarser one (fewer, longer segments)
KERNEL_VERSIONS = {"variants": (2, 4), "coarse": (1, 8)}
KERNEL_ITEM_COSTS = (0.3, 1.0, 2.0, 3.0, 4.0, 6.0)


def fit_split(speeds: list[float], units: int, sweep: dict[int, float]) -> dict:
    """ramp and merge_per_piece (us) that fit a split launch (split_body, then a merge kernel of merge_per_piece a
    piece for n > 1) to the measured sweep, by grid search (the model is monotone in both; a grid keeps it
    dependency-free and exact enough for a bound), with the fixed offset, the rms error and every chunk count's
    modelled time. The measured times include a fixed offset (launch, the dependency wait): fitted as the mean
    residual."""
    best: dict = {"rms": float("inf")}
    for ramp10 in range(201):  # 0 .. 20 us in 0.1 us
        ramp = ramp10 / 10
        body = {n: split_body(speeds, units, n, ramp) for n in sweep}  # the schedule does not depend on the merge
        for merge1000 in range(101):  # 0 .. 0.1 us a piece (a merge kernel's time over its pieces)
            merge = merge1000 / 1000
            modelled = {n: body[n] + (merge * units * n if n > 1 else 0.0) for n in sweep}
            offset = statistics.mean(sweep[n] - modelled[n] for n in sweep)
            rms = statistics.mean((sweep[n] - modelled[n] - offset) ** 2 for n in sweep) ** 0.5
            if rms < best["rms"]:
                best = {"ramp": ramp, "merge_per_piece": merge, "offset": offset, "rms": rms,
                        "rows": [{"chunks": n, "measured": sweep[n], "model": modelled[n] + offset}
                                 for n in sorted(sweep)]}
    return best


def model(runs: dict[int, float], units: int, slots: int, sms: int, sweep: dict[int, float] | None, ramp: float,
          merge: float, item_cost: float, takers_per_sm: int, unit_grains: int = 0) -> dict:
    """Every schedule's time (us); one unit of the launch = one measured CTA's work (the runs were measured at this
    shape)."""
    speeds = slot_speeds(runs, sms, slots)
    out: dict = {"sms_measured": len(runs), "run_min": min(runs.values()), "run_max": max(runs.values()),
                 "units": units, "slots": slots, "sms": sms, "static": static_time(speeds, units),
                 "bound": units / sum(speeds)}
    if sweep:
        out["split_fit"] = fit_split(speeds, units, sweep)
        ramp, merge = out["split_fit"]["ramp"], out["split_fit"]["merge_per_piece"]
    # Persistent takers: takers_per_sm a SM, each at its share of what the SM streams (the measured CTAs ran `slots`
    # at a time, so an SM streams slots / run units an us).
    sm_speed = [slots * v for v in slot_speeds(runs, sms, 1)]
    takers = [v / takers_per_sm for _ in range(takers_per_sm) for v in sm_speed]
    out["queue"] = {"takers": len(takers), "ramp": ramp, "item_cost": item_cost, "merge_per_piece": merge,
                    "tail": [{"tail": tail, "piece": piece,
                              "us": queue_time(takers, tail_items(units, tail, piece), ramp, item_cost, merge)}
                             for tail in (1.0, 0.5, 0.25) for piece in (0.5, 0.25, 0.125, 0.0625)],
                    "guided": []}
    for divisor in (1.0, 2.0, 4.0):
        sizes = guided_items(units, len(takers), divisor)
        out["queue"]["guided"].append({"divisor": divisor, "items": len(sizes),
                                       "us": queue_time(takers, sizes, ramp, item_cost, merge)})
    if unit_grains > 0:
        out["kernel"] = []
        for version, (divisor, floor) in KERNEL_VERSIONS.items():
            items = kernel_items(units, unit_grains, len(takers), divisor, floor)
            segments = sum(len(i) for i in items)
            out["kernel"].append({"version": version, "divisor": divisor, "floor_grains": floor,
                                  "intervals": len(items), "segments": segments,
                                  "us": {str(c): kernel_time(takers, items, ramp, c, merge) for c in KERNEL_ITEM_COSTS}})
    return out


def report(name: str, r: dict) -> str:
    def pct(t: float) -> str:
        return f"{100 * (t / r['static'] - 1):+5.1f} %"

    lines = [(f"# {name}: {r['sms_measured']} SMs measured, runs {r['run_min']:.1f}-{r['run_max']:.1f} us; "
              f"{r['units']} units over {r['sms']} x {r['slots']} slots"),
             f"static (one CTA a unit, as now)      {r['static']:8.1f} us  (the measured window's model)",
             f"every slot busy to the end (bound)   {r['bound']:8.1f} us  ({pct(r['bound'])})"]
    if "split_fit" in r:
        f = r["split_fit"]
        lines.append(f"split sweep fit: ramp {f['ramp']:.1f} us a CTA, merge {1000 * f['merge_per_piece']:.1f} ns a "
                     f"piece, fixed {f['offset']:.1f} us, rms {f['rms']:.2f} us")
        lines += [f"  split {row['chunks']:3d}: measured {row['measured']:7.1f}  model {row['model']:7.1f}"
                  for row in f["rows"]]
    q = r["queue"]
    lines.append(f"queue: {q['takers']} takers, ramp {q['ramp']:g} us once, {q['item_cost']:g} us an item, "
                 f"{1000 * q['merge_per_piece']:.1f} ns a piece")
    for tail in (1.0, 0.5, 0.25):
        cells = [f"1/{round(1 / c['piece'])}: {c['us']:6.1f} ({pct(c['us'])})" for c in q["tail"] if c["tail"] == tail]
        lines.append(f"  {'all units cut' if tail == 1.0 else f'last {100 * tail:g} % cut':14s} " + "  ".join(cells))
    lines += [f"  guided, left / ({g['divisor']:g} x takers), >= 1/32: {g['items']} items, {g['us']:6.1f} "
              f"({pct(g['us'])})" for g in q["guided"]]
    for k in r.get("kernel", []):
        cells = "  ".join(f"{c} us: {t:6.1f} ({pct(t)})" for c, t in k["us"].items())
        lines.append(f"kernel {k['version']} (d = {k['divisor']}, floor {64 * k['floor_grains']} tokens): "
                     f"{k['intervals']} intervals, {k['segments']} segments; by cost a segment: {cells}")
    return "\n".join(lines)


def parse_sweep(text: str) -> dict[int, float]:
    out = {}
    try:
        for pair in text.split(","):
            n, _, us = pair.partition(":")
            out[int(n)] = float(us)
    except ValueError:
        raise ValueError(f"--sweep={text}: expected chunks:us pairs, e.g. 1:374.4,2:378.3,4:383.5") from None
    if 1 not in out or len(out) < 3:
        raise ValueError(f"--sweep={text}: expected chunks:us pairs including 1 and at least two more")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cta_json", type=Path, help="decode_cta_times.py --json output (raw stamps or per_sm table)")
    ap.add_argument("--units", type=int, required=True, help="(sequence, KV head) units of the launch")
    ap.add_argument("--slots", type=int, default=1, help="CTAs resident per SM in the measurement (default 1)")
    ap.add_argument("--sms", type=int, default=132, help="SMs of the GPU (default %(default)s)")
    ap.add_argument("--sweep", help="measured split sweep, chunks:us pairs (fits ramp and merge cost)")
    ap.add_argument("--ramp", type=float, default=2.0, help="us a CTA or taker pays before streaming (without --sweep)")
    ap.add_argument("--merge-per-piece", type=float, default=0.005, help="us of merge per piece (without --sweep)")
    ap.add_argument("--item-cost", type=float, default=0.3, help="us a queue item costs a taker (claim, Q, epilogue)")
    ap.add_argument("--takers-per-sm", type=int, default=1, help="persistent takers a SM (default %(default)s)")
    ap.add_argument("--unit-grains", type=int, default=0,
                    help="a unit's length in 64-token grains: also model the balanced decode's kernel schedules")
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    args = ap.parse_args()
    for name in ("units", "slots", "sms", "takers_per_sm"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected >= 1")
    if args.unit_grains < 0:
        ap.error(f"--unit-grains={args.unit_grains}: expected >= 0 (0: no kernel schedules)")
    try:
        runs = per_sm_runs(args.cta_json)
        sweep = parse_sweep(args.sweep) if args.sweep else None
    except (OSError, ValueError) as exc:
        print(f"decode_balance_model.py: {exc}", file=sys.stderr)
        return 2
    result = model(runs, args.units, args.slots, args.sms, sweep, args.ramp, args.merge_per_piece, args.item_cost,
                   args.takers_per_sm, args.unit_grains)
    print(report(args.cta_json.name, result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
