"""``pagedkv doctor``: what this machine has — CUDA device and driver, the plugin libraries and the creators they
export, which TensorRT flavours are installed (TensorRT, TensorRT-RTX) and whether engines build and run here, where
the TensorRT headers came from, the cuda-python version."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def doctor_report() -> dict:
    """Facts about this machine, each honestly 'missing' when it is."""
    from pagedkv import _lib, cuda

    report: dict = {"pagedkv": _version("pagedkv"), "python": sys.version.split()[0]}

    # CUDA
    gpu: dict = {"cuda-python": _version("cuda-python") or _version("cuda-bindings")}
    reason = cuda.why_no_gpu()
    if reason:
        gpu["device"] = None
        gpu["reason"] = reason
    else:
        rt = cuda._rt()
        gpu["driver_version"] = cuda.check(rt.cudaDriverGetVersion(), "cudaDriverGetVersion")
        gpu["runtime_version"] = cuda.check(rt.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion")
        props = cuda.device_properties(0)
        name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
        gpu["device"] = name.rstrip("\x00")
        gpu["compute_capability"] = cuda.compute_capability(0)
        gpu["multiprocessors"] = props.multiProcessorCount
        gpu["memory_gib"] = round(props.totalGlobalMem / 2**30, 1)
    report["cuda"] = gpu

    # Libraries
    libs: dict = {}
    for key, name in (("capi", _lib.CAPI_NAME), ("plugins", _lib.PLUGINS_NAME), ("plugins_selfreg", _lib.SELFREG_NAME),
                      ("testhost", _lib.TESTHOST_NAME), ("runtime", _lib.RUNTIME_NAME),
                      ("runtime_check", _lib.RUNTIME_CHECK_NAME)):
        path = _lib.find_file(name)
        libs[key] = str(path) if path else None
    try:
        libs["build_info"] = _lib.build_info()
    except Exception as exc:  # library missing or broken: say so
        libs["build_info"] = f"unavailable: {exc}"
    libs["creators"] = _list_creators(libs.get("testhost"), libs.get("plugins"))
    report["libraries"] = libs

    # TensorRT: both flavours (pagedkv.trt_library); neither is imported here
    from pagedkv import trt_library
    from pagedkv.runtime.trt import why_no_engine_runtime

    trt: dict = {}
    for f in trt_library.FLAVOURS.values():
        reason = trt_library.why_unavailable(f)
        dist = _version(f.name) or _version(f"{f.name}_cu13") or _version(f"{f.name}_cu12")
        trt[f.name] = {"installed": reason is None, "version": dist} if reason is None else {"installed": False,
                                                                                            "reason": reason}
    trt["builds_here"] = [f.name for f in trt_library.installed()
                          if f.builds_without_gpu or cuda.why_no_gpu() is None]
    trt["runs_engines_here"] = why_no_engine_runtime() or "yes"
    report["tensorrt"] = trt
    for dist in ("onnx", "onnxruntime", "onnx-graphsurgeon", "polygraphy", "onnxruntime-extensions"):
        report.setdefault("python_packages", {})[dist] = _version(dist)
    return report


def _list_creators(testhost: str | None, plugins: str | None):
    """Creators exported by the plugin library, read through the test host (the way TensorRT loads it)."""
    if not testhost or not plugins:
        return "unavailable: test host or plugin library not found"
    try:
        out = subprocess.run([testhost, "info", "--lib", plugins], capture_output=True, text=True, timeout=60)
    except Exception as exc:
        return f"unavailable: {exc}"
    if out.returncode != 0:
        return f"test host failed (exit {out.returncode}): {out.stderr.strip()[-500:]}"
    try:
        info = json.loads(out.stdout)
    except json.JSONDecodeError:
        return f"unreadable test host output: {out.stdout.strip()[:500]}"
    return [f"{c['name']} v{c['version']} ns={c['namespace']} ({len(c['fields'])} fields)" for c in info["creators"]]


def _print_doctor(report: dict) -> None:
    def show(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                show(f"{prefix}{k}.", v)
        else:
            print(f"{prefix[:-1]:<40} {value}")

    show("", report)


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run_doctor(args) -> int:
    report = doctor_report()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_doctor(report)
    return 0
