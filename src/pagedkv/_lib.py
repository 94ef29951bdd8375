"""Locating and loading the shared libraries the wheel ships in ``pagedkv/lib``; what their ctypes bindings share
(declaring signatures, owning a C object through its handle, the kernels' C API status check).

``PAGEDKV_LIB_DIR`` overrides the search (e.g. a CMake build tree during development).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path

CAPI_NAME = "libpagedkv_capi.so"
PLUGINS_NAME = "libpagedkv_plugins.so"  # getCreators: IPluginRegistry.load_library, trtexec --dynamicPlugins
SELFREG_NAME = "libpagedkv_plugins_selfreg.so"  # registers itself: polygraphy --plugins, trtexec --staticPlugins
TESTHOST_NAME = "pagedkv_testhost"
RUNTIME_NAME = "libpagedkv_runtime.so"        # the C++ runtime (static cudart; TensorRT dlopened)
RUNTIME_CHECK_NAME = "pagedkv_runtime_check"  # its C++ tests and benchmark
GENERATE_NAME = "pagedkv_generate"            # the C++ deployment sample (samples/cpp)


def lib_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("PAGEDKV_LIB_DIR"):
        dirs.append(Path(os.environ["PAGEDKV_LIB_DIR"]))
    dirs.append(Path(__file__).resolve().parent / "lib")
    # Editable installs put the compiled files in site-packages while the sources stay in the checkout.
    for entry in sys.path:
        if entry:
            dirs.append(Path(entry) / "pagedkv" / "lib")
    seen, out = set(), []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def find_file(name: str) -> Path | None:
    for d in lib_dirs():
        if (d / name).is_file():
            return d / name
    return None


def require_file(name: str) -> Path:
    path = find_file(name)
    if path is None:
        raise FileNotFoundError(f"{name} not found in {[str(d) for d in lib_dirs()]}; "
                                "install pagedkv with `pip install .` or set PAGEDKV_LIB_DIR")
    return path


def plugin_library_path() -> Path:
    """Path of the TensorRT plugin library (for ``IPluginRegistry.load_library``, trtexec ``--dynamicPlugins``)."""
    return require_file(PLUGINS_NAME)


def selfreg_library_path() -> Path:
    """Path of its self-registering companion (for loaders that only dlopen: polygraphy ``--plugins``, trtexec
    ``--staticPlugins``)."""
    return require_file(SELFREG_NAME)


@functools.lru_cache(maxsize=None)
def capi() -> ctypes.CDLL:
    """The C API library, loaded once. Each binding module (``pagedkv.kernels.*``) declares its own signatures."""
    lib = ctypes.CDLL(str(require_file(CAPI_NAME)))
    lib.pagedkv_capi_version.restype = ctypes.c_int32
    lib.pagedkv_build_info.restype = ctypes.c_char_p
    lib.pagedkv_last_error.restype = ctypes.c_char_p
    lib.pagedkv_capabilities.restype = ctypes.c_char_p
    lib.pagedkv_struct_layouts.restype = ctypes.c_char_p
    return lib


@functools.lru_cache(maxsize=None)
def runtime() -> ctypes.CDLL:
    """The C++ runtime library, loaded once; ``pagedkv.kvcache.native`` and ``pagedkv.runtime.native`` declare
    its signatures."""
    return ctypes.CDLL(str(require_file(RUNTIME_NAME)))


def declare(lib: ctypes.CDLL, signatures: dict[str, tuple[list, object]]) -> ctypes.CDLL:
    """Give each entry of ``lib`` its ctypes signature, ``{name: ([argtypes], restype)}``; returns ``lib``."""
    for name, (args, res) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


class NativeHandle:
    """Owner of one object of a pagedkv C library, held through its opaque pointer ``self._h`` (a
    ``ctypes.c_void_p``; NULL before creation and once released). ``close()`` or leaving a ``with`` block releases
    it, exactly once (closing again does nothing); the collector does it as a last resort. A closed object passes
    NULL on and each later call gets the C API's answer to a NULL handle (the status ``"manager: null pointer"``,
    raised as ``ValueError``, from the entries that return one): the C side checks its handles, Python does not
    check them again. Subclasses create the object into ``self._h`` in ``__init__`` and free it in ``_release``."""

    _h = None  # also what __del__ sees when __init__ raised before creating the object

    def _release(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self._h:
            self._release()
            self._h = ctypes.c_void_p()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):  # last resort; deterministic release is close()/with
        self.close()


def build_info() -> dict[str, str]:
    raw = capi().pagedkv_build_info().decode()
    return dict(item.split("=", 1) for item in raw.split(";") if "=" in item)


class CapiError(RuntimeError):
    """A C API entry returned an error; the message is the launcher's reason."""


def check(rc: int, what: str) -> None:
    if rc != 0:
        reason = capi().pagedkv_last_error().decode() or "(no reason recorded)"
        raise CapiError(f"{what} failed with CUDA error {rc}: {reason}")
