// small_linear for bfloat16 weights on CPUs with AVX-512 BF16: vdpbf16ps multiplies 32 weight
// values by 32 input values per instruction (pairs summed into 16 float32 lanes), half the
// instructions of widening the weights and using FMAs, which is what keeps 4-8 rows bound by
// reading the weights rather than by arithmetic. Include only in isa_avx512_bf16.cpp.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvflow/cpu/vec_avx512_bf16.h"
#include "kvflow/numeric.h"

namespace kvflow::cpu {
namespace {

inline void small_linear_avx512_bf16(void* out, const float* x, const void* weight, const void* bias, int64_t rows,
                                     int64_t in_features, int64_t out_features, int64_t begin, int64_t end) {
  constexpr int kRows = 8;
  const bfloat16* w = static_cast<const bfloat16*>(weight);
  const bfloat16* b = static_cast<const bfloat16*>(bias);
  bfloat16* y = static_cast<bfloat16*>(out);
  // The input rows back in bfloat16 (they came from bfloat16, so this is exact), padded with
  // zeros to a multiple of 32 so that the tail needs no special case on the x side.
  const int64_t padded = (in_features + 31) / 32 * 32;
  std::vector<bfloat16> xb(rows * padded, bfloat16{0});
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < in_features; ++k) xb[r * padded + k] = from_float<bfloat16>(x[r * in_features + k]);
  }
  const int64_t full = in_features / 32 * 32;
  const __mmask32 tail_mask = __mmask32((uint64_t(1) << (in_features - full)) - 1);
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int nr = int(std::min<int64_t>(kRows, rows - r0));
    for (int64_t o = begin; o < end; ++o) {
      const bfloat16* w_row = w + o * in_features;
      __m512 acc[kRows];
      for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t k = 0; k < padded; k += 32) {
        const __m512i wv = k < full ? _mm512_loadu_si512(w_row + k) : _mm512_maskz_loadu_epi16(tail_mask, w_row + k);
        for (int r = 0; r < nr; ++r) {
          const __m512i xv = _mm512_loadu_si512(&xb[(r0 + r) * padded + k]);
          acc[r] = _mm512_dpbf16_ps(acc[r], reinterpret_cast<__m512bh>(wv), reinterpret_cast<__m512bh>(xv));
        }
      }
      for (int r = 0; r < nr; ++r) {
        float sum = VecAvx512::reduce_add(acc[r]);
        if (b != nullptr) sum += to_float(b[o]);
        y[(r0 + r) * out_features + o] = from_float<bfloat16>(sum);
      }
    }
  }
}

}  // namespace
}  // namespace kvflow::cpu
