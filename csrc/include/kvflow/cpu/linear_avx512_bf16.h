// small_linear for bfloat16 weights on CPUs with AVX-512 BF16: vdpbf16ps multiplies 32 weight
// values by 32 input values per instruction (pairs summed into 16 float32 lanes), half the
// instructions of widening the weights and using FMAs, which is what keeps 4-8 rows bound by
// reading the weights rather than by arithmetic. Include only in isa_avx512_bf16.cpp, after
// kernels.h (for small_linear_blocks).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kvflow/cpu/vec_avx512_bf16.h"
#include "kvflow/numeric.h"

namespace kvflow::cpu {
namespace {

struct SmallLinearTileAvx512Bf16 {
  static constexpr int kPrefetchBlocks = 4;
  bfloat16* y;        // [rows, out_features] at (r0, o)
  const bfloat16* x;  // [rows, in_features] at row r0
  const bfloat16* w;  // [out_features, in_features] at row o
  const bfloat16* b;  // [out_features] at o, or null
  int64_t in_features, out_features;

  template <int kOut, int kRows>
  void run() const {
    __m512 acc[kRows][kOut];
    for (int r = 0; r < kRows; ++r) {
      for (int o = 0; o < kOut; ++o) acc[r][o] = _mm512_setzero_ps();
    }
    // One loop with the tail folded in as a masked step: the accumulators stay in registers.
    const int64_t full = in_features / 32 * 32;
    const __mmask32 tail_mask = __mmask32((uint64_t(1) << (in_features - full)) - 1);
    // This block's kOut weight rows are contiguous, and so is the next block; each step
    // prefetches as many bytes as it consumes, kPrefetchBlocks blocks ahead, so the memory
    // system always has the next block in flight (its rows are too short for the hardware
    // prefetcher to pick up four streams at once).
    const char* prefetch = reinterpret_cast<const char*>(w) + kPrefetchBlocks * kOut * in_features * 2;
    for (int64_t k = 0; k < in_features; k += 32, prefetch += kOut * 64) {
      for (int o = 0; o < kOut; ++o) _mm_prefetch(prefetch + o * 64, _MM_HINT_T0);
      const __mmask32 mask = k < full ? ~__mmask32(0) : tail_mask;
      __m512bh wv[kOut];
      for (int o = 0; o < kOut; ++o) wv[o] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + o * in_features + k);
      for (int r = 0; r < kRows; ++r) {
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + r * in_features + k);
        for (int o = 0; o < kOut; ++o) acc[r][o] = _mm512_dpbf16_ps(acc[r][o], wv[o], xv);
      }
    }
    // Fully unrolled, so that every accumulator is a named register rather than stack memory.
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
      for (int o = 0; o < kOut; ++o) {
        float sum = VecAvx512::reduce_add(acc[r][o]);
        if (b != nullptr) sum += to_float(b[o]);
        y[r * out_features + o] = from_float<bfloat16>(sum);
      }
    }
  }
};

inline void small_linear_avx512_bf16(void* out, const void* input, const void* weight, const void* bias, int64_t rows,
                                     int64_t in_features, int64_t out_features, int64_t begin, int64_t end) {
  const bfloat16* x = static_cast<const bfloat16*>(input);
  const bfloat16* w = static_cast<const bfloat16*>(weight);
  const bfloat16* b = static_cast<const bfloat16*>(bias);
  bfloat16* y = static_cast<bfloat16*>(out);
  small_linear_blocks(rows, begin, end, [&](int64_t o, int64_t r0) {
    return SmallLinearTileAvx512Bf16{y + r0 * out_features + o, x + r0 * in_features, w + o * in_features,
                                     b == nullptr ? nullptr : b + o, in_features, out_features};
  });
}

}  // namespace
}  // namespace kvflow::cpu
