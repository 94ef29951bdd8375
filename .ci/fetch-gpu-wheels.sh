#!/usr/bin/env bash
# Fetches, on this (networked, CPU) machine, the wheels the GPU machine's image lacks into .whl/:
# FlashInfer 0.7.2 (slimmed) and its extra need (../shared/tools/peer-wheels.sh) with the script that sets up
# its JIT there (flashinfer-env.sh, sourced by gpu-run.sh), the pagedkv runtime dependencies missing there, and
# the kernel-lens wheel (TensorRT headers) into .whl/build/ for the build.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
bash ../shared/tools/peer-wheels.sh
cp ../shared/tools/flashinfer-env.sh .whl/flashinfer-env.sh
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl onnx-graphsurgeon==0.6.1 polygraphy==0.53.6 onnxruntime-extensions==0.15.2
python3 -m pip download --no-deps -d .whl/build kernel-lens==2.0.1
ls -la .whl .whl/build
