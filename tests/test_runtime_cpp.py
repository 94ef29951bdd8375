"""The C++ runtime's own checks (``pagedkv_runtime_check``, plugins/runtime/tests), run from pytest so that CI
runs them: the unit tests, the stateful random test (10^5 operations) and the per-step benchmark with a loose
time guard. The library must export its C entries and C++ API only and link neither CUDA nor TensorRT; the
examples of docs/runtime-cpp.md compile (against the installed headers when there are) and print what it says."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import built_file
from pagedkv import _lib


@pytest.fixture(scope="module")
def check_exe():
    """CI builds it (PAGEDKV_BUILD_RUNTIME_TESTS): its absence fails, it is not skipped."""
    return built_file(_lib.RUNTIME_CHECK_NAME)


def run(exe, *args, timeout=600):
    out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout + out.stderr


def closing_counts(output: str) -> tuple[int, int]:
    match = re.search(r"^(\d+) passed, (\d+) failed$", output, re.MULTILINE)
    assert match, f"no closing line in:\n{output}"
    return int(match.group(1)), int(match.group(2))


def test_cpp_unit_tests(check_exe):
    rc, output = run(check_exe, "unit")
    passed, failed = closing_counts(output)
    assert rc == 0 and failed == 0 and passed >= 21, output


def test_cpp_stateful_random_test(check_exe):
    rc, output = run(check_exe, "random", "--ops", "100000", "--seed", "1")
    assert rc == 0 and closing_counts(output) == (1, 0), output
    done = int(re.search(r"random: (\d+) operations", output).group(1))
    assert done >= 100_000


def test_cpp_step_benchmark(check_exe):
    """256 sequences x 4096 cached tokens, page 16 (the issue's case). The goal is 50 us per step (measured
    ~30 us on the 2-core CI machine); the guard is 10x, for a loaded machine."""
    rc, output = run(check_exe, "bench", "--seqs", "256", "--context", "4096", "--page-size", "16", "--steps", "50")
    assert rc == 0, output
    total = float(re.search(r"step total\s+median\s+([\d.]+) us", output).group(1))
    assert 0 < total < 500, output


def test_cpp_engine_step_benchmark(check_exe):
    """The engine's host time per decode step (scheduler + step inputs + commit + stops) at 256 sequences: the
    goal is 50 us (measured ~32 us on the 2-core development machine); the guard is 10x, for a loaded machine."""
    rc, output = run(check_exe, "bench-engine", "--seqs", "256", "--context", "4096", "--page-size", "16", "--steps",
                     "50")
    assert rc == 0, output
    host = float(re.search(r"engine host\s+median\s+([\d.]+) us", output).group(1))
    assert 0 < host < 500, output


def test_cpp_check_refuses_bad_arguments(check_exe):
    rc, output = run(check_exe, "bench", "--seqs", "many")
    assert rc == 2 and "--seqs: expected a non-negative integer, got 'many'" in output


def test_runtime_library_exports_and_links_nothing_of_cuda_or_tensorrt():
    lib = _lib.find_file(_lib.RUNTIME_NAME)
    assert lib is not None, f"{_lib.RUNTIME_NAME} not found in {[str(d) for d in _lib.lib_dirs()]}"
    needed = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    assert not re.search(r"libnvinfer|libcuda|libcudart", needed), needed
    symbols = subprocess.run(["nm", "-D", "--defined-only", "-C", str(lib)], capture_output=True, text=True,
                             check=True).stdout.splitlines()
    names = [line.split(" ", 2)[2] for line in symbols if line.count(" ") >= 2]
    assert any(n.startswith("pagedkv_kv_create") for n in names)
    assert any(n.startswith("pagedkv::runtime::KVManager::reserve(") for n in names)
    assert any(n == "typeinfo for pagedkv::runtime::KVCacheExhaustedError" for n in names)
    leaked = [n for n in names if not (n.startswith(("pagedkv_kv_", "pagedkv_rt_", "pagedkv::runtime::", "typeinfo for pagedkv::",
                                                     "typeinfo name for pagedkv::", "vtable for pagedkv::"))
                                       or n in ("PAGEDKV_KV",))]
    assert not leaked, leaked[:10]


DOC = Path(__file__).resolve().parents[1] / "docs" / "runtime-cpp.md"


def test_doc_cpp_example_compiles_runs_and_prints_what_the_doc_says(tmp_path):
    text = DOC.read_text()
    code, printed = re.search(r"```cpp\n(.*?)```\n\nprints\n\n```\n(.*?)```", text, re.S).groups()
    lib = _lib.find_file(_lib.RUNTIME_NAME)
    assert lib is not None, f"{_lib.RUNTIME_NAME} not found in {[str(d) for d in _lib.lib_dirs()]}"
    installed = lib.parent.parent / "include"  # the wheel's pagedkv/include, next to pagedkv/lib
    include = installed if (installed / "pagedkv" / "runtime" / "kv_manager.h").is_file() else DOC.parents[1] / \
        "plugins" / "include"
    (tmp_path / "example.cpp").write_text(code)
    compiler = os.environ.get("CXX", "c++")
    subprocess.run([compiler, "-std=c++17", "-Wall", "-Werror", "-I", str(include), str(tmp_path / "example.cpp"),
                    "-L", str(lib.parent), "-lpagedkv_runtime", f"-Wl,-rpath,{lib.parent}", "-o",
                    str(tmp_path / "example")], check=True, capture_output=True, text=True)
    out = subprocess.run([str(tmp_path / "example")], check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout == printed


def test_doc_python_example_runs():
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    exec(compile(code, str(DOC), "exec"), {})
