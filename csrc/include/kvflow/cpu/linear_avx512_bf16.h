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

// [sum(a), sum(b), sum(c), sum(d)]: four horizontal sums sharing their shuffles, a third of the
// instructions of four separate reductions (which at 4-8 rows compete with vdpbf16ps for the
// vector units).
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] and likewise for c, d.
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // Per lane: [a, b, c, d] partial sums.
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
}

struct SmallLinearTileAvx512Bf16 {
  static constexpr int kPrefetchBlocks = 2;
  LinearOut<bfloat16> y;
  int64_t y_index;    // of output (r0, o)
  const bfloat16* x;  // [rows, in_features] at row r0
  const bfloat16* w;  // [out_features, in_features] at row o
  const bfloat16* b;  // [out_features] at o, or null
  int64_t in_features, out_features;

  // Fewer than four dot products would wait on vdpbf16ps's latency rather than on the weights
  // (and then run at whatever speed the loop's placement in the binary gives the front end):
  // those keep kChains partial sums each, over interleaved 32-value steps of k.
  template <int kOut, int kRows>
  static constexpr int kChains = kOut * kRows >= 4 ? 1 : 4 / (kOut * kRows);

  template <int kOut, int kRows>
  __attribute__((always_inline)) void step(__m512 (&acc)[kRows][kOut], int64_t k, __mmask32 mask,
                                           const char* prefetch) const {
    if constexpr (kOut > 1) {  // one output at a time is one sequential stream: the hardware's
      for (int o = 0; o < kOut; ++o) _mm_prefetch(prefetch + o * 64, _MM_HINT_T1);
    }
    __m512bh wv[kOut];
    for (int o = 0; o < kOut; ++o) wv[o] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + o * in_features + k);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + r * in_features + k);
      for (int o = 0; o < kOut; ++o) acc[r][o] = _mm512_dpbf16_ps(acc[r][o], wv[o], xv);
    }
  }

  template <int kOut, int kRows>
  void run() const {
    constexpr int chains = kChains<kOut, kRows>;
    __m512 acc[chains][kRows][kOut];
    for (int c = 0; c < chains; ++c) {
      for (int r = 0; r < kRows; ++r) {
        for (int o = 0; o < kOut; ++o) acc[c][r][o] = _mm512_setzero_ps();
      }
    }
    // The tail is folded in as a masked step: the accumulators stay in registers.
    const int64_t full = in_features / 32 * 32;
    const __mmask32 tail_mask = __mmask32((uint64_t(1) << (in_features - full)) - 1);
    // This block's kOut weight rows are contiguous, and so is the next block; each step
    // prefetches into L2 as many bytes as it consumes, kPrefetchBlocks blocks ahead, so the
    // memory system always has the next block in flight (the rows are too short for the
    // hardware prefetcher to pick up four streams at once). Not into L1: at 4-8 input rows
    // the block being read is read once per row block and must stay there.
    const char* prefetch = reinterpret_cast<const char*>(w) + kPrefetchBlocks * kOut * in_features * 2;
    int64_t k = 0;
    if constexpr (chains > 1) {
      for (; k + 32 * chains <= full; k += 32 * chains, prefetch += chains * kOut * 64) {
#pragma GCC unroll 4
        for (int c = 0; c < chains; ++c) step<kOut, kRows>(acc[c], k + 32 * c, ~__mmask32(0), prefetch + c * kOut * 64);
      }
    }
    for (; k < in_features; k += 32, prefetch += kOut * 64) {
      step<kOut, kRows>(acc[0], k, k < full ? ~__mmask32(0) : tail_mask, prefetch);
    }
#pragma GCC unroll 4
    for (int c = 1; c < chains; ++c) {
      for (int r = 0; r < kRows; ++r) {
        for (int o = 0; o < kOut; ++o) acc[0][r][o] = _mm512_add_ps(acc[0][r][o], acc[c][r][o]);
      }
    }
    // Fully unrolled, so that every accumulator is a named register rather than stack memory.
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      float sums[kOut];
      if constexpr (kOut == 4) {
        _mm_storeu_ps(sums, reduce4(acc[0][r][0], acc[0][r][1], acc[0][r][2], acc[0][r][3]));
      } else {
#pragma GCC unroll 4
        for (int o = 0; o < kOut; ++o) sums[o] = VecAvx512::reduce_add(acc[0][r][o]);
      }
#pragma GCC unroll 4
      for (int o = 0; o < kOut; ++o) y.store(y_index + r * out_features + o, b == nullptr ? sums[o] : sums[o] + to_float(b[o]));
    }
  }
};

inline void small_linear_avx512_bf16(void* out, bool out_is_float32, const void* input, const void* weight,
                                     const void* bias, int64_t rows, int64_t in_features, int64_t out_features,
                                     int64_t begin, int64_t end) {
  const bfloat16* x = static_cast<const bfloat16*>(input);
  const bfloat16* w = static_cast<const bfloat16*>(weight);
  const bfloat16* b = static_cast<const bfloat16*>(bias);
  const LinearOut<bfloat16> y{out, out_is_float32};
  small_linear_blocks(rows, begin, end, [&](int64_t o, int64_t r0) {
    return SmallLinearTileAvx512Bf16{y, r0 * out_features + o, x + r0 * in_features, w + o * in_features,
                                     b == nullptr ? nullptr : b + o, in_features, out_features};
  });
}

}  // namespace
}  // namespace kvflow::cpu
