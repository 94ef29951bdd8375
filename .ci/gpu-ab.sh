#!/usr/bin/env bash
# A/B of kernel variants on the device machine, from the repository root: builds the tree as it is ("base"), then the
# tree with each patch applied in turn (unified diffs against the tree, e.g. `git diff > .scratch/variant.diff` and
# a checkout), then base again (the machine's drift over the call), and times every build with
# benchmarks/ab_attention.py. The first build's outputs are the reference of every later build's max|diff|.
#   bash .ci/gpu-ab.sh [--cases prefill,decode] [--rounds N] variant.diff [variant.diff ...]
# Each variant is labelled by its file name without .diff. Writes $OUT/ab.txt (the timing lines), $OUT/ab.jsonl and
# the build logs (through .ci/gpu-run.sh, which also rebuilds whatever a patch changed: its source record). A build
# that `bash .ci/prebuild-gpu-wheel.sh variant.diff ...` made on the CPU machine is installed instead (~1 s, not
# ~60-150 s of device time): carry .whl with its prebuilt/wheels.tar.xz (FlashInfer's wheel may stay behind: an A/B
# does not use it: beside it and the tracked files the 64 MiB a call carries hold the tree's wheel and two variants).
set -uo pipefail
OUT=${OUT:-$PWD/out}
usage() { echo "usage: bash .ci/gpu-ab.sh [--cases prefill,decode] [--rounds N] variant.diff [variant.diff ...]" >&2; exit 2; }
cases=prefill
rounds=3
variants=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cases) [ $# -ge 2 ] || usage; cases=$2; shift 2 ;;
    --rounds) [ $# -ge 2 ] || usage; rounds=$2; shift 2 ;;
    -*) echo "gpu-ab.sh: unknown option $1" >&2; usage ;;
    *) variants+=("$1"); shift ;;
  esac
done
[ ${#variants[@]} -gt 0 ] || usage
for v in "${variants[@]}"; do
  [ -f "$v" ] || { echo "gpu-ab.sh: variant=$v: no such file" >&2; exit 2; }
  patch -p1 --dry-run -s < "$v" > /dev/null 2>&1 || { echo "gpu-ab.sh: variant=$v: does not apply to this tree" >&2; exit 2; }
done
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # the wheels gpu-run.sh's setup installs there
outputs=$(mktemp -d)
time_build() {  # label
  python3 benchmarks/ab_attention.py --label "$1" --cases "$cases" --rounds "$rounds" --outputs "$outputs" \
    --json "$OUT/ab.jsonl" 2>&1 | tee -a "$OUT/ab.txt"
  return "${PIPESTATUS[0]}"
}
build() {  # label: the tree as it is now
  bash .ci/gpu-run.sh build > "$OUT/ab-build-$1.log" 2>&1 || { echo "gpu-ab.sh: build of $1 failed" >&2; tail -30 "$OUT/ab-build-$1.log" >&2; return 1; }
}

bash .ci/gpu-run.sh setup > "$OUT/ab-setup.log" 2>&1 || { cat "$OUT/ab-setup.log" >&2; exit 1; }
build base && time_build base || exit 1
rc=0
for v in "${variants[@]}"; do
  name=$(basename "$v" .diff)
  patch -p1 -s < "$v" || { echo "gpu-ab.sh: $v did not apply" >&2; exit 1; }
  if build "$name"; then time_build "$name" || rc=1; else rc=1; fi
  patch -R -p1 -s < "$v" || { echo "gpu-ab.sh: $v did not revert: the tree is no longer base" >&2; exit 1; }
done
build base-again && time_build base-again || rc=1
exit $rc
