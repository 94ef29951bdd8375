"""``pagedkv pagemap``: build a demo manager, run random operations on it, draw its page map.

``register(subparsers)`` adds the subcommand to the ``pagedkv`` CLI; ``python -m pagedkv.kvcache.cli`` runs
it standalone (same options).
"""

from __future__ import annotations

import argparse

import numpy as np

from pagedkv.kvcache.errors import KVCacheExhaustedError
from pagedkv.kvcache.manager import KVCacheManager
from pagedkv.layout import KVLayout
from pagedkv.pool_group import PoolGroup


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


def _run(args) -> int:
    from pagedkv.kvcache.pagemap import render_pagemap

    mgr = demo_manager(blocks=args.blocks, page_size=args.page_size, seqs=args.seqs, seed=args.seed, ops=args.ops,
                       window=args.window, host_blocks=args.host_blocks)
    path = render_pagemap(mgr, args.out, title=f"KV cache page map: demo (seed {args.seed}, {args.ops} random ops)")
    print(f"wrote {path}: {len(mgr.sequences)} sequences, "
          + ", ".join(f"group {g.name!r}: {mgr.num_free(i)}/{mgr.num_blocks[i]} blocks free"
                      for i, g in enumerate(mgr.groups)))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=int, default=48, help="primary blocks per pool group (default 48)")
    parser.add_argument("--page-size", type=int, default=4, help="tokens per block (default 4)")
    parser.add_argument("--seqs", type=int, default=6, help="sequences to start with (default 6)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--ops", type=int, default=60, help="random operations after the start (default 60)")
    parser.add_argument("--window", type=int, default=0,
                        help="add a sliding-window pool group with this window (default 0: none)")
    parser.add_argument("--host-blocks", type=int, default=16, help="pinned host-tier blocks (default 16)")
    parser.add_argument("--out", "-o", default="pagemap.png", help="output PNG (default pagemap.png)")


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``pagemap`` subcommand to an argparse subparsers object."""
    parser = subparsers.add_parser("pagemap", help="draw the KV pool page map of a demo manager as a PNG",
                                   description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.set_defaults(func=_run)
    return parser


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.kvcache.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
