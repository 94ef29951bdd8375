"""The sm_90a MMA wrappers (plugins/kernels/sm90/wgmma_ops.cuh) are generated text: the committed header must be
what gen_wgmma_ops.py writes, and its --check must notice a header that is not."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

GEN = pathlib.Path(__file__).resolve().parents[1] / "plugins" / "kernels" / "sm90" / "gen_wgmma_ops.py"
HEADER = GEN.with_name("wgmma_ops.cuh")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GEN), *args], capture_output=True, text=True, timeout=60)


def test_committed_header_is_current():
    r = run("--check")
    assert r.returncode == 0, r.stderr


def test_check_reports_a_stale_header(tmp_path):
    stale = tmp_path / "wgmma_ops.cuh"
    stale.write_text(HEADER.read_text().replace("m64n128k16", "m64n120k16", 1))
    r = run("--check", "--header", str(stale))
    assert r.returncode == 1 and "stale" in r.stderr and str(stale) in r.stderr


def test_every_wrapper_lists_all_accumulators():
    # N / 2 f32 accumulator operands per thread for m64nNk16; the asm operand count must match the array.
    text = HEADER.read_text()
    for n in (64, 128):
        blocks = re.findall(rf"m64n{n}k16\.f32\.(?:bf16\.bf16|f16\.f16) \"\s*\"\{{([^}}]*)\}}", text)
        assert len(blocks) == 4, (n, len(blocks))  # bf16 / f16 x ss / rs
        for b in blocks:
            assert len(b.split(",")) == n // 2
