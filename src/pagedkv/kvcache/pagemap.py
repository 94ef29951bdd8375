"""A picture of the pools: which sequence owns which block, which blocks are shared, cached or free.

``pagemap_cells`` computes what each block is (plain data, tested on its own); ``render_pagemap`` draws
one panel per pool group and tier with matplotlib's Agg canvas (no global backend switch, no display).
``pagedkv pagemap`` (``add_pagemap_arguments`` / ``run_pagemap``) draws ``demo_manager()``, a manager after
random operations.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pagedkv.kvcache.errors import KVCacheExhaustedError
from pagedkv.kvcache.manager import KVCacheManager
from pagedkv.layout import KVLayout
from pagedkv.pool_group import PoolGroup

FREE, CACHED, OWNED, SHARED = "free", "free (cached prefix)", "owned", "shared"


@dataclass
class Cell:
    block: int
    state: str  # FREE | CACHED | OWNED | SHARED
    holders: list = field(default_factory=list)  # [(seq_id, page)]
    cached: bool = False  # registered in the prefix cache


@dataclass
class Panel:
    title: str
    cells: list


def pagemap_cells(manager) -> list[Panel]:
    """One panel per (group, tier): the state and holders of every block."""
    panels = []
    for g, spec in enumerate(manager.groups):
        holders = [[] for _ in range(manager.num_blocks[g])]
        host_holders = [[] for _ in range(manager.host_blocks[g])]
        for seq_id, st in manager._seqs.items():
            if st.swapped is not None:
                for page, h, _ in st.swapped[g]:
                    host_holders[h].append((seq_id, page))
                continue
            row = manager._tables[g][st.row, :manager._npages[g][st.row]]
            for page, b in enumerate(row):
                if b >= 0:
                    holders[int(b)].append((seq_id, page))
        cells = []
        for b, hs in enumerate(holders):
            cached = manager.prefix is not None and manager.prefix[g].is_cached(b)
            if not hs:
                state = CACHED if cached else FREE
            else:
                state = SHARED if len(hs) > 1 else OWNED
            cells.append(Cell(b, state, hs, cached))
        lay = spec.layout
        window = {"full": "full attention", "release": f"window {spec.window} (released pages)",
                  "cyclic": f"window {spec.window}, ring {lay.cyclic_len} + {lay.ring_sink_tokens} sinks"}[spec.mode.value]
        panels.append(Panel(f"pool group '{spec.name}' (primary): {manager.num_blocks[g]} blocks of "
                            f"{lay.page_size} tokens x {lay.num_layers} layers, {window}", cells))
        if manager.host_blocks[g]:
            host_cells = [Cell(h, FREE if not hs else OWNED, hs) for h, hs in enumerate(host_holders)]
            panels.append(Panel(f"pool group '{spec.name}' (secondary, pinned host): "
                                f"{manager.host_blocks[g]} blocks", host_cells))
    return panels


def _label(seq_id) -> str:
    text = str(seq_id)
    return text if len(text) <= 4 else text[:3] + "~"


def render_pagemap(manager, path, *, title: str | None = None, max_cols: int = 16, dpi: int = 110) -> Path:
    """Draw the page map of ``manager`` to a PNG at ``path``; returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    panels = pagemap_cells(manager)
    seq_ids = list(manager.sequences)
    palette = [
        "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
        "#86bcb6", "#d37295", "#a0cbe8", "#ffbe7d", "#8cd17d", "#f1ce63", "#d4a6c8",
    ]
    color_of = {s: palette[i % len(palette)] for i, s in enumerate(seq_ids)}

    layouts = []
    for panel in panels:
        cols = max(1, min(max_cols, len(panel.cells)))
        layouts.append((cols, max(1, math.ceil(len(panel.cells) / cols))))
    height_units = sum(rows + 1.2 for _, rows in layouts)
    fig = Figure(figsize=(max(8.0, 0.62 * max_cols + 2.5), 0.62 * height_units + 2.0), dpi=dpi)
    FigureCanvasAgg(fig)
    ratios = [rows + 1.2 for _, rows in layouts]
    axes = fig.subplots(len(panels), 1, gridspec_kw={"height_ratios": ratios}, squeeze=False)[:, 0]
    for ax, panel, (cols, rows) in zip(axes, panels, layouts):
        ax.set_xlim(0, cols)
        ax.set_ylim(rows, 0)
        ax.set_aspect("equal")
        ax.axis("off")
        counts = {s: sum(c.state == s for c in panel.cells) for s in (FREE, CACHED, OWNED, SHARED)}
        ax.set_title(panel.title + "\n" + ", ".join(f"{k}: {v}" for k, v in counts.items() if v), fontsize=8.5,
                     loc="left")
        for cell in panel.cells:
            x, y = cell.block % cols, cell.block // cols
            if cell.state in (FREE, CACHED):
                face, hatch = ("#e6e6e6", None) if cell.state == FREE else ("#cfe8c4", None)
                text = f"{cell.block}"
            else:
                face = color_of.get(cell.holders[0][0], "#999999")
                hatch = "///" if cell.state == SHARED else None
                seq, page = cell.holders[0]
                if cell.state == OWNED:
                    text = f"{_label(seq)}:{page}"
                else:  # holders share the block: how many, and the page index when they all agree
                    pages = {p for _, p in cell.holders}
                    text = f"x{len(cell.holders)}" + (f":{page}" if len(pages) == 1 else "")
            ax.add_patch(Rectangle((x + 0.04, y + 0.04), 0.92, 0.92, facecolor=face, edgecolor="#333333",
                                   linewidth=1.6 if cell.cached else 0.5, hatch=hatch))
            ax.text(x + 0.5, y + 0.52, text, ha="center", va="center", fontsize=6.5,
                    color="#222222" if cell.state in (FREE, CACHED) else "white", fontweight="bold")
    handles = [Patch(facecolor=color_of[s], edgecolor="#333333", label=f"seq {s}") for s in seq_ids[:16]]
    handles += [Patch(facecolor="#bbbbbb", edgecolor="#333333", hatch="///", label="shared (refcount > 1)"),
                Patch(facecolor="#cfe8c4", edgecolor="#333333", label="free, cached prefix"),
                Patch(facecolor="#e6e6e6", edgecolor="#333333", label="free"),
                Patch(facecolor="white", edgecolor="#333333", linewidth=1.6, label="bold edge: in prefix cache")]
    fig.legend(handles=handles, loc="lower center", ncol=min(6, len(handles)), fontsize=7, frameon=False)
    fig.suptitle(title or "KV cache page map", fontsize=10, y=0.995)
    fig.text(0.5, 0.945, "cell: sequence:page it holds | xN:page shared by N sequences | number: free block id",
             ha="center", fontsize=8, color="#444444")
    fig.tight_layout(rect=(0, 0.07, 1, 0.925))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


# ---- `pagedkv pagemap` ----------------------------------------------------------------------------
def demo_manager(blocks: int = 48, page_size: int = 4, seqs: int = 6, seed: int = 0, ops: int = 60,
                 window: int = 0, host_blocks: int = 16) -> KVCacheManager:
    """A host-model manager after random operations that leave shared, cached and swapped blocks around.

    One full-attention group with prefix reuse, or, with ``window > 0``, a second group whose sliding window
    releases pages (prefix reuse is then off). Sequences draw prompts that often start like an earlier one.
    """
    for name, value in (("blocks", blocks), ("page_size", page_size), ("seqs", seqs)):
        if value <= 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be > 0, got {value}")
    if ops < 0 or window < 0 or host_blocks < 0:
        raise ValueError(f"--ops, --window, --host-blocks: must be >= 0, got {ops}, {window}, {host_blocks}")
    rng = np.random.default_rng(seed)
    groups = [PoolGroup("full", KVLayout(num_layers=4, num_kv_heads=8, page_size=page_size, head_dim=128))]
    if window:
        groups.append(PoolGroup("window", KVLayout(num_layers=4, num_kv_heads=8, page_size=page_size,
                                                   head_dim=128), window=window))
    mgr = KVCacheManager(groups, blocks, host_blocks=host_blocks, enable_prefix_reuse=not window)
    stems = [rng.integers(1, 30000, size=int(rng.integers(2, 5)) * page_size) for _ in range(3)]
    names = iter(range(10 ** 9))

    def add():
        stem = stems[int(rng.integers(len(stems)))]
        prompt = np.concatenate([stem, rng.integers(1, 30000, size=int(rng.integers(1, 3 * page_size)))])
        sid = f"s{next(names)}"
        mgr.add_sequence(sid, prompt)
        return sid

    def step(sid, n):
        try:
            mgr.reserve(sid, n)
        except KVCacheExhaustedError:
            return False
        mgr.commit(sid, n, None if mgr.prefill_remaining(sid) else rng.integers(1, 30000, size=n))
        return True

    for _ in range(seqs):
        sid = add()
        step(sid, mgr.prefill_remaining(sid) or 1)
    for _ in range(ops):
        live = [s for s in mgr.sequences if not mgr.is_swapped(s)]
        op = rng.choice(["decode"] * 6 + ["fork", "free", "add", "swap"], p=[0.1] * 6 + [0.14, 0.12, 0.1, 0.04])
        if not live or (op == "add" and len(mgr.sequences) < 2 * seqs):
            sid = add()
            step(sid, mgr.prefill_remaining(sid) or 1)
        elif op == "decode":
            step(live[int(rng.integers(len(live)))], 1)
        elif op == "fork" and len(mgr.sequences) < 2 * seqs:
            mgr.fork(live[int(rng.integers(len(live)))], f"s{next(names)}")
        elif op == "free" and len(live) > seqs // 2:
            mgr.free(live[int(rng.integers(len(live)))])
        elif op == "swap" and host_blocks:
            sid = live[int(rng.integers(len(live)))]
            try:
                mgr.swap_out(sid)
            except KVCacheExhaustedError:
                pass
    mgr.validate()
    return mgr


def run_pagemap(args) -> int:
    mgr = demo_manager(blocks=args.blocks, page_size=args.page_size, seqs=args.seqs, seed=args.seed, ops=args.ops,
                       window=args.window, host_blocks=args.host_blocks)
    path = render_pagemap(mgr, args.out, title=f"KV cache page map: demo (seed {args.seed}, {args.ops} random ops)")
    print(f"wrote {path}: {len(mgr.sequences)} sequences, "
          + ", ".join(f"group {g.name!r}: {mgr.num_free(i)}/{mgr.num_blocks[i]} blocks free"
                      for i, g in enumerate(mgr.groups)))
    return 0


def add_pagemap_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=int, default=48, help="primary blocks per pool group (default 48)")
    parser.add_argument("--page-size", type=int, default=4, help="tokens per block (default 4)")
    parser.add_argument("--seqs", type=int, default=6, help="sequences to start with (default 6)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--ops", type=int, default=60, help="random operations after the start (default 60)")
    parser.add_argument("--window", type=int, default=0,
                        help="add a sliding-window pool group with this window (default 0: none)")
    parser.add_argument("--host-blocks", type=int, default=16, help="pinned host-tier blocks (default 16)")
    parser.add_argument("--out", "-o", default="pagemap.png", help="output PNG (default pagemap.png)")
