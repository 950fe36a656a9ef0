#!/usr/bin/env bash
# Installs kvflow from this checkout into ./.venv (CPU build, torch 2.13.0 CPU wheel) and runs
# every check: the C++ unit tests (ctest), the CUDA compile check for sm_90a when a CUDA toolkit
# is present (required under CI=true), then the pytest suite.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate

echo "== installing dependencies"
pip install -q --disable-pip-version-check torch==2.13.0
pip install -q --disable-pip-version-check setuptools wheel ninja pybind11 cmake pytest hypothesis numpy

echo "== building kvflow (CPU)"
KVFLOW_CUDA=0 MAX_JOBS=${MAX_JOBS:-2} pip install -q --disable-pip-version-check --no-build-isolation -e .

echo "== C++ unit tests"
cmake -S . -B build/cmake -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build/cmake -j "${MAX_JOBS:-2}"
ctest --test-dir build/cmake --output-on-failure

echo "== CUDA compile check (sm_90a)"
cuda_home=${CUDA_HOME:-}
for candidate in "$cuda_home" /usr/local/cuda /usr/local/cuda-*; do
  if [ -n "$candidate" ] && [ -x "$candidate/bin/nvcc" ] && [ -f "$candidate/include/cuda_runtime.h" ]; then
    cuda_home=$candidate
    break
  fi
done
if [ -n "$cuda_home" ] && [ -x "$cuda_home/bin/nvcc" ]; then
  cmake -S . -B build/cuda-check -G Ninja -DKVFLOW_CUDA_CHECK=ON -DCMAKE_CUDA_COMPILER="$cuda_home/bin/nvcc" \
    -DCMAKE_CUDA_ARCHITECTURES=90a > /dev/null
  cmake --build build/cuda-check --target kvflow_cuda_check -j "${MAX_JOBS:-2}"
  echo "every .cu file compiles for sm_90a with $cuda_home/bin/nvcc"
elif [ "${CI:-}" = "true" ]; then
  echo "CI: no CUDA toolkit found; the CUDA compile check is required here" >&2
  exit 1
else
  echo "no CUDA toolkit found: CUDA compile check not run"
fi

echo "== pytest"
python -m pytest -q tests
