"""The serving benchmarks run as documented (a CPU check of the scripts; the figures come from the GPU machine):
``benchmarks/bench_serving.py --backend reference --config tiny`` and ``benchmarks/bench_runtime.py`` write sane
JSON, and ``--backend cuda`` without a GPU says why in one line.
"""

from __future__ import annotations

import csv
import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv import cuda

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, expect: int = 0) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert run.returncode == expect, run.stdout + run.stderr
    return run


def _module(script: str, monkeypatch):
    """A benchmark script imported as a module (registered in sys.modules while it loads: dataclasses resolve their
    annotations through it)."""
    name = script.removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_bench_serving_on_the_references(tmp_path):
    out = tmp_path / "serving.json"
    run = _run("bench_serving.py", "--backend", "reference", "--config", "tiny", "--num-prompts", "4",
               "--input-len", "24", "--output-len", "5", "--ort-threads", "1", "--json", str(out))
    r = json.loads(out.read_text())
    assert r["output_tokens"] == 4 * 5 and r["steps"] == 5 and r["ort_threads"] == 1
    assert r["output_tokens_per_s"] > 0 and 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p90"]
    t = r["time_s"]
    assert t["kernels"] is None and r["kernel_share"] is None  # the references have no device kernels to time
    assert t["execute_rest"] == pytest.approx(t["execute"])
    assert 0 < t["host"] < t["execute"] < r["wall_s"]
    assert "# bench_serving: tiny" in run.stdout and "# reproduce:" in run.stdout


def test_bench_runtime_host_json(tmp_path):
    out = tmp_path / "runtime.json"
    _run("bench_runtime.py", "--seqs", "4,8", "--context", "40", "--steps", "5", "--json", str(out))
    r = json.loads(out.read_text())
    assert [row["seqs"] for row in r["host"]] == [4, 8] and r["device"] == []
    assert all(row["host"] > 0 and row["p90_host"] >= row["host"] for row in r["host"])


@pytest.mark.skipif(cuda.why_no_gpu() is None, reason="a GPU is present: tests/gpu runs the cuda variants")
@pytest.mark.parametrize("script", ["bench_serving.py", "bench_runtime.py"])
def test_cuda_variants_say_why_without_a_gpu(script):
    run = _run(script, "--backend", "cuda", expect=2)
    assert "--backend cuda needs a GPU" in run.stderr and run.stderr.count("\n") == 1


def test_ab_attention_checks_its_arguments():
    run = _run("ab_attention.py", "--label", "base", "--cases", "prefill,bogus", expect=2)
    assert "--cases=prefill,bogus: expected a comma-separated subset of prefill, decode" in run.stderr
    run = _run("ab_attention.py", "--label", "base", "--rounds", "0", expect=2)
    assert "--rounds=0: expected >= 1" in run.stderr


def test_bench_attention_checks_its_head_dims():
    run = _run("bench_attention.py", "--cases", "headdim", "--head-dims", "64,72", expect=2)
    assert "--head-dims='64,72': expected a non-empty subset of 64, 80, 96, 256" in run.stderr
    run = _run("bench_attention.py", "--cases", "headdim", "--head-dims", "sixty", expect=2)
    assert "--head-dims='sixty': expected integers from 64, 80, 96, 256" in run.stderr


def test_profile_attention_checks_its_arguments():
    run = _run("profile_attention.py", "decode", "--cache", "fp8", expect=2)
    assert "--cache fp8: only with the prefill case (the fp8 case is the decode's)" in run.stderr
    run = _run("profile_attention.py", "prefill", "--impl", "xqa", expect=2)
    assert "--impl xqa: only with the decode case" in run.stderr
    run = _run("profile_attention.py", "decode", "--impl", "fa3", expect=2)
    assert "--impl fa3: only with the prefill case" in run.stderr
    run = _run("profile_attention.py", "prefill", "--head-dim", "72", expect=2)
    assert "--head-dim=72: expected one of (32, 64, 80, 96, 128, 256)" in run.stderr


def test_bench_attention_split_sweep_forces_plans_the_launcher_makes():
    # --cases splits times each of split_counts through PAGEDKV_DECODE_CHUNKS: the plan the launcher then makes (the
    # same planAttention, given the count) cuts each shape into at most that many chunks of >= 256 tokens, at the
    # width the sweep forces, with one plan per count that differs from the unsplit one.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_attention as bench
    finally:
        sys.path.pop(0)
    from pagedkv.config import AttentionConfig, PoolConfig
    from pagedkv.kernels import attention as A
    from pagedkv.layout import CacheDType

    assert "splits" in _run("bench_attention.py", "--help").stdout
    assert "--cases: unknown ['split']" in _run("bench_attention.py", "--cases", "splits,split", expect=2).stderr
    cfg = AttentionConfig(num_q_heads=bench.H, pool=PoolConfig(num_kv_heads=bench.KVH, head_dim=bench.D, page_size=16,
                                                                num_layers=1, layer_index=0,
                                                                cache_dtype=CacheDType.BF16))
    for batch, length in bench.SPLIT_SWEEP_SHAPES:
        counts = bench.split_counts(batch, length)
        assert counts[0] == 1 and len(counts) >= 8, (batch, length, counts)
        ws = A.attention_workspace_bytes(batch, batch, bench.H, bench.D, length, 16)
        params = A.attention_params(cfg, io_dtype=A.IODType.BF16, num_tokens=batch, num_seqs=batch,
                                    max_blocks=length // 16, max_q_len=1, max_kv_len=length, workspace_bytes=ws)
        for warps, occupancy in zip(A.DECODE_WIDTHS, ((4, 0, 0), (0, 2, 0), (0, 0, 1)), strict=True):
            for n in counts:
                plan = A.attention_plan(params, decode_ctas_per_sm=occupancy, decode_chunks=n)
                grid = plan["decode_grid"][2]
                assert plan["decode_warps"] == warps and 1 <= grid <= n, (batch, length, warps, n, grid)
                assert grid == 1 or plan["decode_chunk_len"] >= 256
                assert (grid > 1) == (n > 1), "every count past 1 splits: the sweep never times the plan twice"


def test_profile_write_checks_its_arguments():
    run = _run("profile_write.py", "decode", "--impl", "flashinfer", "--cache", "fp8", expect=2)
    assert "--impl flashinfer: its append copies into a bf16 cache, not --cache fp8" in run.stderr
    run = _run("profile_write.py", "decode", "--impl", "flashinfer_fp8", expect=2)
    assert "--impl flashinfer_fp8: only with --cache fp8" in run.stderr
    run = _run("profile_write.py", "decode", "--impl", "flashinfer_fp8", "--cache", "fp8", "--q-fp8", expect=2)
    assert "--q-fp8: only with --impl ours" in run.stderr
    run = _run("profile_write.py", "prefill", "--batch", "0", expect=2)
    assert "--batch=0: expected >= 1" in run.stderr


@pytest.mark.skipif(cuda.why_no_gpu() is None, reason="a GPU is present: the A/B tool would time its kernels")
def test_ab_attention_says_why_without_a_gpu():
    run = _run("ab_attention.py", "--label", "base", expect=2)
    assert run.stderr.startswith("ab_attention needs a GPU: ") and run.stderr.count("\n") == 1


def test_gpu_ab_refuses_bad_variants_before_building(tmp_path):
    """.ci/gpu-ab.sh checks every variant before it builds anything: a missing file or a patch that does not apply
    to the tree is one line naming it, exit 2."""
    def gpu_ab(*args):
        return subprocess.run(["bash", str(ROOT / ".ci" / "gpu-ab.sh"), *args], capture_output=True, text=True,
                              timeout=60, cwd=ROOT, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})

    run = gpu_ab()
    assert run.returncode == 2 and run.stderr.startswith("usage: bash .ci/gpu-ab.sh")
    missing = tmp_path / "missing.diff"
    run = gpu_ab(str(missing))
    assert run.returncode == 2 and run.stderr == f"gpu-ab.sh: variant={missing}: no such file\n"
    stale = tmp_path / "stale.diff"
    stale.write_text("--- a/README.md\n+++ b/README.md\n@@ -1,1 +1,1 @@\n-no such first line\n+x\n")
    run = gpu_ab(str(stale))
    assert run.returncode == 2 and run.stderr == f"gpu-ab.sh: variant={stale}: does not apply to this tree\n"
    assert not (tmp_path / "out").exists()  # nothing built, nothing written


def test_source_hashes_records_what_a_build_reads():
    """.ci/source-hashes.sh is the record .ci/gpu-run.sh compares before it installs a prebuilt wheel: the wheel's list
    holds every compiled source plus the packaged Python, one "sha1  path" line each, sorted, no bytecode."""
    def hashes(what, expect=0):
        r = subprocess.run(["bash", str(ROOT / ".ci" / "source-hashes.sh"), what], capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
        assert r.returncode == expect, r.stderr
        return r
    compiled = hashes("compiled").stdout.splitlines()
    wheel = hashes("wheel").stdout.splitlines()
    assert set(compiled) < set(wheel) and wheel == sorted(wheel, key=lambda s: s.encode())
    paths = {line[42:] for line in wheel}
    assert {"CMakeLists.txt", "pyproject.toml", "plugins/kernels/attention_decode.cu", "src/pagedkv/_lib.py"} <= paths
    assert all(len(line) > 42 and line[40:42] == "  " for line in wheel)
    assert not any("__pycache__" in p or p.endswith(".pyc") for p in paths)
    bad = hashes("everything", expect=2)
    assert bad.stderr == "source-hashes.sh: what=everything: expected compiled or wheel\n"


def test_prebuild_gpu_wheel_needs_the_tensorrt_headers(tmp_path):
    missing = tmp_path / "kernel_lens.whl"
    r = subprocess.run(["bash", str(ROOT / ".ci" / "prebuild-gpu-wheel.sh")], capture_output=True, text=True,
                       timeout=60, cwd=ROOT, env={**os.environ, "PAGEDKV_KERNEL_LENS_WHEEL": str(missing)})
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert f"PAGEDKV_KERNEL_LENS_WHEEL={missing}: no such file" in r.stderr


def _fake_wheel(folder, payload: bytes, record: str):
    # a wheel-named zip whose library is `payload`, an executable beside it, and the record of its sources
    import zipfile

    folder.mkdir(parents=True)
    with zipfile.ZipFile(folder / "pagedkv-0.1.0-py3-none-linux_x86_64.whl", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("pagedkv/lib/libpagedkv_capi.so", payload)
        info = zipfile.ZipInfo("pagedkv/lib/pagedkv_testhost")
        info.external_attr = 0o755 << 16
        z.writestr(info, b"#!host")
    (folder / "source-hashes").write_text(record)


def test_prebuilt_wheels_archive_finds_the_build_of_a_record(tmp_path):
    """.ci/prebuilt_wheels.py: the tree's wheel and a variant's in one archive; `find` extracts the one whose record is
    the tree's (a valid wheel, entries stored, modes kept), exits 1 when none is, and bad entries are refused."""
    import zipfile

    tool = ROOT / ".ci" / "prebuilt_wheels.py"
    base = os.urandom(1 << 18)  # incompressible alone: only the shared dictionary makes the second copy cheap
    _fake_wheel(tmp_path / "tree", base, "aaaa  plugins/kernels/attention_plan.cpp\n")
    _fake_wheel(tmp_path / "var", base[:1000] + b"variant" + base[1007:], "bbbb  plugins/kernels/attention_plan.cpp\n")
    archive = tmp_path / "out" / "wheels.tar.xz"

    def tool_run(*args, expect=0):
        r = subprocess.run([sys.executable, str(tool), *map(str, args)], capture_output=True, text=True, timeout=120)
        assert r.returncode == expect, r.stdout + r.stderr
        return r

    tool_run("pack", archive, f"tree={tmp_path / 'tree'}", f"ws8-x={tmp_path / 'var'}")
    assert archive.stat().st_size < 1.1 * len(base)  # two wheels of it: the second copy comes almost free
    assert tool_run("list", archive).stdout.split() == ["tree", "pagedkv-0.1.0-py3-none-linux_x86_64.whl",
                                                         "ws8-x", "pagedkv-0.1.0-py3-none-linux_x86_64.whl"]
    for label in ("tree", "ws8-x"):
        src = tmp_path / ("tree" if label == "tree" else "var")
        found = tool_run("find", archive, src / "source-hashes", tmp_path / "found").stdout.split()
        assert found[0] == label
        with zipfile.ZipFile(found[1]) as got, zipfile.ZipFile(src / "pagedkv-0.1.0-py3-none-linux_x86_64.whl") as want:
            assert [i.compress_type for i in got.infolist()] == [zipfile.ZIP_STORED] * 2
            assert {n: got.read(n) for n in got.namelist()} == {n: want.read(n) for n in want.namelist()}
            assert got.getinfo("pagedkv/lib/pagedkv_testhost").external_attr >> 16 == 0o755
    (tmp_path / "other").write_text("cccc  plugins/kernels/attention_plan.cpp\n")
    assert tool_run("find", archive, tmp_path / "other", tmp_path / "none", expect=1).stdout == ""
    bad = tool_run("pack", tmp_path / "bad.tar.xz", f"tree={tmp_path / 'tree'}", f"tree={tmp_path / 'var'}", expect=2)
    assert bad.stderr.startswith("prebuilt_wheels.py: entry='tree=") and bad.stderr.count("\n") == 1
    assert not (tmp_path / "bad.tar.xz").exists()
    missing = tool_run("find", tmp_path / "nope.tar.xz", tmp_path / "other", tmp_path / "none", expect=2)
    assert missing.stderr == f"prebuilt_wheels.py: archive={tmp_path / 'nope.tar.xz'}: no such file\n"
    assert not (tmp_path / "none").exists()
    cut = tmp_path / "cut.tar.xz"
    cut.write_bytes(archive.read_bytes()[:len(base) // 2])
    damaged = tool_run("find", cut, tmp_path / "var" / "source-hashes", tmp_path / "none", expect=2)
    assert damaged.stderr.startswith(f"prebuilt_wheels.py: archive={cut}: unreadable (") and damaged.stderr.count("\n") == 1
    assert not (tmp_path / "none" / "ws8-x" / "pagedkv-0.1.0-py3-none-linux_x86_64.whl").exists()


def _ncu_export(path: Path) -> Path:
    """A small source export in ncu's format: the kernel line, the header, three SASS rows."""
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
              "Instructions Executed", "stall_long_sb", "stall_wait", "stall_barrier", "stall_wait (Not Issued)"]
    rows = [["0x10", "  HGMMA.64x128x16.F32.BF16 R24, gdesc[UR28], RZ, !UPT", "30", "25", "100", "", "10", "20", "9"],
            ["0x20", "  MUFU.EX2 R49, R49", "60", "50", "400", "", "60", "", "55"],
            ["0x30", "  @!P0 BRA 0x40", "10", "10", "50", "10", "", "", ""]]
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "void attentionMultiKernelSm90WS<__nv_bfloat16, 0, 64>(...)"])
        w.writerow(header)
        w.writerows(rows)
    return path


def test_ncu_hotspots_ranks_instructions_and_reasons(tmp_path):
    run = _run("ncu_hotspots.py", str(_ncu_export(tmp_path / "sass.csv")), "--top", "2")
    lines = run.stdout.splitlines()
    assert lines[1] == "# 3 SASS instructions, 100 samples"
    assert lines[2] == "# samples by reason: wait 70, barrier 20, long_sb 10"  # the "(Not Issued)" column left out
    top = lines[4:]
    assert len(top) == 2 and "MUFU.EX2" in top[0] and "HGMMA" in top[1]
    assert top[0].split()[1:4] == ["60", "60.0", "400"] and "wait 60" in top[0]
    assert "barrier 20, wait 10" in top[1]


def test_ncu_hotspots_range_and_opcodes(tmp_path, monkeypatch):
    # offsets 0x10 and 0x20 from the first instruction (0x10): the MUFU and the branch; the HGMMA is left out
    run = _run("ncu_hotspots.py", str(_ncu_export(tmp_path / "sass.csv")), "--range", "0x10:0x30", "--by-opcode")
    lines = run.stdout.splitlines()
    assert lines[1] == "# offsets [0x10, 0x30): 2 SASS instructions, 70 samples"
    assert lines[2] == "# samples by reason: wait 60, long_sb 10"
    assert lines[3].split()[0] == "opcode"
    assert lines[4].split()[:4] == ["MUFU", "60", "85.7", "400"] and lines[5].split()[:4] == ["BRA", "10", "14.3", "50"]
    assert lines[6].split()[0] == "address" and "MUFU.EX2" in lines[7] and "BRA" in lines[8] and len(lines) == 9
    # the waits keep the modifier that names what they wait for; a predicate is skipped
    hot = _module("ncu_hotspots.py", monkeypatch)
    assert hot.opcode("  WARPGROUP.DEPBAR.LE gsb0, 0x1") == "WARPGROUP.DEPBAR"
    assert hot.opcode("@!P0 SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR19], R6") == "SYNCS.PHASECHK"
    assert hot.opcode("@P0 FMNMX R10, R13, R6, !PT") == "FMNMX" and hot.opcode("   ") == "?"


def test_ncu_hotspots_rejects_what_is_not_an_export(tmp_path):
    bad = tmp_path / "log.txt"
    bad.write_text("==PROF== Connected to process 1\n")
    run = _run("ncu_hotspots.py", str(bad), expect=2)
    expected = f"ncu_hotspots.py: {bad}: not an ncu source export (its first line is not \"Kernel Name\",...)\n"
    assert run.stderr == expected
    run = _run("ncu_hotspots.py", str(tmp_path / "sass.csv"), "--top", "0", expect=2)
    assert "--top=0: expected >= 1" in run.stderr
    for bad_range in ("0x30:0x10", "16", "a:b", "-1:4"):
        run = _run("ncu_hotspots.py", str(tmp_path / "sass.csv"), f"--range={bad_range}", expect=2)
        assert f"--range={bad_range}: expected START:END offsets" in run.stderr


def test_decode_balance_model_on_a_measured_launch(tmp_path):
    # The 16 x 8K P64 launch measured at 045fe8b: one CTA a unit, so the static schedule is the slowest CTA's run,
    # and a schedule that keeps every SM busy to the end can only be faster.
    measured = ROOT / "benchmarks" / "results" / "h100-045fe8b-diag-decode-cta-16x8K-P64.json"
    out = tmp_path / "model.json"
    run = _run("decode_balance_model.py", str(measured), "--units", "128", "--json", str(out))
    r = json.loads(out.read_text())
    assert r["sms_measured"] == 128 and r["static"] == pytest.approx(r["run_max"]) == pytest.approx(189.2, abs=0.05)
    assert 160 < r["bound"] < r["static"]
    guided = r["queue"]["guided"]
    assert len(guided) == 3 and all(r["bound"] <= g["us"] < r["static"] for g in guided)
    assert all(g["items"] > r["units"] for g in guided)  # every unit cut at least once
    assert run.stdout.startswith("# h100-045fe8b-diag-decode-cta-16x8K-P64.json: 128 SMs measured")


def test_decode_balance_model_kernel_schedule(tmp_path, monkeypatch):
    # The balanced decode's closed form (attention_balance.h) as the model lays it out: boundaries from 0 to W,
    # increasing, guided intervals at least the floor less a grain's rounding; segments cover every unit exactly.
    dbm = _module("decode_balance_model.py", monkeypatch)
    for total, takers, d, floor in ((32768, 528, 2, 4), (16384, 132, 1, 8), (100, 1, 1, 8), (5, 600, 2, 4)):
        b = dbm.kernel_boundaries(total, takers, d, floor)
        assert b[0] == 0 and b[-1] == total and all(y > x for x, y in itertools.pairwise(b))
        assert all(y - x >= floor - 1 for x, y in itertools.pairwise(b[:-1]))  # every interval but the last
    items = dbm.kernel_items(units=7, unit_grains=10, takers=3, divisor=2, floor=4)
    assert sum(sum(segs) for segs in items) == pytest.approx(7.0)
    assert all(0 < seg <= 1.0 for segs in items for seg in segs)
    measured = ROOT / "benchmarks" / "results" / "h100-045fe8b-diag-decode-cta-16x8K-P64.json"
    out = tmp_path / "model.json"
    run = _run("decode_balance_model.py", str(measured), "--units", "128", "--takers-per-sm", "4", "--unit-grains",
               "128", "--json", str(out))
    kernel = json.loads(out.read_text())["kernel"]
    assert [k["version"] for k in kernel] == ["variants", "coarse"]
    for k in kernel:
        us = list(k["us"].values())
        assert k["segments"] >= k["intervals"] > 128 and us == sorted(us)  # costlier segments, a longer launch
    assert "kernel variants (d = 2, floor 256 tokens)" in run.stdout
    run = _run("decode_balance_model.py", str(measured), "--units", "8", "--unit-grains", "-1", expect=2)
    assert "--unit-grains=-1: expected >= 0" in run.stderr


def test_decode_balance_model_fits_a_sweep_and_rejects_bad_input(tmp_path):
    # 100 SMs at 100 us a unit, 32 at 80 us: one unit each is the slow SMs' 100 us; the bound is 132 / sum(rates).
    per_sm = {str(sm): {"median_run_us": 100.0 if sm < 100 else 80.0} for sm in range(132)}
    reduced = tmp_path / "cta.json"
    reduced.write_text(json.dumps({"per_sm": per_sm}))
    out = tmp_path / "model.json"
    _run("decode_balance_model.py", str(reduced), "--units", "132", "--sweep", "1:110,2:112,4:115", "--json", str(out))
    r = json.loads(out.read_text())
    assert r["static"] == pytest.approx(100.0) and r["bound"] == pytest.approx(132 / (100 / 100 + 32 / 80))
    fit = r["split_fit"]
    assert [row["chunks"] for row in fit["rows"]] == [1, 2, 4] and fit["rms"] < 5
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"samples": []}))
    run = _run("decode_balance_model.py", str(bad), "--units", "8", expect=2)
    assert run.stderr == (f"decode_balance_model.py: {bad}: neither 'raw' nor 'per_sm' "
                          "(not a decode_cta_times.py JSON)\n")
    bad.write_text(json.dumps({"per_sm": {"3": {"run": 1}}}))
    run = _run("decode_balance_model.py", str(bad), "--units", "8", expect=2)
    assert run.stderr.startswith(f"decode_balance_model.py: {bad}: a malformed entry (KeyError")
    assert run.stderr.count("\n") == 1
    run = _run("decode_balance_model.py", str(reduced), "--units", "8", "--sweep", "2:10", expect=2)
    assert "--sweep=2:10: expected chunks:us pairs including 1 and at least two more" in run.stderr
    run = _run("decode_balance_model.py", str(reduced), "--units", "0", expect=2)
    assert "--units=0: expected >= 1" in run.stderr


def test_bench_write_gives_flashinfer_our_rope(monkeypatch):
    # The fp8 peer of bench_write.py (FlashInfer's fused rope + quantize + append) takes its RoPE as a cos / sin table.
    # That table must rotate by the angles our kernel uses: position x the library's invFreq for the benchmark's
    # RopeConfig (computeRopeParams, the table the plugin builds), pair i in column i (cos) and R/2 + i (sin).
    torch = pytest.importorskip("torch", reason="bench_write.py builds FlashInfer's table with torch")
    bench = _module("bench_write.py", monkeypatch)
    from pagedkv.config import PoolConfig, RopeConfig, WriteConfig
    from pagedkv.kernels import write

    rotary = bench.D
    cfg = WriteConfig(num_q_heads=bench.H, rope=RopeConfig(theta=bench.THETA),
                      pool=PoolConfig(num_kv_heads=bench.KVH, head_dim=rotary, page_size=16, num_layers=1,
                                      layer_index=0))
    params = write.rope_params(cfg)
    assert params.rotaryDim == rotary
    inv_freq = [params.invFreq[i] for i in range(rotary // 2)]
    positions = [0, 1, 2, 15, 16, 1023, 4095, 16383]
    table = bench.rope_cos_sin_cache(max(positions) + 1, rotary, torch, device="cpu").double()
    assert table.shape == (max(positions) + 1, rotary) and table.dtype == torch.float64
    angle = torch.tensor(positions, dtype=torch.float64)[:, None] * torch.tensor(inv_freq, dtype=torch.float64)
    # float32 invFreq against float64 exponents: < 1e-7 relative, so < 2e-3 rad at position 16383 at most
    torch.testing.assert_close(table[positions, : rotary // 2], angle.cos(), atol=2e-3, rtol=0)
    torch.testing.assert_close(table[positions, rotary // 2:], angle.sin(), atol=2e-3, rtol=0)
    # the fp8 rows' bytes: q out in 8 bits as well, so 1 byte less per q element than the bf16-q rows
    shape = bench.Shape("prefill 1x16384 P16", 1, 16384, 0, 16)
    assert bench.minimal_bytes(shape, 1) - bench.minimal_bytes(shape, 1, q_bytes=1) == 16384 * bench.H * bench.D
