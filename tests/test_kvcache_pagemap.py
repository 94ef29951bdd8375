"""The page map: cell states follow the manager; the PNG is written from Python and from the CLI."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.kvcache import KVCacheManager, PoolGroup, render_pagemap
from pagedkv.cli import build_parser, main
from pagedkv.kvcache.pagemap import CACHED, FREE, OWNED, SHARED, demo_manager, pagemap_cells
from pagedkv.layout import KVLayout


def test_cells_follow_the_manager():
    mgr = KVCacheManager([PoolGroup("g", KVLayout(1, 1, 4, 1))], 8, host_blocks=3, enable_prefix_reuse=True)
    mgr.add_sequence("a", list(range(1, 10)))
    mgr.reserve("a", 9)
    mgr.commit("a", 9)            # blocks 0, 1 (full, cached), 2 (partial)
    mgr.fork("a", "b")            # all three shared
    mgr.add_sequence("c", [5] * 5)
    mgr.reserve("c", 5)
    mgr.commit("c", 5)            # blocks 3 (cached), 4
    mgr.free("c")                 # 3: free but cached; 4: free
    mgr.add_sequence("d", [7] * 4)
    mgr.reserve("d", 4)
    mgr.commit("d", 4)
    mgr.swap_out("d")             # its page goes to host block 0
    primary, host = pagemap_cells(mgr)
    states = [c.state for c in primary.cells]
    assert states[:3] == [SHARED] * 3 and primary.cells[0].holders == [("a", 0), ("b", 0)]
    assert primary.cells[0].cached and not primary.cells[2].cached
    assert states[3] == CACHED and states[4] == FREE
    assert [c.state for c in host.cells] == [OWNED, FREE, FREE] and host.cells[0].holders == [("d", 0)]
    assert "secondary" in host.title and "'g' (primary)" in primary.title


def test_render_pagemap_writes_a_png(tmp_path):
    import matplotlib.image

    mgr = demo_manager(blocks=40, page_size=4, seqs=5, seed=3, ops=30, window=12)
    path = render_pagemap(mgr, tmp_path / "sub" / "map.png", title="test")
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 400
    assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 8  # a picture, not a blank canvas


def test_cli_pagemap(tmp_path, capsys):
    out = tmp_path / "pm.png"
    assert main(["pagemap", "--blocks", "24", "--seqs", "3", "--seed", "1", "--ops", "20", "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000 and "wrote" in capsys.readouterr().out
    args = build_parser().parse_args(["pagemap", "--page-size", "8", "--window", "16"])
    assert (args.page_size, args.window, args.blocks, args.out) == (8, 16, 48, "pagemap.png")
    with pytest.raises(ValueError, match="--page-size: must be > 0, got 0"):
        demo_manager(page_size=0)


def test_demo_manager_is_reproducible_and_valid():
    a, b = demo_manager(seed=7), demo_manager(seed=7)
    assert [a.block_row(s).tolist() for s in a.sequences if not a.is_swapped(s)] == \
           [b.block_row(s).tolist() for s in b.sequences if not b.is_swapped(s)]
    states = {c.state for p in pagemap_cells(a) for c in p.cells}
    assert {SHARED, OWNED} <= states  # the demo shows sharing
