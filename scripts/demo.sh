#!/usr/bin/env bash
# Installs kvflow into ./.venv and streams an answer from the embedded default model
# (SmolLM2-135M-Instruct). Usage: bash scripts/demo.sh ["your question"]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/install.sh
question=${1:-"What is the capital of France, and what is it famous for?"}
python -m kvflow generate --chat "$question" --max-tokens 200
