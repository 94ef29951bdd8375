#!/usr/bin/env bash
# Builds, on this CPU machine, the pagedkv wheel the GPU machine's build stage would build (sm_90, the options of
# .ci/gpu-build-options.sh) into .whl/prebuilt/, beside the hashes of the sources it was built from
# (.ci/source-hashes.sh wheel). On the device, `gpu-run.sh build` installs that wheel instead of compiling when the
# tree it receives has exactly those sources (a fresh machine's build is ~110-150 s of the session's device time),
# and builds as before when anything differs (a variant patch applied, a file edited since). Incremental: the build
# folder is kept.
#   bash .ci/prebuild-gpu-wheel.sh        (after .ci/fetch-gpu-wheels.sh; PYTHON picks the interpreter)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
lens=${PAGEDKV_KERNEL_LENS_WHEEL:-$PWD/.whl/build/kernel_lens-2.0.1-py3-none-any.whl}  # the TensorRT headers
if [ ! -f "$lens" ]; then
  echo "prebuild-gpu-wheel.sh: PAGEDKV_KERNEL_LENS_WHEEL=$lens: no such file (run .ci/fetch-gpu-wheels.sh first)" >&2
  exit 2
fi
export PATH="/usr/local/cuda-13.0/bin:/usr/local/cuda/bin:$PATH" PAGEDKV_KERNEL_LENS_WHEEL=$lens
hashes=$(bash .ci/source-hashes.sh wheel)
out=$(mktemp -d)
trap 'rm -rf "$out" .whl/prebuilt.tmp' EXIT
# shellcheck disable=SC1091
source .ci/gpu-build-options.sh
"${PYTHON:-python3}" -m pip wheel -q --no-deps --no-cache-dir . -w "$out" "${GPU_BUILD_OPTIONS[@]}" \
  -Cbuild-dir="${PAGEDKV_PREBUILD_DIR:-/tmp/pkv-prebuild}"
if [ "$(bash .ci/source-hashes.sh wheel)" != "$hashes" ]; then
  echo "prebuild-gpu-wheel.sh: the sources changed during the build; nothing written (run it again)" >&2
  exit 1
fi
mkdir -p .whl/prebuilt.tmp
# Carried to the device with FlashInfer's wheel under one 64 MiB limit: the wheel's two libraries holding the kernels
# (capi and plugins) are ~24 MB each and mostly the same bytes, which a deflated wheel hides from any later
# compressor. So the wheel is rewritten with stored (uncompressed) entries -- a valid wheel, same files, same RECORD
# -- and xz'ed with a 64 MiB window that takes the second copy almost free (28 MB deflated -> ~12 MB).
"${PYTHON:-python3}" - "$out" .whl/prebuilt.tmp <<'PY'
import lzma
import pathlib
import sys
import zipfile

src = next(pathlib.Path(sys.argv[1]).glob("pagedkv-*.whl"))
stored = pathlib.Path(sys.argv[1]) / "stored.zip"
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(stored, "w", zipfile.ZIP_STORED) as zout:
    for info in zin.infolist():
        entry = zipfile.ZipInfo(info.filename, info.date_time)
        entry.external_attr = info.external_attr  # the executables' mode
        zout.writestr(entry, zin.read(info), compress_type=zipfile.ZIP_STORED)
with open(stored, "rb") as f, lzma.open(pathlib.Path(sys.argv[2]) / (src.name + ".xz"), "wb", preset=9) as out:
    while chunk := f.read(1 << 24):
        out.write(chunk)
PY
printf '%s\n' "$hashes" > .whl/prebuilt.tmp/source-hashes
rm -rf .whl/prebuilt && mv .whl/prebuilt.tmp .whl/prebuilt  # the old wheel and its record go together
echo "prebuild-gpu-wheel.sh: $(cd .whl/prebuilt && ls pagedkv-*.whl.xz) ($(du -h .whl/prebuilt/pagedkv-*.whl.xz | cut -f1)), $(wc -l < .whl/prebuilt/source-hashes) sources"
