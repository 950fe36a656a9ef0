// The CPU kernels compiled for AVX2 + FMA + F16C; bf16 products widen to float32 in registers. Headers shared with the baseline code are
// included before the target pragma so that only this file's own functions use these features.
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
#pragma GCC target("avx2,fma,f16c")

#include "kvflow/cpu/kernels.h"
#include "kvflow/cpu/packed_linear_widened.h"
#include "kvflow/cpu/quantized_linear_avx2.h"
#include "kvflow/cpu/small_linear_widened.h"
#include "kvflow/cpu/vec_avx2.h"

namespace kvflow::cpu {
namespace {

KernelTable make_avx2_table() {
  KernelTable table = make_kernel_table<VecAvx2>("avx2");
  // 6 rows x 16 features: 12 accumulators, 2 widened weights and a broadcast in 16 registers.
  table.packed_linear = PackedLinearWidened<VecAvx2, 6, 2>::run;
  table.small_linear[int(DType::kBFloat16)] = SmallLinearWidened<VecAvx2>::run;
  fill_quantized_entries_avx2(table, std::make_integer_sequence<int, kNumQuantFormats>{});
  fill_avx_vnni_entries(table);
  return table;
}

}  // namespace

const KernelTable& avx2_kernels() {
  static const KernelTable table = make_avx2_table();
  return table;
}

}  // namespace kvflow::cpu

#pragma GCC pop_options

#else  // not x86-64: never selected (supported_isas() does not list it)

namespace kvflow::cpu {
const KernelTable& avx2_kernels() { return scalar_kernels(); }
}  // namespace kvflow::cpu

#endif
