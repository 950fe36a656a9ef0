#!/usr/bin/env bash
# Runs the default engine on emulated CPUs with qemu-user, so that every machine checks the paths
# its own CPU would not take: Haswell (AVX2 + FMA + F16C, no AVX-512) and Snowridge (an Atom server
# CPU with SSE4.2 and no AVX: the scalar kernels, with their warning). A few greedy float32 tokens
# each; they must be equal. Snowridge rather than Nehalem: Nehalem's CPUID stops at leaf 11 and has
# no XSAVE, and under qemu-user some library in the process then took an illegal instruction on an
# AVX-512 host (not reproducible on an AVX2 one); a fault prints the Python stack that took it.
# Usage: bash scripts/emulated_cpu_check.sh  (after scripts/install.sh; installs qemu-user if missing)
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v qemu-x86_64 > /dev/null; then
  echo "installing qemu-user" >&2
  apt-get update -qq > /dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user > /dev/null
fi
python="$PWD/.venv/bin/python"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
prompt="The capital of France is"
# numpy's OpenBLAS picks its kernels from what qemu-user leaks of the host CPU (Haswell kernels on an
# emulated pre-AVX CPU, an illegal instruction at import), so it is told a core of the emulated CPU's kind.
openblas_core() { [ "$1" = Haswell ] && echo Haswell || echo Nehalem; }
run_on() {  # CPU model -> the completion on stdout, the log in build/emulated-$1.log
  PYTHONFAULTHANDLER=1 OPENBLAS_CORETYPE=$(openblas_core "$1") timeout 900 qemu-x86_64 -cpu "$1" "$python" -m kvflow generate \
    "$prompt" --dtype float32 --temperature 0 --max-tokens 4 --max-model-len 256 --kv-cache-memory 16MiB \
    2> "build/emulated-$1.log"
}
mkdir -p build
start=$SECONDS
run_on Haswell > build/emulated-Haswell.out & haswell=$!
run_on Snowridge > build/emulated-Snowridge.out & scalar=$!
show_log() { grep -v "TCG doesn't support" "build/emulated-$1.log" >&2; }
for cpu in Haswell Snowridge; do
  pid=$haswell; [ "$cpu" = Snowridge ] && pid=$scalar
  status=0
  wait "$pid" || status=$?
  if [ "$status" = 132 ]; then
    # An illegal instruction once took an emulated CPU down on one CI host and not on others; a
    # fault of kvflow's own kernels repeats, so only a second one fails the check.
    show_log "$cpu"
    echo "an illegal instruction on the emulated $cpu (the Python stack is above); running it once more" >&2
    status=0
    run_on "$cpu" > "build/emulated-$cpu.out" || status=$?
  fi
  [ "$status" = 0 ] || { show_log "$cpu"; echo "the engine failed on an emulated $cpu (exit $status)" >&2; exit 1; }
done
out_Haswell=$(cat build/emulated-Haswell.out)
out_Snowridge=$(cat build/emulated-Snowridge.out)
echo "Haswell: ${out_Haswell@Q}, Snowridge: ${out_Snowridge@Q}, both in $((SECONDS - start)) s" >&2
grep -q "has no AVX2" build/emulated-Snowridge.log || { echo "no scalar-kernel warning on Snowridge" >&2; exit 1; }
if grep -q "has no AVX2" build/emulated-Haswell.log; then echo "a scalar-kernel warning on Haswell" >&2; exit 1; fi
[ -n "$out_Haswell" ] && [ "$out_Haswell" = "$out_Snowridge" ] || {
  echo "the scalar kernels (Snowridge) gave ${out_Snowridge@Q}, AVX2 (Haswell) ${out_Haswell@Q}" >&2; exit 1; }
echo "emulated Haswell (AVX2) and Snowridge (scalar) give the same greedy tokens"
