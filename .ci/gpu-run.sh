#!/usr/bin/env bash
# The GPU suite, run on the device machine (H200) from the repository root:
#   bash .ci/gpu-run.sh [stages...]      stages: setup build tests sanitize bench  (default: all)
#   PAGEDKV_BENCHES="write attention runtime serving headdim" picks the benchmarks of the bench stage ("splits", not
#   in the default: the decode split sweep beside the decode rows and their peers, one process);
#   PAGEDKV_BENCH_HEAD_DIMS=64,256 the attention head dims of its headdim benchmark (each peer JIT-builds per head dim).
# It installs the Python wheels the machine's image lacks from .whl/ (FlashInfer, the serve extra's closure and
# the rest: fetch them here first with `bash .ci/fetch-gpu-wheels.sh`), builds pagedkv for sm_90 there (TensorRT
# headers from the carried kernel-lens wheel: the machine has no network) or installs the wheel that
# `bash .ci/prebuild-gpu-wheel.sh` built here from the same sources, runs the `gpu` tests, compute-sanitizer
# memcheck and racecheck on the kernels, and the benchmarks side by side with FlashInfer. Logs go to $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
stages=${*:-setup build tests sanitize bench}
export PYTHONUNBUFFERED=1
export FLASHINFER_CUDA_ARCH_LIST=9.0
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
rc=0
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }

has() { [[ " $stages " == *" $1 "* ]]; }

if has setup; then
  log "setup: wheels -> /tmp/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/setup.log" 2>&1 || { log "wheel install failed"; cat "$OUT/setup.log"; exit 1; }
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee -a "$OUT/summary.txt"
fi
# FlashInfer 0.7.2's JIT needs the real CUDA_HOME, ninja and libcuda on that machine (../shared/tools/flashinfer-env.sh)
# shellcheck disable=SC1091
[ -f .whl/flashinfer-env.sh ] && source .whl/flashinfer-env.sh

# A warm device machine keeps /tmp/pkv-build from its previous call, and the tree it receives keeps the mtimes it had
# here: a source whose content differs from what was last built there (an A/B variant built by that call, then
# reverted) can still look older than its object, and ninja would keep the stale object (it happened: a
# "benchmark at HEAD" ran an experiment's kernel). So every compiled source whose content is not the one the build
# directory last built is touched first (the record is written after a successful build only, so a failed one's
# changes are touched again); a build directory without that record is rebuilt from scratch.
BUILD_DIR=${PAGEDKV_GPU_BUILD_DIR:-/tmp/pkv-build}
BUILT_HASHES=$BUILD_DIR/.pagedkv-source-hashes
source_hashes() {  # "sha1  path" per compiled source, in C collation (comm compares them)
  bash .ci/source-hashes.sh compiled
}
touch_changed_sources() {
  [ -d "$BUILD_DIR" ] || return 0
  if [ ! -f "$BUILT_HASHES" ]; then
    log "build directory without a source record: rebuilt from scratch"
    rm -rf "$BUILD_DIR"
    return 0
  fi
  local changed
  changed=$(source_hashes | LC_ALL=C comm -13 "$BUILT_HASHES" - | cut -c43-)
  if [ -n "$changed" ]; then
    log "sources changed since the last build here: $(echo "$changed" | wc -l) (touched)"
    echo "$changed" | while IFS= read -r path; do touch -- "$path"; done
  fi
}

if has build; then
  log "build (sm_90)"
  export PAGEDKV_KERNEL_LENS_WHEEL=$PWD/.whl/build/kernel_lens-2.0.1-py3-none-any.whl
  t0=$(date +%s)
  # A wheel built on the CPU machine (.ci/prebuild-gpu-wheel.sh: the tree's, and its variants') is installed instead
  # when one was built from exactly the sources this tree has (its record and the tree's, compared in full); anything
  # else builds here.
  prebuilt=""
  if [ -f .whl/prebuilt/wheels.tar.xz ]; then
    bash .ci/source-hashes.sh wheel > /tmp/pagedkv-tree-record
    prebuilt=$(python3 .ci/prebuilt_wheels.py find .whl/prebuilt/wheels.tar.xz /tmp/pagedkv-tree-record \
               /tmp/pagedkv-prebuilt)
    found=$?  # 1: no build of this tree in it; anything else but 0: the archive could not be read (said above)
    [ $found -ne 0 ] && prebuilt=""
    [ $found -gt 1 ] && log "prebuilt archive unreadable (exit $found): building here"
  fi
  if [ -n "$prebuilt" ]; then
    python3 -m pip install --no-deps --no-cache-dir --force-reinstall "${prebuilt#* }" > "$OUT/build.log" 2>&1 ||
      { log "PREBUILT WHEEL INSTALL FAILED"; tail -30 "$OUT/build.log"; exit 1; }
    log "prebuilt wheel of ${prebuilt%% *} installed in $(( $(date +%s) - t0 )) s (built from this tree's sources)"
  else
    [ "${found:-}" = 1 ] && log "no prebuilt wheel used: none was built from this tree's sources"
    touch_changed_sources
    # shellcheck disable=SC1091
    source .ci/gpu-build-options.sh
    python3 -m pip install --no-build-isolation --no-deps --no-cache-dir . "${GPU_BUILD_OPTIONS[@]}" \
        -Cbuild-dir=$BUILD_DIR > "$OUT/build.log" 2>&1 || { log "BUILD FAILED"; tail -60 "$OUT/build.log"; exit 1; }
    source_hashes > "$BUILT_HASHES"
    log "build ok in $(( $(date +%s) - t0 )) s"
  fi
  (cd /tmp && python3 -m pagedkv.cli doctor && python3 -m pagedkv.cli selfcheck) 2>&1 | tee -a "$OUT/summary.txt"
fi

if has tests; then
  log "gpu tests"
  timeout ${PAGEDKV_GPU_TEST_TIMEOUT:-420} python3 -m pytest -q -m gpu -n ${PAGEDKV_GPU_TEST_WORKERS:-8} \
    -p no:cacheprovider --timeout=300 -rfEs --durations=30 --junitxml="$OUT/gpu-tests.xml" ${PAGEDKV_GPU_TESTS:-tests} \
    > "$OUT/gpu-tests.log" 2>&1
  t=$?; [ $t -ne 0 ] && rc=$t
  tail -75 "$OUT/gpu-tests.log" | tee -a "$OUT/summary.txt"  # the 30 slowest (what the device's ~290 s go to)
  log "device-wide memory check, alone on the GPU"
  PAGEDKV_SERIAL_GPU_TEST=1 python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_kvcache_gpu.py::test_memory_returns_to_baseline_after_many_sequences \
    tests/gpu/test_kvcache_gpu.py::test_byte_budget_sizing 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
  t=${PIPESTATUS[0]}; [ $t -ne 0 ] && rc=$t
fi

if has sanitize; then
  for tool in memcheck racecheck; do
    log "compute-sanitizer $tool"
    compute-sanitizer --tool $tool --error-exitcode 99 --target-processes all \
      python3 .ci/gpu_sanitize_cases.py > "$OUT/sanitize-$tool.log" 2>&1
    t=$?; [ $t -ne 0 ] && rc=$t
    tail -8 "$OUT/sanitize-$tool.log" | tee -a "$OUT/summary.txt"
  done
  # Build-phase plugin instances enqueued on random / 0xFF / real metadata through the test host (a child
  # process: --target-processes all), as TensorRT's tactic timing does: 0 memcheck errors, nothing written.
  log "compute-sanitizer memcheck: build-phase enqueue"
  compute-sanitizer --tool memcheck --error-exitcode 99 --target-processes all \
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_plugins_enqueue.py -k "build_phase or runtime_phase_enqueue" \
    > "$OUT/sanitize-build-phase.log" 2>&1
  t=$?; [ $t -ne 0 ] && rc=$t
  tail -8 "$OUT/sanitize-build-phase.log" | tee -a "$OUT/summary.txt"
  # the C++ engine driving both plugins through the test host (16 continuous-batching steps), and the runtime's
  # own DeviceExecutor (its pools, staged upload, block copies and CUDA graphs) over the three traces
  log "compute-sanitizer memcheck: C++ runtime + plugins"
  compute-sanitizer --tool memcheck --error-exitcode 99 --target-processes all \
    python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_runtime_plugins.py tests/gpu/test_runtime_executor.py \
    > "$OUT/sanitize-runtime.log" 2>&1
  t=$?; [ $t -ne 0 ] && rc=$t
  tail -8 "$OUT/sanitize-runtime.log" | tee -a "$OUT/summary.txt"
fi

if has bench; then
  # PAGEDKV_BENCHES picks benchmarks (a device call has 600 s; the full set runs longer in one call).
  for b in ${PAGEDKV_BENCHES:-write attention runtime serving headdim}; do
    [ "$b" = headdim ] && continue
    extra=""; [ "$b" = runtime ] && extra="--backend cuda"  # + the kernels' decode step, eager vs CUDA graph
    if [ "$b" = splits ]; then
      log "benchmark attention, decode splits"
      timeout ${PAGEDKV_BENCH_TIMEOUT:-540} python3 benchmarks/bench_attention.py --cases decode,splits \
        --peers tc_fa2,xqa --json "$OUT/bench_attention_splits.json" > "$OUT/bench_attention_splits.log" 2>&1
      t=$?; [ $t -ne 0 ] && { log "bench splits exit $t"; rc=$t; }
      tail -64 "$OUT/bench_attention_splits.log" | tee -a "$OUT/summary.txt"
    elif [ -f benchmarks/bench_$b.py ]; then
      log "benchmark $b"
      timeout ${PAGEDKV_BENCH_TIMEOUT:-540} python3 benchmarks/bench_$b.py $extra --json "$OUT/bench_$b.json" > "$OUT/bench_$b.log" 2>&1
      t=$?; [ $t -ne 0 ] && { log "bench $b exit $t"; rc=$t; }
      tail -40 "$OUT/bench_$b.log" | tee -a "$OUT/summary.txt"
    fi
  done
  [[ " ${PAGEDKV_BENCHES:-headdim} " == *" headdim "* ]] || { log "done rc=$rc"; exit $rc; }
  # Head dims 80 / 96 on their own (FlashInfer may JIT-compile or refuse them): a slow peer cannot cost the rows above.
  log "benchmark write, head dims"
  timeout ${PAGEDKV_BENCH_HEADDIM_TIMEOUT:-300} python3 benchmarks/bench_write.py --cases headdim \
    --json "$OUT/bench_write_headdim.json" > "$OUT/bench_write_headdim.log" 2>&1
  t=$?; [ $t -ne 0 ] && { log "bench write headdim exit $t"; rc=$t; }
  tail -16 "$OUT/bench_write_headdim.log" | tee -a "$OUT/summary.txt"
  # Attention: ours alone, then each peer in a process of its own. FlashInfer 0.7.2's tc_fa2 (batch prefill JIT at
  # head dim 80) hit an illegal memory access on the H200 (ours alone ran clean, 2026-12-01), which poisons the CUDA
  # context of the process it runs in; a peer's crash is logged, not counted as ours.
  for peer in ours tc_fa2 xqa fa3; do
    log "benchmark attention, head dims, ${peer}"
    timeout ${PAGEDKV_BENCH_HEADDIM_TIMEOUT:-300} python3 benchmarks/bench_attention.py --cases headdim \
      ${PAGEDKV_BENCH_HEAD_DIMS:+--head-dims "$PAGEDKV_BENCH_HEAD_DIMS"} \
      --peers "$([ $peer = ours ] || echo $peer)" --json "$OUT/bench_attention_headdim_$peer.json" \
      > "$OUT/bench_attention_headdim_$peer.log" 2>&1
    t=$?
    if [ $t -ne 0 ]; then
      if [ $peer = ours ]; then log "bench attention headdim exit $t"; rc=$t; else log "peer $peer crashed (exit $t)"; fi
      tail -4 "$OUT/bench_attention_headdim_$peer.log" | tee -a "$OUT/summary.txt"
    else
      tail -9 "$OUT/bench_attention_headdim_$peer.log" | tee -a "$OUT/summary.txt"
    fi
  done
fi
log "done rc=$rc"
exit $rc
