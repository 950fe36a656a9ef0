#!/usr/bin/env bash
# Installs kvflow from this checkout into ./.venv (scripts/install.sh, with the test extras) and runs
# every check: the C++ unit tests (ctest), the CUDA compile check for sm_90a when a CUDA toolkit
# is present (required under CI=true), the engine on emulated AVX2-only and pre-AVX2 CPUs
# (scripts/emulated_cpu_check.sh), then the pytest suite.
set -euo pipefail
cd "$(dirname "$0")/.."

phase_started=$SECONDS
phase() {
  echo "   (took $((SECONDS - phase_started)) s)"
  phase_started=$SECONDS
  echo "== $1"
}

EXTRAS=test . scripts/install.sh

phase "C++ unit tests"
cmake -S . -B build/cmake -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build/cmake -j "${MAX_JOBS:-2}"
ctest --test-dir build/cmake --output-on-failure

phase "CUDA compile check (sm_90a)"
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

phase "emulated CPUs (qemu-user): AVX2 without AVX-512, and no AVX2 at all"
bash scripts/emulated_cpu_check.sh

phase "pytest"
python -m pytest -q --durations="${PYTEST_DURATIONS:-20}" tests
phase "done in $SECONDS s"
