#!/usr/bin/env bash
# Runs the default engine on emulated CPUs with qemu-user, so that every machine checks the paths
# its own CPU would not take: Haswell (AVX2 + FMA + F16C, no AVX-512) and Nehalem (no AVX: the
# scalar kernels, with their warning). A few greedy float32 tokens each; they must be equal.
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
# emulated Nehalem, an illegal instruction at import), so it is told the emulated CPU's name.
run_on() {  # CPU model -> the completion on stdout, the log in build/emulated-$1.log
  OPENBLAS_CORETYPE=$1 timeout 900 qemu-x86_64 -cpu "$1" "$python" -m kvflow generate "$prompt" --dtype float32 --temperature 0 \
    --max-tokens 4 --max-model-len 256 --kv-cache-memory 16MiB 2> "build/emulated-$1.log"
}
mkdir -p build
start=$SECONDS
run_on Haswell > build/emulated-Haswell.out & haswell=$!
run_on Nehalem > build/emulated-Nehalem.out & nehalem=$!
for cpu in Haswell Nehalem; do
  pid=$haswell; [ "$cpu" = Nehalem ] && pid=$nehalem
  wait "$pid" || { cat "build/emulated-$cpu.log" >&2; echo "the engine failed on an emulated $cpu" >&2; exit 1; }
done
out_Haswell=$(cat build/emulated-Haswell.out)
out_Nehalem=$(cat build/emulated-Nehalem.out)
echo "Haswell: ${out_Haswell@Q}, Nehalem: ${out_Nehalem@Q}, both in $((SECONDS - start)) s" >&2
grep -q "has no AVX2" build/emulated-Nehalem.log || { echo "no scalar-kernel warning on Nehalem" >&2; exit 1; }
if grep -q "has no AVX2" build/emulated-Haswell.log; then echo "a scalar-kernel warning on Haswell" >&2; exit 1; fi
[ -n "$out_Haswell" ] && [ "$out_Haswell" = "$out_Nehalem" ] || {
  echo "the scalar kernels (Nehalem) gave ${out_Nehalem@Q}, AVX2 (Haswell) ${out_Haswell@Q}" >&2; exit 1; }
echo "emulated Haswell (AVX2) and Nehalem (scalar) give the same greedy tokens"
