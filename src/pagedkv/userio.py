"""What a user hands the ``pagedkv`` verbs and what they get back: usage errors, input files, outputs written
atomically, progress and machine-readable reports. Every verb goes through these, so that a mistake reads the
same everywhere:

* a bad argument or input file is one line on stderr naming it and what was expected, exit status 2, no
  traceback (``--debug`` shows one): raise ``UsageError`` (``check_int`` / ``check_float`` / ``parse_int_list``
  for values, ``check_input_file`` for files (``pagedkv.onnx_io.load`` for ONNX models), ``option_error`` for a library's field error);
* outputs are written into a temporary file beside the target and renamed into place only when complete
  (``atomic_output``); an output path equal to an input is refused; missing folders are created; a failed
  verb leaves nothing behind;
* progress goes to stderr through tqdm, and only when stderr is a terminal and ``--quiet`` is not given.

    from pagedkv.userio import UsageError, atomic_output, check_input_file
    src = check_input_file(args.input, "input")
    with atomic_output(args.output, inputs=[src]) as tmp:
        write(tmp)                      # renamed to args.output when the block ends without an error
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A bad argument or input: the message is the one line the user sees (exit status 2)."""


# ---- argument values ----------------------------------------------------------------------------------
def check_int(name: str, value, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int in [low, high] (either bound optional), else UsageError naming ``name``."""
    try:
        number = int(value)
        if number != value and not isinstance(value, str):
            raise ValueError
    except (TypeError, ValueError):
        raise UsageError(f"{name}: expected an integer, got {value!r}") from None
    if low is not None and number < low or high is not None and number > high:
        raise UsageError(f"{name}: expected {_range_text(low, high)}, got {number}")
    return number


def check_float(name: str, value, *, low: float | None = None, high: float | None = None,
                low_open: bool = False) -> float:
    """``value`` as a finite float in [low, high] (``low_open``: (low, high]), else UsageError."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise UsageError(f"{name}: expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise UsageError(f"{name}: expected a finite number, got {value!r}")
    below = low is not None and (number <= low if low_open else number < low)
    if below or (high is not None and number > high):
        text = f"> {low:g}" if low_open and high is None else _range_text(low, high, low_open)
        raise UsageError(f"{name}: expected {text}, got {number:g}")
    return number


def check_choice(name: str, value, choices) -> str:
    if value not in choices:
        raise UsageError(f"{name}: expected one of {', '.join(map(str, choices))}, got {value!r}")
    return value


def parse_int_list(name: str, text: str, *, low: int | None = None, high: int | None = None) -> list[int]:
    """A comma-separated list of integers ("5,17,33"), each checked like ``check_int``."""
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or any(p == "" for p in parts):
        raise UsageError(f"{name}: expected comma-separated integers, got {text!r}")
    return [check_int(f"{name}[{i}]", p, low=low, high=high) for i, p in enumerate(parts)]


def option_error(exc: Exception) -> UsageError:
    """A library's ValueError about one of its fields (``"page_size: expected ..."``, the form the validators
    here write; ``"host_blocks[0]: ..."`` for an element) as the usage error of the command-line option the
    field came from (``"--page-size: expected ..."``). Messages of another form are kept as they are."""
    text = str(exc)
    field, sep, rest = text.partition(": ")
    name = field.split("[")[0]
    if sep and name.replace("_", "").isalnum() and not name.startswith("_"):
        return UsageError(f"--{name.replace('_', '-')}: {rest}")
    return UsageError(text)


def _range_text(low, high, low_open: bool = False) -> str:
    if low is not None and high is not None:
        return f"a value in {'(' if low_open else '['}{low:g}, {high:g}]"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    return f"<= {high:g}"


# ---- input files --------------------------------------------------------------------------------------
def check_input_file(path, name: str = "input") -> Path:
    """An existing, non-empty regular file, else UsageError naming ``name`` and the path."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{name}: {str(p)!r} does not exist")
    if p.is_dir():
        raise UsageError(f"{name}: {str(p)!r} is a directory, expected a file")
    if p.stat().st_size == 0:
        raise UsageError(f"{name}: {str(p)!r} is empty")
    return p


def check_input_dir(path, name: str = "input") -> Path:
    p = Path(path)
    if not p.is_dir():
        raise UsageError(f"{name}: {str(p)!r} is not a directory" if p.exists() else
                         f"{name}: {str(p)!r} does not exist")
    return p


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def check_output_path(path, inputs: Iterable = (), name: str = "output") -> Path:
    """The output path, refused when it is (or names the same file as) one of ``inputs`` or a directory."""
    out = Path(path)
    for src in inputs:
        if src is not None and _same_file(out, Path(src)):
            raise UsageError(f"{name}: {str(out)!r} is also an input; choose another output path")
    if out.is_dir():
        raise UsageError(f"{name}: {str(out)!r} is a directory, expected a file path")
    return out


@contextlib.contextmanager
def atomic_output(path, *, inputs: Iterable = (), name: str = "output", companions: Iterable[str] = ()) \
        -> Iterator[Path]:
    """Yields a temporary path for the output; on a clean exit it is renamed to ``path`` (its folder created
    when missing), on an error it is removed and nothing is left behind.

    The temporary path lives in a private staging folder beside the target. ``companions``: names of files that
    belong to the output and are written beside it (an ONNX model's external-data file, named relative to the
    model): write them into ``tmp.parent`` under those names; they are moved into place first, the main file
    last, so the output appears only when everything it refers to is there.
    """
    out = check_output_path(path, inputs, name)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    tmp = staging / out.name
    try:
        yield tmp
        if not tmp.exists():
            raise RuntimeError(f"{name}: nothing was written to {str(out)!r}")
        for companion in companions:
            src = staging / companion
            if src.exists():
                os.replace(src, out.parent / companion)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# ---- progress and reports -----------------------------------------------------------------------------
def progress_enabled(quiet: bool = False) -> bool:
    return not quiet and sys.stderr.isatty()


def progress(iterable=None, *, total: int | None = None, desc: str = "", unit: str = "it", quiet: bool = False):
    """A tqdm progress bar on stderr, disabled when stderr is not a terminal or ``quiet``."""
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not progress_enabled(quiet), leave=False,
                file=sys.stderr, dynamic_ncols=True)


@contextlib.contextmanager
def phases(count: int, *, desc: str, quiet: bool = False):
    """A verb's ``count`` named steps on one progress bar: ``with phases(3, desc="export") as step:`` then
    ``step("load the model")`` before each step shows what runs now and how many steps are done."""
    bar = progress(total=count, desc=desc, unit="step", quiet=quiet)
    started = [0]

    def step(name: str) -> None:
        if started[0]:
            bar.update(1)
        started[0] += 1
        bar.set_postfix_str(name, refresh=True)

    try:
        yield step
    finally:
        if started[0]:
            bar.update(1)
        bar.close()


def run_verb(verb: str, func, args) -> int:
    """Run a verb's handler: ``UsageError`` -> one line on stderr and exit status 2; any other error -> one
    line naming it and exit status 1, with the traceback only under ``--debug``; Ctrl-C -> 130."""
    try:
        return int(func(args) or 0)
    except UsageError as exc:
        print(f"pagedkv {verb}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"pagedkv {verb}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the user gets one line; --debug gets the traceback
        if getattr(args, "debug", False):
            raise
        text = " ".join(str(exc).split()) or type(exc).__name__
        print(f"pagedkv {verb}: error: {text} ({type(exc).__name__}; --debug shows the traceback)",
              file=sys.stderr)
        return EXIT_FAILED


def print_json(report) -> None:
    """A report as JSON on stdout: dataclasses as objects, enums by their names (lower case), numpy values
    and paths as plain values."""
    print(json.dumps(_plain(report), indent=2, default=str))


def _plain(value):
    import dataclasses
    import enum

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):  # before int: IntEnums would otherwise print as bare numbers
        return value.name.lower()
    if isinstance(value, dict):
        return {k if isinstance(k, (str, int, float, bool)) or k is None else str(k): _plain(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    return value
