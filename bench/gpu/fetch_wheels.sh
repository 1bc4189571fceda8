#!/usr/bin/env bash
# On a machine that can reach PyPI: put into .whl/ (git-ignored) the wheels a bare GPU box
# lacks for the GPU benchmarks: the daemon's web stack, the policy LP (cvxpy and its
# solvers, without scs), and any extra packages named as arguments (FlexGen 0.1.8 for the
# baseline, with the attrs it imports). bench/gpu/pass.sh installs them there, offline.
#
#   bash bench/gpu/fetch_wheels.sh flexgen==0.1.8
#
# Wheels for CPython 3.12 on x86-64 Linux; set PYVER for another interpreter.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
pyver=${PYVER:-3.12}
# cvxpy 1.9 also imports qdldl and sparsediffpy (<0.7); the engine imports llguidance and gguf,
# the daemon python-multipart (found missing on the first GPU session, 2026-11-26); the
# vision path pillow (images decoded for the towers: tests/engine/vision/test_vision_cuda.py)
packages=(fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn
          python-multipart cvxpy clarabel osqp highspy qdldl "sparsediffpy<0.7" llguidance
          gguf pillow "$@")
if [[ " $* " == *flexgen* ]]; then packages+=(attrs); fi
mkdir -p .whl
for package in "${packages[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: -d .whl \
    --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 "$package"
done
du -sh .whl
