"""The prebuilt sm_90 wheels carried to the GPU machine: one xz'ed tar of the tree's wheel and of variant builds.

    python3 .ci/prebuilt_wheels.py pack ARCHIVE LABEL=DIR [LABEL=DIR ...]
        DIR holds one pagedkv-*.whl and the source-hashes record of the tree it was built from (.ci/source-hashes.sh
        wheel); every wheel is rewritten with stored entries and all of them go into ARCHIVE (written atomically).
    python3 .ci/prebuilt_wheels.py find ARCHIVE RECORD DEST
        the wheel whose record equals the file RECORD, extracted into DEST (atomically); prints "LABEL PATH" (exit 1:
        none; 2: a bad argument, one line naming it).
    python3 .ci/prebuilt_wheels.py list ARCHIVE
        "LABEL WHEEL" per entry.

Why one archive: a wheel's two libraries holding the kernels (capi and plugins) are ~24 MB each and mostly the same
bytes, and a variant's build (benchmarks/variants/*.diff) differs from the tree's in a few kernels. Deflated wheels
hide that from any later compressor; stored ones in one xz stream whose dictionary spans them all take each repeat
almost free (the tree's 9 MB, ~4.5 MB a variant), so the tree's wheel and two variants' fit the 64 MiB a device call
carries with FlashInfer's wheel and the tracked files, and an A/B call installs each build in a second instead of
compiling it (~60-150 s of device time a build).
"""

from __future__ import annotations

import io
import lzma
import pathlib
import shutil
import sys
import tarfile
import tempfile
import zipfile


def _fail(msg: str) -> None:
    print(f"prebuilt_wheels.py: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _stored(wheel: pathlib.Path) -> bytes:
    """The wheel with every entry stored: a valid wheel, the same files and RECORD, modes kept."""
    buf = io.BytesIO()
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            entry = zipfile.ZipInfo(info.filename, info.date_time)
            entry.external_attr = info.external_attr  # the executables' mode
            zout.writestr(entry, zin.read(info), compress_type=zipfile.ZIP_STORED)
    return buf.getvalue()


def pack(archive: pathlib.Path, specs: list[str]) -> None:
    entries: list[tuple[str, bytes]] = []
    labels: set[str] = set()
    for spec in specs:
        label, sep, folder = spec.partition("=")
        if not sep or not label or "/" in label or label in labels:
            _fail(f"entry={spec!r}: expected LABEL=DIR with a unique label without '/'")
        labels.add(label)
        wheels = sorted(pathlib.Path(folder).glob("pagedkv-*.whl"))
        record = pathlib.Path(folder) / "source-hashes"
        if len(wheels) != 1 or not record.is_file():
            _fail(f"entry={spec!r}: expected one pagedkv-*.whl and a source-hashes file in {folder}")
        entries.append((f"{label}/source-hashes", record.read_bytes()))
        entries.append((f"{label}/{wheels[0].name}", _stored(wheels[0])))
    total = sum(len(data) for _, data in entries)
    # The dictionary spans the whole tar, so that every later copy of a library finds the first one.
    dict_size = 64 << 20
    while dict_size < total + (1 << 20):
        dict_size *= 2
    filters = [{"id": lzma.FILTER_LZMA2, "preset": 9, "dict_size": dict_size}]
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=archive.parent, prefix=archive.name, suffix=".tmp", delete=False) as tmp:
        try:
            with lzma.open(tmp, "wb", format=lzma.FORMAT_XZ, filters=filters) as xz, \
                    tarfile.open(fileobj=xz, mode="w|") as tar:
                for name, data in entries:
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        except BaseException:
            pathlib.Path(tmp.name).unlink(missing_ok=True)
            raise
    pathlib.Path(tmp.name).chmod(0o644)
    pathlib.Path(tmp.name).replace(archive)


def _members(archive: pathlib.Path):
    """(label, name, file object) per entry, streamed: records precede their wheels."""
    # tarfile's own "r|xz" reads the decompressor 10 KB at a time: ~40 s for 200 MB where 4 MB reads take ~1 s.
    try:
        with lzma.open(archive) as xz, \
                tarfile.open(fileobj=io.BufferedReader(xz, buffer_size=4 << 20), mode="r|") as tar:
            for info in tar:
                label, _, name = info.name.partition("/")
                yield label, name, tar.extractfile(info)
    except (EOFError, lzma.LZMAError, tarfile.TarError) as e:  # a cut or damaged archive: one line, exit 2
        _fail(f"archive={archive}: unreadable ({type(e).__name__}: {e})")


def find(archive: pathlib.Path, record: pathlib.Path, dest: pathlib.Path) -> int:
    want = record.read_bytes()
    match = None
    for label, name, f in _members(archive):
        if name == "source-hashes":
            match = label if f.read() == want else None
        elif match == label and name.endswith(".whl"):
            out = dest / label / name
            out.parent.mkdir(parents=True, exist_ok=True)
            part = out.with_name(out.name + ".part")
            with open(part, "wb") as w:
                shutil.copyfileobj(f, w)
            part.replace(out)
            print(label, out)
            return 0
    return 1


def _existing(what: str, path: str) -> pathlib.Path:
    if not pathlib.Path(path).is_file():
        _fail(f"{what}={path}: no such file")
    return pathlib.Path(path)


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "pack":
        pack(pathlib.Path(argv[1]), argv[2:])
        return 0
    if len(argv) == 4 and argv[0] == "find":
        return find(_existing("archive", argv[1]), _existing("record", argv[2]), pathlib.Path(argv[3]))
    if len(argv) == 2 and argv[0] == "list":
        for label, name, _ in _members(_existing("archive", argv[1])):
            if name.endswith(".whl"):
                print(label, name)
        return 0
    _fail("usage: pack ARCHIVE LABEL=DIR [...] | find ARCHIVE RECORD DEST | list ARCHIVE")
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
