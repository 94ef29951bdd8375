"""Which TensorRT a process uses, and what pagedkv needs from it: the flavour (TensorRT or TensorRT-RTX), its
Python module imported on demand, the plugin library registered with it, and the plugin library's kept messages.

Two flavours share one Python API (``trt.Builder``, ``trt.OnnxParser``, ``IBuilderConfig``, ``trt.Runtime``):

    tensorrt       TensorRT 10.x / 11.x (``pip install tensorrt``): builds for the GPU it runs on and runs engines
    tensorrt_rtx   TensorRT-RTX (``pip install tensorrt_rtx_cu13``): builds ahead of time **without a GPU** for a
                   list of compute capabilities; runs engines only on RTX-class GPUs (not compute capability 9.0)

``flavour("auto")`` takes TensorRT when installed, else TensorRT-RTX. Nothing here imports either module before
it is asked to (``find_spec`` only), so a verb's pre-flight checks run without TensorRT, and a missing flavour is
``TensorRTUnavailable`` naming what to install.

TensorRT-RTX trap (measured with 1.7.1): its wheel ships only ``libtensorrt_rtx.so.1``, but once a network holds a
plugin the library dlopens the unversioned ``libtensorrt_rtx.so``, and without it the process dies (``terminate
called without an active exception``). ``import_flavour`` creates the symlink beside the library when the folder is
writable, and otherwise raises ``TensorRTUnavailable`` with the command that creates it.

The plugin library (``libpagedkv_plugins.so``) is registered with ``IPluginRegistry.load_library`` (TensorRT calls
its ``getCreators``); ``plugin_messages`` reads what the library kept (its last warnings and errors), which is the
only way its reasons reach the user under TensorRT-RTX, whose logger finder answers nothing (docs/plugin_io.md).

    trt = import_flavour(flavour("auto"))
    load_plugin_library(trt)
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedkv.runtime.backends import BackendUnavailable


class TensorRTUnavailable(BackendUnavailable):
    """The TensorRT flavour asked for cannot be imported here; the message says why and what to do."""


@dataclass(frozen=True)
class Flavour:
    name: str  # the Python module: "tensorrt" | "tensorrt_rtx"
    title: str  # for messages: "TensorRT", "TensorRT-RTX"
    install: str  # what to pip install
    builds_without_gpu: bool  # ahead-of-time build for listed compute capabilities
    can_serialize_plugins: bool  # IBuilderConfig.plugins_to_serialize into a version-compatible engine
    has_timing_cache: bool  # TensorRT-RTX: timing cache calls are no-ops (deprecated since 1.2)


TENSORRT = Flavour("tensorrt", "TensorRT", "tensorrt (>= 10, on a machine with a GPU)", builds_without_gpu=False,
                   can_serialize_plugins=True, has_timing_cache=True)
TENSORRT_RTX = Flavour("tensorrt_rtx", "TensorRT-RTX", "tensorrt_rtx_cu13==1.7.1.116", builds_without_gpu=True,
                       can_serialize_plugins=False, has_timing_cache=False)
FLAVOURS = {f.name: f for f in (TENSORRT, TENSORRT_RTX)}
BUILDER_CHOICES = ("auto", *FLAVOURS)

# TensorRT-RTX 1.7's compute capabilities (trt.ComputeCapability.SM75 ...): what it builds for and runs on; 9.0 is
# not among them (an H200 refuses its engines). RTX_DEFAULT_TARGETS: its targets when none are set (its docs).
RTX_COMPUTE_CAPABILITIES = (75, 80, 86, 89, 120, 121)
RTX_DEFAULT_TARGETS = (80, 86, 89, 120)

RTX_LIBS_PACKAGE = "tensorrt_rtx_libs"  # the wheel that holds libtensorrt_rtx.so.1
RTX_SONAME, RTX_UNVERSIONED = "libtensorrt_rtx.so.1", "libtensorrt_rtx.so"


def why_unavailable(f: Flavour) -> str | None:
    """Why ``f``'s Python module cannot be imported here, or None. Never imports it."""
    if importlib.util.find_spec(f.name) is None:
        return f"{f.title} not available: the `{f.name}` Python package is not installed (pip install {f.install})"
    return None


def installed() -> list[Flavour]:
    return [f for f in FLAVOURS.values() if why_unavailable(f) is None]


def flavour(choice: str = "auto") -> Flavour:
    """The flavour for ``--builder`` ``choice``: ``auto`` is TensorRT when installed, else TensorRT-RTX. Raises
    ``TensorRTUnavailable`` (naming the packages) when the choice is not installed."""
    if choice == "auto":
        found = installed()
        if not found:
            raise TensorRTUnavailable("TensorRT not available: neither the `tensorrt` nor the `tensorrt_rtx` Python "
                                      f"package is installed (pip install {TENSORRT_RTX.install} builds engines "
                                      f"without a GPU; pip install {TENSORRT.install} builds and runs them)")
        return found[0]
    if choice not in FLAVOURS:
        raise ValueError(f"builder: expected one of {', '.join(BUILDER_CHOICES)}, got {choice!r}")
    f = FLAVOURS[choice]
    reason = why_unavailable(f)
    if reason:
        others = [o.name for o in installed()]
        raise TensorRTUnavailable(reason + (f"; installed: {', '.join(others)}" if others else ""))
    return f


def rtx_library_dir() -> Path | None:
    """The folder of ``libtensorrt_rtx.so.1`` (the ``tensorrt_rtx_libs`` package), found without importing it."""
    spec = importlib.util.find_spec(RTX_LIBS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def ensure_rtx_unversioned_library() -> None:
    """``libtensorrt_rtx.so`` -> ``libtensorrt_rtx.so.1`` beside the library (see the module docstring): created when
    missing and the folder is writable, else ``TensorRTUnavailable`` saying how to create it."""
    folder = rtx_library_dir()
    if folder is None or not (folder / RTX_SONAME).exists():
        raise TensorRTUnavailable(f"TensorRT-RTX not available: {RTX_SONAME} not found (package {RTX_LIBS_PACKAGE}); "
                                  f"pip install {TENSORRT_RTX.install}")
    link = folder / RTX_UNVERSIONED
    if link.exists():
        return
    if not os.access(folder, os.W_OK):
        raise TensorRTUnavailable(f"TensorRT-RTX needs {link} (it dlopens the unversioned name once a network holds a "
                                  f"plugin, and the process dies without it) and {folder} is not writable: create it "
                                  f"with `ln -s {RTX_SONAME} {link}`")
    try:
        link.symlink_to(RTX_SONAME)
    except FileExistsError:  # another process made it meanwhile
        pass


def import_flavour(f: Flavour):
    """The flavour's Python module (``tensorrt`` or ``tensorrt_rtx``), imported now."""
    reason = why_unavailable(f)
    if reason:
        raise TensorRTUnavailable(reason)
    if f is TENSORRT_RTX:
        ensure_rtx_unversioned_library()
    return importlib.import_module(f.name)


def flavour_of(trt) -> Flavour:
    """The flavour of an imported module."""
    return FLAVOURS[trt.__name__.split(".")[0]]


# ---- the plugin library --------------------------------------------------------------------------------
def load_plugin_library(trt, library: str | Path | None = None) -> Path:
    """Register our creators with ``trt``'s plugin registry through ``IPluginRegistry.load_library`` (idempotent
    per process, flavour and path). Raises RuntimeError with the library's own reason when it fails."""
    from pagedkv import _lib

    path = Path(library) if library else _lib.plugin_library_path()
    key = (trt.__name__, str(path.resolve()))
    if key not in _loaded:
        handle = trt.get_plugin_registry().load_library(key[1])
        if handle is None:
            raise RuntimeError(f"IPluginRegistry.load_library({key[1]}) failed" + with_plugin_messages(path))
        _loaded[key] = handle
    return path


_loaded: dict[tuple[str, str], object] = {}


@functools.lru_cache(maxsize=None)
def _messages_entry(path: str):
    lib = ctypes.CDLL(path)  # the same loaded object TensorRT's registry opened: the same kept messages
    fn = lib.pagedkv_plugin_messages
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int32]
    return fn


def plugin_messages(library: str | Path | None = None, clear: bool = True) -> list[str]:
    """The plugin library's kept warnings and errors ("ERROR: [pagedkv] ..."), oldest first; ``clear`` forgets them."""
    from pagedkv import _lib

    path = Path(library) if library else _lib.find_file(_lib.PLUGINS_NAME)
    if path is None:
        return []
    fn = _messages_entry(str(Path(path).resolve()))
    size = fn(None, 0, 0)
    buffer = ctypes.create_string_buffer(size + 1)
    fn(buffer, size + 1, int(clear))
    return buffer.value.decode(errors="replace").splitlines()


def with_plugin_messages(library: str | Path | None = None) -> str:
    """``": <the plugin library's errors>"`` for an error line, or "" when it kept none."""
    errors = [m for m in plugin_messages(library) if m.startswith(("ERROR", "INTERNAL_ERROR"))]
    return (": " + "; ".join(errors)) if errors else ""


# ---- dtypes ---------------------------------------------------------------------------------------------
def numpy_dtype(trt, dtype) -> np.dtype:
    """The numpy dtype of a ``trt.DataType``, bfloat16 and fp8 included (``trt.nptype`` has neither)."""
    import ml_dtypes

    table = {"FLOAT": np.float32, "HALF": np.float16, "BF16": ml_dtypes.bfloat16, "FP8": ml_dtypes.float8_e4m3fn,
             "INT8": np.int8, "UINT8": np.uint8, "INT32": np.int32, "INT64": np.int64, "BOOL": np.bool_}
    name = dtype.name
    if name not in table:
        raise ValueError(f"TensorRT dtype {name}: no numpy equivalent for a host view")
    return np.dtype(table[name])


def dtype_name(trt, dtype) -> str:
    """A ``trt.DataType`` as the numpy name ``pagedkv.engine_io`` uses ("int64", "bfloat16", ...)."""
    return numpy_dtype(trt, dtype).name


def engine_tensors(trt, engine) -> tuple[list[tuple[str, bool, str, list[int]]], dict[str, tuple]]:
    """An ``ICudaEngine``'s I/O as ``pagedkv.engine_io.check_engine_io`` takes it: (name, is_input, dtype name,
    shape with -1 for dynamic dims) per tensor, and each input's (min, opt, max) shapes of profile 0."""
    tensors, profile = [], {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        tensors.append((name, is_input, dtype_name(trt, engine.get_tensor_dtype(name)),
                        list(engine.get_tensor_shape(name))))
        if is_input:
            profile[name] = tuple(tuple(s) for s in engine.get_tensor_profile_shape(name, 0))
    return tensors, profile
