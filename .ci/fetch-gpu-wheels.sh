#!/usr/bin/env bash
# Fetches, on this (networked, CPU) machine, the wheels the GPU machine's image lacks into .whl/:
# FlashInfer 0.7.2 (slimmed) and its extra need (../shared/tools/peer-wheels.sh) with the script that sets up
# its JIT there (flashinfer-env.sh, sourced by gpu-run.sh), the pagedkv runtime dependencies missing there, the
# serve extra with every package it needs at run time (pagedkv serve, pagedkv bench --url; the GPU suite's
# tests/gpu/test_serve_gpu.py serves on the CUDA kernels), and the kernel-lens wheel (TensorRT headers) into
# .whl/build/ for the build.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=$(git rev-parse --git-path info/exclude)  # (a worktree's .git is a file; info/ is the common one)
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
bash ../shared/tools/peer-wheels.sh
cp ../shared/tools/flashinfer-env.sh .whl/flashinfer-env.sh
# CPython 3.12 on x86-64 manylinux, as the GPU machine's python3 is (pip picks each wheel for that target).
target=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download --no-deps "${target[@]}" -d .whl \
  onnx-graphsurgeon==0.6.1 polygraphy==0.53.6 onnxruntime-extensions==0.15.2
# The serve extra's closure on CPython 3.12, resolved in a clean 3.12 environment with
#   pip install --dry-run --ignore-installed --only-binary=:all: --report r.json <the serve extra of pyproject.toml>
# (pip evaluates environment markers for the interpreter that runs it, not for --python-version, so the closure
# was resolved on a 3.12 interpreter). All pure Python but pydantic-core (cp312 manylinux). The image already
# holds some of them (anyio, httpx, click, ...): these, first on PYTHONPATH, are the versions pydantic and
# starlette ask for (typing-extensions >= 4.16, anyio >= 4).
serve=(starlette==1.10.0 anyio==4.16.0 uvicorn==0.54.0 click==8.5.1 h11==0.16.0
       pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
       typing-extensions==4.16.0 prometheus-client==0.26.0 httpx==0.28.1 httpcore==1.0.9 idna==3.20
       certifi==2026.10.19.post1)
python3 -m pip download -q --no-deps "${target[@]}" -d .whl "${serve[@]}"
# Closure check: the serve extra as pyproject.toml states it resolves from .whl/ alone, for the same target.
mapfile -t extra < <(python3 -c 'import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["serve"]))')
check=$(mktemp -d)
python3 -m pip install -q --dry-run --ignore-installed --no-index --find-links .whl "${target[@]}" \
  --target "$check" "${extra[@]}"
rm -rf "$check"
python3 -m pip download --no-deps -d .whl/build kernel-lens==2.0.1
ls -la .whl .whl/build
du -sh .whl
