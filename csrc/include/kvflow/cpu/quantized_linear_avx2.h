// quantized_linear's block dot products in AVX2 integer ops: the block's codes and the input
// block's int8 values multiply into 16-bit pair sums (vpmaddubsw, whose first operand is
// unsigned: Q4_1's nibbles as they are, or the signed formats' |w| against x carrying w's sign)
// and 32-bit sums (vpmaddwd), scaled into float accumulators once per block.
// Include only inside a translation unit compiled for AVX2 + FMA + F16C, after kernels.h.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kvflow/cpu/gguf_blocks.h"

namespace kvflow::cpu {
namespace {

template <QuantFormat F>
struct QuantDotAvx2 {
  static constexpr int64_t kBytes = F == QuantFormat::kQ4_0 ? 18 : F == QuantFormat::kQ4_1 ? 20 : 34;
  // The stream of weight rows, asked for this far ahead (as small_linear streams its rows).
  static constexpr int64_t kAheadBytes = 2048;

  static __m256i codes(const uint8_t* block) {
    if constexpr (F == QuantFormat::kQ8_0) {
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    } else {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (F == QuantFormat::kQ4_1 ? 4 : 2)));
      const __m128i mask = _mm_set1_epi8(0xF);
      const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
      return F == QuantFormat::kQ4_0 ? _mm256_sub_epi8(q, _mm256_set1_epi8(8)) : q;
    }
  }

  // The block's eight 32-bit partial sums of codes * x, as float32.
  static __m256 dot(__m256i w, __m256i xq) {
    __m256i pairs;
    if constexpr (F == QuantFormat::kQ4_1) {
      pairs = _mm256_maddubs_epi16(w, xq);
    } else {
      pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w));
    }
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }

  static float reduce(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }

  // [d, m] of a Q4_1 block, [d, x] of the others (the second lane unused).
  static __m128 scales(const uint8_t* block) {
    int32_t bits;
    __builtin_memcpy(&bits, block, sizeof bits);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
  }

  template <int kRows>
  static void run(const uint8_t* w, const QuantizedRows& x, int64_t r0, float* sums) {
    // Two accumulators a row, even and odd blocks, so that one row is not bound by the latency
    // of the FMA (nor, for Q4_1, of the offsets' adds: lane 1 of `offsets` gathers m * sum(x)).
    __m256 acc[kRows][2];
    __m128 offsets[kRows][2];
    for (int r = 0; r < kRows; ++r) {
      acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      offsets[r][0] = offsets[r][1] = _mm_setzero_ps();
    }
    auto block = [&](int64_t b, int chain) {
      const uint8_t* wb = w + b * kBytes;
      __builtin_prefetch(wb + kAheadBytes, 0, 2);
      const __m256i q = codes(wb);
      const __m128 dm = scales(wb);
      for (int r = 0; r < kRows; ++r) {
        const int64_t i = (r0 + r) * x.blocks + b;
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + i * kQuantBlock));
        // [d * scale, m * sum]
        const __m128 products =
            _mm_mul_ps(dm, _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(x.scale_sum + 2 * i))));
        acc[r][chain] = _mm256_fmadd_ps(_mm256_broadcastss_ps(products), dot(q, xq), acc[r][chain]);
        if constexpr (F == QuantFormat::kQ4_1) offsets[r][chain] = _mm_add_ps(offsets[r][chain], products);
      }
    };
    int64_t b = 0;
    for (; b + 2 <= x.blocks; b += 2) {
      block(b, 0);
      block(b + 1, 1);
    }
    if (b < x.blocks) block(b, 0);
    for (int r = 0; r < kRows; ++r) {
      const __m128 offset = _mm_add_ps(offsets[r][0], offsets[r][1]);
      sums[r] = reduce(_mm256_add_ps(acc[r][0], acc[r][1])) + _mm_cvtss_f32(_mm_shuffle_ps(offset, offset, 1));
    }
  }
};

// An 8 x 8 matrix of 32-bit words, one row a register, transposed in place.
inline void transpose_8x8_epi32(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

// DequantizePanelFn (kernel_table.h) in AVX2: eight rows of a block at a time, each row's 32
// values dequantized in registers, rounded to bfloat16 and paired (values k and k + 1 in one
// 32-bit word), then the 8 rows x 16 pairs transposed so that each pair of the 8 rows is one
// 32-byte store.
template <QuantFormat F>
void dequantize_panel_avx2(const uint8_t* weight, int64_t row_bytes, int64_t out_features, int64_t panel,
                           bfloat16* dst) {
  using Dot = QuantDotAvx2<F>;
  constexpr int64_t kPanel = kPackedLinearPanel;
  const int64_t blocks = row_bytes / Dot::kBytes;
  const int64_t first = panel * kPanel, width = std::min<int64_t>(kPanel, out_features - first);
  auto* pairs = reinterpret_cast<uint32_t*>(dst);  // pairs[k / 2][j]: values k and k + 1 of row j
  const __m256i round_bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
  // Eight floats to bfloat16 bits (round to nearest even) in the low half of each 32-bit lane.
  auto bfloat16_bits = [&](__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(round_bias, odd)), 16);
  };
  for (int64_t b = 0; b < blocks; ++b) {
    uint32_t* block_pairs = pairs + b * (kQuantBlock / 2) * kPanel;
    for (int64_t j0 = 0; j0 < kPanel; j0 += 8) {
      __m256i low[8], high[8];  // per row: pairs 0-7, pairs 8-15
      for (int r = 0; r < 8; ++r) {
        if (j0 + r >= width) {
          low[r] = high[r] = _mm256_setzero_si256();
          continue;
        }
        const uint8_t* block = weight + (first + j0 + r) * row_bytes + b * Dot::kBytes;
        const __m256i q = Dot::codes(block);
        const __m128 dm = Dot::scales(block);
        const __m256 d = _mm256_set1_ps(_mm_cvtss_f32(dm));
        const __m256 m = F == QuantFormat::kQ4_1 ? _mm256_set1_ps(_mm_cvtss_f32(_mm_shuffle_ps(dm, dm, 1)))
                                                 : _mm256_setzero_ps();
        const __m128i q_low = _mm256_castsi256_si128(q), q_high = _mm256_extracti128_si256(q, 1);
        const __m128i chunks[4] = {q_low, _mm_srli_si128(q_low, 8), q_high, _mm_srli_si128(q_high, 8)};
        __m256i bits[4];
        for (int c = 0; c < 4; ++c) {
          bits[c] = bfloat16_bits(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(chunks[c])), d, m));
        }
        // packus interleaves the 128-bit lanes: 64-bit chunks come out as pairs 0-1, 4-5, 2-3, 6-7.
        low[r] = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits[0], bits[1]), 0xD8);
        high[r] = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits[2], bits[3]), 0xD8);
      }
      transpose_8x8_epi32(low);
      transpose_8x8_epi32(high);
      for (int k2 = 0; k2 < 8; ++k2) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(block_pairs + k2 * kPanel + j0), low[k2]);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(block_pairs + (k2 + 8) * kPanel + j0), high[k2]);
      }
    }
  }
}

}  // namespace
}  // namespace kvflow::cpu
