#!/usr/bin/env bash
# Builds, on this CPU machine, the pagedkv wheel the GPU machine's build stage would build (sm_90, the options of
# .ci/gpu-build-options.sh), and one more per variant patch given (benchmarks/variants/*.diff, applied to the tree in
# turn and reverted), into .whl/prebuilt/wheels.tar.xz, each beside the hashes of the sources it was built from
# (.ci/source-hashes.sh wheel; the archive: .ci/prebuilt_wheels.py). On the device, `gpu-run.sh build` installs the
# wheel whose record is the tree's instead of compiling (a fresh machine's build is ~110-150 s of the session's device
# time, a variant's ~60-90 s), so `gpu-ab.sh` with those variants installs every build in a second; anything else
# (another patch, a file edited since) builds there as before. Incremental: the build folder is kept.
#   bash .ci/prebuild-gpu-wheel.sh [variant.diff ...]   (after .ci/fetch-gpu-wheels.sh; PYTHON picks the interpreter)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
lens=${PAGEDKV_KERNEL_LENS_WHEEL:-$PWD/.whl/build/kernel_lens-2.0.1-py3-none-any.whl}  # the TensorRT headers
if [ ! -f "$lens" ]; then
  echo "prebuild-gpu-wheel.sh: PAGEDKV_KERNEL_LENS_WHEEL=$lens: no such file (run .ci/fetch-gpu-wheels.sh first)" >&2
  exit 2
fi
for v in "$@"; do
  [ -f "$v" ] || { echo "prebuild-gpu-wheel.sh: variant=$v: no such file" >&2; exit 2; }
  patch -p1 --dry-run -s < "$v" > /dev/null 2>&1 || { echo "prebuild-gpu-wheel.sh: variant=$v: does not apply to this tree" >&2; exit 2; }
done
export PATH="/usr/local/cuda-13.0/bin:/usr/local/cuda/bin:$PATH" PAGEDKV_KERNEL_LENS_WHEEL=$lens
out=$(mktemp -d)
applied=""  # the patch applied right now, reverted on any exit
trap '[ -n "$applied" ] && patch -R -p1 -s < "$applied"; rm -rf "$out" .whl/prebuilt.tmp' EXIT
# shellcheck disable=SC1091
source .ci/gpu-build-options.sh
build() {  # label: the wheel of the tree as it is now, with its record, into $out/label
  local hashes
  hashes=$(bash .ci/source-hashes.sh wheel)
  mkdir -p "$out/$1"
  "${PYTHON:-python3}" -m pip wheel -q --no-deps --no-cache-dir . -w "$out/$1" "${GPU_BUILD_OPTIONS[@]}" \
    -Cbuild-dir="${PAGEDKV_PREBUILD_DIR:-/tmp/pkv-prebuild}"
  if [ "$(bash .ci/source-hashes.sh wheel)" != "$hashes" ]; then
    echo "prebuild-gpu-wheel.sh: the sources changed during the build of $1; nothing written (run it again)" >&2
    exit 1
  fi
  printf '%s\n' "$hashes" > "$out/$1/source-hashes"
}
build tree
entries=("tree=$out/tree")
for v in "$@"; do
  name=$(basename "$v" .diff)
  patch -p1 -s < "$v"
  applied=$v
  build "$name"
  patch -R -p1 -s < "$v"
  applied=""
  entries+=("$name=$out/$name")
done
mkdir -p .whl/prebuilt.tmp
"${PYTHON:-python3}" .ci/prebuilt_wheels.py pack .whl/prebuilt.tmp/wheels.tar.xz "${entries[@]}"
rm -rf .whl/prebuilt && mv .whl/prebuilt.tmp .whl/prebuilt  # the old archive goes as a whole
echo "prebuild-gpu-wheel.sh: .whl/prebuilt/wheels.tar.xz ($(du -h .whl/prebuilt/wheels.tar.xz | cut -f1)):" \
     "${entries[*]%%=*}"
