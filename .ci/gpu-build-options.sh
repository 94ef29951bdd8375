# shellcheck shell=bash
# The options of the GPU machine's pagedkv build, in one place: .ci/gpu-run.sh builds with them there and
# .ci/prebuild-gpu-wheel.sh here; `.ci/source-hashes.sh wheel` lists this file, so changing them retires a prebuilt
# wheel built with the old ones.
GPU_BUILD_OPTIONS=(-Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90 -Cbuild.verbose=false)
