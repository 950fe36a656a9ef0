// The CPU kernels compiled for AVX-512 (F, BW, VL, DQ). Headers shared with the baseline code
// are included before the target pragma so that only this file's own functions use AVX-512.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kvflow/cpu/kernel_table.h"
#include "kvflow/cpu/vec_scalar.h"
#include "kvflow/numeric.h"

#if defined(__x86_64__)

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

#include "kvflow/cpu/kernels.h"
#include "kvflow/cpu/vec_avx512.h"

namespace kvflow::cpu {

namespace {

KernelTable make_avx512_table() {
  KernelTable table = make_kernel_table<VecAvx512>("avx512");
  table.packed_linear = avx2_kernels().packed_linear;  // no bf16 dot product: AVX2's widening kernel
  fill_avx512_quantized_entries(table);
  return table;
}

}  // namespace

const KernelTable& avx512_kernels() {
  static const KernelTable table = make_avx512_table();
  return table;
}

}  // namespace kvflow::cpu

#pragma GCC pop_options

#else  // not x86-64: never selected (supported_isas() does not list it)

namespace kvflow::cpu {
const KernelTable& avx512_kernels() { return scalar_kernels(); }
}  // namespace kvflow::cpu

#endif
