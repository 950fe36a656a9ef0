// The interleaved GGUF block products in AVX-512 VNNI: the AVX2 kernels' structure
// (quantized_linear_avx2.h) with vpdpbusd, which sums four byte products into each 32-bit lane in
// one instruction where AVX2 takes vpmaddubsw, a 16-bit add and vpmaddwd. The 32-weight formats
// take two groups of rows at a time on 512-bit vectors; the K-quants keep 256-bit ones. Headers shared with the baseline code are included before the target pragma so that
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

using Avx512Dot = DpbusdDot<Avx512Vpdpbusd>;

// interleaved_group_avx2's lane_fifth_bits on two groups' fifth bits, one in each 256-bit half.
inline __m512i lane_fifth_bits_512(__m512i bits, int first) {
  const __m512i lane_bytes = _mm512_set4_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0x00000000);
  const __m512i spread = _mm512_shuffle_epi8(bits, _mm512_add_epi8(lane_bytes, _mm512_set1_epi8(char(first / 8))));
  const __m512i bit = _mm512_set1_epi32(first % 8 == 0 ? 0x08040201 : int32_t(0x80402010u));
  return _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(spread, bit), _mm512_set1_epi8(0x10));
}

// Two groups of 8 weight rows of a 32-weight format, `group` and the one after it, times input
// rows r0 .. r0 + kRows: interleaved_group_avx2's products on 512-bit vectors, the first group's
// rows in the low half and the second's in the high half: each instruction does twice the
// products, and each broadcast input word and scale serves 16 rows (in L2 on a Zen 4, 7-20%
// faster than two 256-bit calls: docs/benchmarks.md). A row's products add in two chains (even
// and odd pieces, or low and high nibbles). The integer sums are exact and each lane's float
// steps are interleaved_group_avx2's, so the results are bit-equal to two calls of it.
template <QuantFormat F, int kRows>
void interleaved_group_pair_avx512(const uint8_t* group, int64_t group_bytes, const QuantizedRows& x, int64_t r0,
                                   __m512* out) {
  constexpr bool kSigned = F == QuantFormat::kQ8_0;
  constexpr bool kFifthBit = F == QuantFormat::kQ5_0 || F == QuantFormat::kQ5_1;
  constexpr int kPieces = kSigned ? 8 : 4;
  constexpr int64_t kBytes = quant_block_bytes(F), kHeader = interleaved_header_bytes(F);
  constexpr int64_t kFifthBits = kInterleavedRows * (kHeader - 4);
  constexpr int64_t kGroupBlock = kInterleavedRows * kBytes, kFirstPiece = kInterleavedRows * kHeader;
  constexpr int64_t kAheadBytes = (kSigned ? 2 : 1) * kInterleavedAheadBytes;
  const __m512i low4 = _mm512_set1_epi8(0xF), zero = _mm512_setzero_si512();
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    const uint8_t* first_block = group + b * kGroupBlock;
    const uint8_t* second_block = first_block + group_bytes;
    for (int64_t line = 0; line < kGroupBlock; line += 64) {
      __builtin_prefetch(first_block + kAheadBytes + line, 0, 2);
      __builtin_prefetch(second_block + kAheadBytes + line, 0, 2);
    }
    auto both = [&](int64_t offset) {  // 32 bytes at offset in each group's block
      return _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first_block + offset))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second_block + offset)), 1);
    };
    auto both_halves = [&](int64_t offset) {  // 16 bytes at offset in each group's block
      return _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(first_block + offset))),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(second_block + offset)), 1);
    };
    auto input_word = [&](int r, int byte) {
      const auto* xq = reinterpret_cast<const uint8_t*>(x.q + ((r0 + r) * x.blocks + b) * kQuantBlock);
      return _mm512_set1_epi32(int32_t(block_word(xq + byte)));
    };
    __m512i sums[kRows], second[kRows];  // two chains of products a row: even and odd pieces, or low and high nibbles
    if constexpr (kSigned) {
#pragma GCC unroll 8
      for (int k = 0; k < kPieces; ++k) {
        const __m512i piece = both(kFirstPiece + 32 * k);
        const __m512i magnitude = _mm512_abs_epi8(piece);
        const __mmask64 negative = _mm512_movepi8_mask(piece);
#pragma GCC unroll 5
        for (int r = 0; r < kRows; ++r) {
          const __m512i word = input_word(r, 4 * k);
          const __m512i signed_x = _mm512_mask_sub_epi8(word, negative, zero, word);
          if (k % 2 == 0) {
            sums[r] = _mm512_dpbusd_epi32(k == 0 ? zero : sums[r], magnitude, signed_x);
          } else {
            second[r] = _mm512_dpbusd_epi32(k == 1 ? zero : second[r], magnitude, signed_x);
          }
        }
      }
    } else {
      const __m512i fifth = kFifthBit ? both(kFifthBits) : zero;
#pragma GCC unroll 8
      for (int k = 0; k < kPieces; ++k) {
        const __m512i piece = both(kFirstPiece + 32 * k);
        __m512i low = _mm512_and_si512(piece, low4), high = _mm512_and_si512(_mm512_srli_epi16(piece, 4), low4);
        if constexpr (kFifthBit) {
          low = _mm512_or_si512(low, lane_fifth_bits_512(fifth, 4 * k));
          high = _mm512_or_si512(high, lane_fifth_bits_512(fifth, 16 + 4 * k));
        }
#pragma GCC unroll 5
        for (int r = 0; r < kRows; ++r) {
          const __m512i x_low = input_word(r, 4 * k), x_high = input_word(r, 16 + 4 * k);
          sums[r] = _mm512_dpbusd_epi32(k == 0 ? zero : sums[r], low, x_low);
          second[r] = _mm512_dpbusd_epi32(k == 0 ? zero : second[r], high, x_high);
        }
      }
    }
    for (int r = 0; r < kRows; ++r) sums[r] = _mm512_add_epi32(sums[r], second[r]);
    const __m512 d = _mm512_cvtph_ps(both_halves(0));
    const __m512 m = has_offset(F) ? _mm512_cvtph_ps(both_halves(16))
                                   : _mm512_mul_ps(d, _mm512_set1_ps(kFifthBit ? -16.f : -8.f));
    for (int r = 0; r < kRows; ++r) {
      const float* scale_sum = x.scale_sum + 2 * ((r0 + r) * x.blocks + b);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_mul_ps(d, _mm512_set1_ps(scale_sum[0])), acc[r]);
      if constexpr (!kSigned) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(scale_sum[1]), acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = acc[r];
}

// QuantizedLinearFn on the interleaved layout of a 32-weight format: two groups at a time on
// 512-bit vectors, a last odd group by the 256-bit kernel.
template <QuantFormat F>
void quantized_linear_interleaved_avx512(void* out, bool out_is_float32, const QuantizedRows& x, const uint8_t* weight,
                                         int64_t row_bytes, const float* bias, int64_t rows, int64_t out_features,
                                         int64_t begin, int64_t end) {
  constexpr int kRowTile = 4, kPairRows = 2 * kInterleavedRows;
  const int64_t group_bytes = kInterleavedRows * row_bytes;
  int64_t first = begin;
  for (; first + kPairRows <= end; first += kPairRows) {
    const uint8_t* group = weight + first * row_bytes;
    const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias + first);
    for (int64_t r0 = 0; r0 < rows;) {
      __m512 sums[kRowTile + 1];
      const int n = rows - r0 == kRowTile + 1 ? kRowTile + 1 : int(std::min<int64_t>(kRowTile, rows - r0));
      switch (n) {
        case 1: interleaved_group_pair_avx512<F, 1>(group, group_bytes, x, r0, sums); break;
        case 2: interleaved_group_pair_avx512<F, 2>(group, group_bytes, x, r0, sums); break;
        case 3: interleaved_group_pair_avx512<F, 3>(group, group_bytes, x, r0, sums); break;
        case 4: interleaved_group_pair_avx512<F, 4>(group, group_bytes, x, r0, sums); break;
        default: interleaved_group_pair_avx512<F, 5>(group, group_bytes, x, r0, sums); break;
      }
      for (int r = 0; r < n; ++r) {
        const __m512 y = _mm512_add_ps(sums[r], b);
        const int64_t index = (r0 + r) * out_features + first;
        if (out_is_float32) {
          _mm512_storeu_ps(static_cast<float*>(out) + index, y);
        } else {
          VecAvx2::store(static_cast<bfloat16*>(out) + index, _mm512_castps512_ps256(y));
          VecAvx2::store(static_cast<bfloat16*>(out) + index + kInterleavedRows, _mm512_extractf32x8_ps(y, 1));
        }
      }
      r0 += n;
    }
  }
  if (first < end) {
    quantized_linear_interleaved_avx2<F, Avx512Dot>(out, out_is_float32, x, weight, row_bytes, bias, rows,
                                                    out_features, first, end);
  }
}

QuantizedLinearFn pair_kernel(QuantFormat format) {
  switch (format) {
    case QuantFormat::kQ4_0: return quantized_linear_interleaved_avx512<QuantFormat::kQ4_0>;
    case QuantFormat::kQ4_1: return quantized_linear_interleaved_avx512<QuantFormat::kQ4_1>;
    case QuantFormat::kQ5_0: return quantized_linear_interleaved_avx512<QuantFormat::kQ5_0>;
    case QuantFormat::kQ5_1: return quantized_linear_interleaved_avx512<QuantFormat::kQ5_1>;
    default: return quantized_linear_interleaved_avx512<QuantFormat::kQ8_0>;
  }
}

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
    fill_interleaved_entries<Avx512Dot>(table, std::make_integer_sequence<int, kNumQuantFormats>{});
    for (const QuantFormat format : {QuantFormat::kQ4_0, QuantFormat::kQ4_1, QuantFormat::kQ5_0, QuantFormat::kQ5_1,
                                     QuantFormat::kQ8_0}) {
      table.quantized_linear_interleaved[interleaved_index(format)] = pair_kernel(format);
    }
  }
}

}  // namespace kvflow::cpu

#pragma GCC pop_options

#else  // not x86-64: the AVX-512 tables are never selected

namespace kvflow::cpu {
void fill_avx512_quantized_entries(KernelTable&) {}
}  // namespace kvflow::cpu

#endif
