// The interleaved GGUF block products in AVX-VNNI, the VEX form of vpdpbusd that CPUs without
// AVX-512 have (Intel's since Alder Lake): the AVX2 table's kernels with vpdpbusd for their byte
// products, as isa_avx512_vnni.cpp does for the AVX-512 tables. Headers shared with the baseline
// code are included before the target pragma so that only this file's own functions use it.
#include <algorithm>
#include <cstdint>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kvflow/cpu/kernel_table.h"
#include "kvflow/numeric.h"

#if defined(__x86_64__)

#pragma GCC push_options
#pragma GCC target("avxvnni,avx2,fma,f16c")

#include "kvflow/cpu/kernels.h"
#include "kvflow/cpu/quantized_linear_avx2.h"

namespace kvflow::cpu {
namespace {

// AVX-VNNI's vpdpbusd (VEX).
struct AvxVpdpbusd {
  static constexpr int kVectorRegisters = 16;
  static __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
};

}  // namespace

void fill_avx_vnni_entries(KernelTable& table) {
  if (__builtin_cpu_supports("avxvnni")) {
    fill_interleaved_entries<DpbusdDot<AvxVpdpbusd>>(table, std::make_integer_sequence<int, kNumQuantFormats>{});
  }
}

}  // namespace kvflow::cpu

#pragma GCC pop_options

#else  // not x86-64: the AVX2 table is never selected

namespace kvflow::cpu {
void fill_avx_vnni_entries(KernelTable&) {}
}  // namespace kvflow::cpu

#endif
