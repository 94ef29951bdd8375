#!/usr/bin/env bash
# "sha1  path" per file, in C collation, of what a pagedkv build reads -- the record .ci/gpu-run.sh compares to know
# whether a build (its own, or one made elsewhere: .ci/prebuild-gpu-wheel.sh) is of the tree it has:
#   bash .ci/source-hashes.sh compiled   the compiled sources (CMake, the plugins and kernels, the C++ samples)
#   bash .ci/source-hashes.sh wheel      those, the build options and the rest the wheel packages (pyproject.toml,
#                                        the Python packages)
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  compiled) paths=(CMakeLists.txt cmake plugins samples/cpp) ;;
  wheel) paths=(CMakeLists.txt cmake plugins samples/cpp .ci/gpu-build-options.sh pyproject.toml src builder
                onnx_export) ;;
  *) echo "source-hashes.sh: what=${1:-}: expected compiled or wheel" >&2; exit 2 ;;
esac
find "${paths[@]}" -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | xargs -0 sha1sum | LC_ALL=C sort
