"""A picture of the pools: which sequence owns which block, which blocks are shared, cached or free.

``pagemap_cells`` computes what each block is (plain data, tested on its own); ``render_pagemap`` draws
one panel per pool group and tier with matplotlib's Agg canvas (no global backend switch, no display).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path


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
