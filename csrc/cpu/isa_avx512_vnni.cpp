// The interleaved GGUF block products in AVX-512 VNNI: the AVX2 kernels' structure
// (quantized_linear_avx2.h) with vpdpbusd on 256-bit vectors (AVX512-VL), which sums four byte
// products into each 32-bit lane in one instruction where AVX2 takes vpmaddubsw, a 16-bit add and
// vpmaddwd. Headers shared with the baseline code are included before the target pragma so that
// only this file's own functions use these features.
#include <algorithm>
#include <cstdint>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kvflow/cpu/kernel_table.h"
#include "kvflow/numeric.h"

#if defined(__x86_64__)

namespace kvflow::cpu {
namespace {

bool cpu_has_avx512_vnni() { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl"); }

}  // namespace
}  // namespace kvflow::cpu

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

#include "kvflow/cpu/kernels.h"
#include "kvflow/cpu/quantized_linear_avx2.h"

namespace kvflow::cpu {
namespace {

// AVX-512 VNNI's vpdpbusd on 256-bit vectors (EVEX).
struct Avx512Vpdpbusd {
  static __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
};

}  // namespace

void fill_avx512_quantized_entries(KernelTable& table) {
  const KernelTable& avx2 = avx2_kernels();
  table.quantize_activations[0] = avx2.quantize_activations[0];
  table.quantize_activations[1] = avx2.quantize_activations[1];
  for (int format = 0; format < kNumQuantFormats; ++format) {
    table.quantized_linear[format] = avx2.quantized_linear[format];
    table.dequantize_panel[format] = avx2.dequantize_panel[format];
  }
  for (int base = 0; base < kNumInterleavedFormats; ++base) {
    table.quantized_linear_interleaved[base] = avx2.quantized_linear_interleaved[base];
  }
  if (cpu_has_avx512_vnni()) {
    fill_interleaved_entries<DpbusdDot<Avx512Vpdpbusd>>(table, std::make_integer_sequence<int, kNumQuantFormats>{});
  }
}

}  // namespace kvflow::cpu

#pragma GCC pop_options

#else  // not x86-64: the AVX-512 tables are never selected

namespace kvflow::cpu {
void fill_avx512_quantized_entries(KernelTable&) {}
}  // namespace kvflow::cpu

#endif
