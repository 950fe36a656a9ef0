// The interleaved GGUF block products in AVX-512 VNNI: the AVX2 kernels' structure
// (quantized_linear_avx2.h) with vpdpbusd, which sums four byte products into each 32-bit lane in
// one instruction where AVX2 takes vpmaddubsw, a 16-bit add and vpmaddwd; from two input rows on
// 512-bit vectors that hold two groups of interleaved rows. Headers shared with the baseline code
// are included before the target pragma so that only this file's own functions use these features.
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
  static constexpr int kVectorRegisters = 32;
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

// The same block of two consecutive groups of 8 interleaved rows, read together: the first
// group's bytes in the low half of each vector, the second's in the high half.
struct GroupPairBlock {
  const uint8_t* first;
  int64_t group_bytes;  // from the first group to the second

  const uint8_t* second() const { return first + group_bytes; }
  __m512i bytes32(int64_t offset) const {
    return _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + offset))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second() + offset)), 1);
  }
  __m256i bytes16(int64_t offset) const {
    return _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(first + offset))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(second() + offset)), 1);
  }
  __m128i bytes8(int64_t offset) const {
    return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(first + offset)),
                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(second() + offset)));
  }
  __m512 halves(int64_t offset) const { return _mm512_cvtph_ps(bytes16(offset)); }  // 8 + 8 float16
  void prefetch(int64_t ahead, int64_t bytes) const {
    for (int64_t line = 0; line < bytes; line += 64) {
      __builtin_prefetch(first + ahead + line, 0, 2);
      __builtin_prefetch(second() + ahead + line, 0, 2);
    }
  }
};

// Codes 4 * word .. 4 * word + 3 of input row `row`'s chunk `chunk`, in every 32-bit lane.
inline __m512i input_word_512(const QuantizedRows& x, int64_t row, int64_t chunk, int word) {
  const auto* codes = reinterpret_cast<const uint8_t*>(x.q + (row * x.blocks + chunk) * kQuantBlock);
  return _mm512_set1_epi32(int32_t(block_word(codes + 4 * word)));
}

// Two groups of 8 weight rows of a 32-weight format, `group` and the one after it, times input
// rows r0 .. r0 + kRows: interleaved_group_avx2's products on 512-bit vectors, the first group's
// rows in the low half and the second's in the high half: each instruction does twice the
// products, and each broadcast input word and scale serves 16 rows (in L2 on a Zen 4, 7-25%
// faster than two 256-bit calls: docs/benchmarks.md). A row's products add in two chains (even
// and odd pieces, or low and high nibbles). Q8_0's signed codes go in biased to unsigned, w + 128,
// one flip a piece for all rows where carrying w's sign to each row's input took one more
// instruction a row and piece; the first chain starts from -128 times the input's code sum,
// which takes the bias back out. At two rows Q4_0's and Q4_1's high nibbles stay in place, 16
// times the code, their chain's sum shifted back once a block and row (as interleaved_group_avx2
// does); from three rows those shifts cost more than the unpacking they save. The integer sums
// are exact and each lane's float steps are interleaved_group_avx2's, so the results are
// bit-equal to two calls of it.
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
  constexpr bool kHighInPlace = !kSigned && !kFifthBit && kRows <= 2;  // the second chain's sums carry a factor 16
  const __m512i low4 = _mm512_set1_epi8(0xF), high4 = _mm512_set1_epi8(char(0xF0)), zero = _mm512_setzero_si512();
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    const GroupPairBlock block{group + b * kGroupBlock, group_bytes};
    block.prefetch(kAheadBytes, kGroupBlock);
    __m512i sums[kRows], second[kRows];  // two chains of products a row: even and odd pieces, or low and high nibbles
    if constexpr (kSigned) {
      const __m512i flip = _mm512_set1_epi8(char(0x80));
#pragma GCC unroll 8
      for (int k = 0; k < kPieces; ++k) {
        const __m512i biased = _mm512_xor_si512(block.bytes32(kFirstPiece + 32 * k), flip);
#pragma GCC unroll 5
        for (int r = 0; r < kRows; ++r) {
          __m512i& chain = k % 2 == 0 ? sums[r] : second[r];
          const __m512i start = k == 0 ? _mm512_set1_epi32(-128 * x.code_sum[(r0 + r) * x.blocks + b]) : zero;
          chain = _mm512_dpbusd_epi32(k < 2 ? start : chain, biased, input_word_512(x, r0 + r, b, k));
        }
      }
    } else {
      const __m512i fifth = kFifthBit ? block.bytes32(kFifthBits) : zero;
#pragma GCC unroll 8
      for (int k = 0; k < kPieces; ++k) {
        const __m512i piece = block.bytes32(kFirstPiece + 32 * k);
        __m512i low = _mm512_and_si512(piece, low4);
        __m512i high = kHighInPlace ? _mm512_and_si512(piece, high4) : _mm512_and_si512(_mm512_srli_epi16(piece, 4), low4);
        if constexpr (kFifthBit) {
          low = _mm512_or_si512(low, lane_fifth_bits_512(fifth, 4 * k));
          high = _mm512_or_si512(high, lane_fifth_bits_512(fifth, 16 + 4 * k));
        }
#pragma GCC unroll 5
        for (int r = 0; r < kRows; ++r) {
          // Q4_0 and Q5_0 take their codes' centre times the input's code sum off here.
          const __m512i start =
              has_offset(F) ? zero : _mm512_set1_epi32(-code_centre(F) * x.code_sum[(r0 + r) * x.blocks + b]);
          sums[r] = _mm512_dpbusd_epi32(k == 0 ? start : sums[r], low, input_word_512(x, r0 + r, b, k));
          second[r] = _mm512_dpbusd_epi32(k == 0 ? zero : second[r], high, input_word_512(x, r0 + r, b, 4 + k));
        }
      }
    }
    const __m512 d = block.halves(0);
    const __m512 m = has_offset(F) ? block.halves(16) : _mm512_setzero_ps();
    for (int r = 0; r < kRows; ++r) {
      const float* scale_sum = x.scale_sum + 2 * ((r0 + r) * x.blocks + b);
      const __m512i high_sums = kHighInPlace ? _mm512_srai_epi32(second[r], 4) : second[r];
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(sums[r], high_sums));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(scale_sum[0])), acc[r]);
      if constexpr (has_offset(F)) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(scale_sum[1]), acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = acc[r];
}

// Two groups of Q4_K or Q5_K rows: interleaved_k_group_avx2 on 512-bit vectors, as
// interleaved_group_pair_avx512 does for the 32-weight formats (bit-equal to two 256-bit calls).
template <QuantFormat F, int kRows>
void interleaved_k_group_pair_avx512(const uint8_t* group, int64_t group_bytes, const QuantizedRows& x, int64_t r0,
                                     __m512* out) {
  static_assert(F == QuantFormat::kQ4_K || F == QuantFormat::kQ5_K);
  constexpr bool kFifthBit = F == QuantFormat::kQ5_K;
  constexpr int64_t kGroupBlock = kInterleavedRows * quant_block_bytes(F);
  constexpr int64_t kScaleBytes = 32, kFifthBits = 128, kPieces = kInterleavedRows * interleaved_header_bytes(F);
  const __m512i low4 = _mm512_set1_epi8(0xF), low6 = _mm512_set1_epi32(63), zero = _mm512_setzero_si512();
  __m512 acc[kRows], min_acc[kRows];  // the scaled sums, and the mins apart: two chains
  for (int r = 0; r < kRows; ++r) acc[r] = min_acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.blocks / 8; ++b) {
    const GroupPairBlock block{group + b * kGroupBlock, group_bytes};
    block.prefetch(kInterleavedAheadBytes, kGroupBlock);
    const __m512 d = block.halves(0), dmin = block.halves(16);
    __m512i bytes[12];  // scale byte t of the 16 rows
    for (int t = 0; t < 12; ++t) bytes[t] = _mm512_cvtepu8_epi32(block.bytes8(kScaleBytes + 8 * t));
    __m512 scale[8], min[8];
    for (int j = 0; j < 8; ++j) {
      __m512i sc, m;
      if (j < 4) {
        sc = _mm512_and_si512(bytes[j], low6);
        m = _mm512_and_si512(bytes[j + 4], low6);
      } else {
        sc = _mm512_or_si512(_mm512_and_si512(bytes[j + 4], _mm512_set1_epi32(0xF)),
                             _mm512_slli_epi32(_mm512_srli_epi32(bytes[j - 4], 6), 4));
        m = _mm512_or_si512(_mm512_srli_epi32(bytes[j + 4], 4), _mm512_slli_epi32(_mm512_srli_epi32(bytes[j], 6), 4));
      }
      scale[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
      min[j] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m));
    }
    // w = d sc q - dmin m: the codes' sum times the input's d, less the min times d * sum(q).
    auto add_chunk = [&](int j, const __m512i* sums) {
      for (int r = 0; r < kRows; ++r) {
        const float* scale_sum = x.scale_sum + 2 * ((r0 + r) * x.blocks + 8 * b + j);
        const __m512 dot = _mm512_cvtepi32_ps(sums[r]);
        acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale[j], _mm512_set1_ps(scale_sum[0])), acc[r]);
        min_acc[r] = _mm512_fmadd_ps(min[j], _mm512_set1_ps(scale_sum[1]), min_acc[r]);
      }
    };
    if constexpr (kRows <= 2) {
      // A pair of chunks at once, as interleaved_k_group_avx2 does at one and two rows.
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const int64_t pieces = kPieces + 32 * 8 * g;
        __m512i low_even[kRows], low_odd[kRows], high_even[kRows], high_odd[kRows];
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          const __m512i piece = block.bytes32(pieces + 32 * k);
          __m512i low = _mm512_and_si512(piece, low4), high = _mm512_and_si512(_mm512_srli_epi16(piece, 4), low4);
          if constexpr (kFifthBit) {
            const __m512i fifth = block.bytes32(kFifthBits + 32 * k), one = _mm512_set1_epi8(1);
            auto fifth_of = [&](int chunk) {  // chunk's fifth bits, at bit 4 of each code
              return _mm512_slli_epi16(_mm512_and_si512(_mm512_srl_epi16(fifth, _mm_cvtsi32_si128(chunk)), one), 4);
            };
            low = _mm512_or_si512(low, fifth_of(2 * g));
            high = _mm512_or_si512(high, fifth_of(2 * g + 1));
          }
          for (int r = 0; r < kRows; ++r) {
            __m512i& chain_low = k % 2 == 0 ? low_even[r] : low_odd[r];
            __m512i& chain_high = k % 2 == 0 ? high_even[r] : high_odd[r];
            chain_low = _mm512_dpbusd_epi32(k < 2 ? zero : chain_low, low, input_word_512(x, r0 + r, 8 * b + 2 * g, k));
            chain_high =
                _mm512_dpbusd_epi32(k < 2 ? zero : chain_high, high, input_word_512(x, r0 + r, 8 * b + 2 * g + 1, k));
          }
        }
        __m512i sums[kRows];
        for (int r = 0; r < kRows; ++r) sums[r] = _mm512_add_epi32(low_even[r], low_odd[r]);
        add_chunk(2 * g, sums);
        for (int r = 0; r < kRows; ++r) sums[r] = _mm512_add_epi32(high_even[r], high_odd[r]);
        add_chunk(2 * g + 1, sums);
      }
      continue;
    }
    for (int j = 0; j < 8; ++j) {
      const int64_t chunk = 8 * b + j;
      const int64_t pieces = kPieces + 32 * 8 * (j / 2);
      __m512i sums[kRows], second[kRows];  // even and odd pieces
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        const __m512i piece = block.bytes32(pieces + 32 * k);
        __m512i codes = _mm512_and_si512(j % 2 == 0 ? piece : _mm512_srli_epi16(piece, 4), low4);
        if constexpr (kFifthBit) {
          const __m512i fifth = _mm512_srl_epi16(block.bytes32(kFifthBits + 32 * k), _mm_cvtsi32_si128(j));
          codes = _mm512_or_si512(codes, _mm512_slli_epi16(_mm512_and_si512(fifth, _mm512_set1_epi8(1)), 4));
        }
        for (int r = 0; r < kRows; ++r) {
          __m512i& chain = k % 2 == 0 ? sums[r] : second[r];
          chain = _mm512_dpbusd_epi32(k < 2 ? zero : chain, codes, input_word_512(x, r0 + r, chunk, k));
        }
      }
      for (int r = 0; r < kRows; ++r) sums[r] = _mm512_add_epi32(sums[r], second[r]);
      add_chunk(j, sums);
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = _mm512_sub_ps(acc[r], min_acc[r]);
}

// The pair kernel of format F.
template <QuantFormat F, int kRows>
void interleaved_pair_of_avx512(const uint8_t* group, int64_t group_bytes, const QuantizedRows& x, int64_t r0,
                                __m512* out) {
  if constexpr (F == QuantFormat::kQ4_K || F == QuantFormat::kQ5_K) {
    interleaved_k_group_pair_avx512<F, kRows>(group, group_bytes, x, r0, out);
  } else {
    interleaved_group_pair_avx512<F, kRows>(group, group_bytes, x, r0, out);
  }
}

// QuantizedLinearFn on the interleaved layout: two groups at a time on 512-bit vectors, a last
// odd group by the 256-bit kernel. One input row takes the 256-bit kernel throughout: there the
// weights come from memory, and one-row decode on the embedded model was 6% slower through the
// pair kernels (docs/benchmarks.md).
template <QuantFormat F>
void quantized_linear_interleaved_avx512(void* out, bool out_is_float32, const QuantizedRows& x, const uint8_t* weight,
                                         int64_t row_bytes, const float* bias, int64_t rows, int64_t out_stride,
                                         int64_t begin, int64_t end) {
  constexpr int kRowTile = 4, kPairRows = 2 * kInterleavedRows;
  const int64_t group_bytes = kInterleavedRows * row_bytes;
  const int64_t pairs_end = rows == 1 ? begin : end;
  int64_t first = begin;
  for (; first + kPairRows <= pairs_end; first += kPairRows) {
    const uint8_t* group = weight + first * row_bytes;
    const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias + first);
    for (int64_t r0 = 0; r0 < rows;) {
      __m512 sums[kRowTile + 1];
      // At least 2 rows reach here and a last 5 takes one tile, so no tile has 1 row.
      const int n = rows - r0 == kRowTile + 1 ? kRowTile + 1 : int(std::min<int64_t>(kRowTile, rows - r0));
      switch (n) {
        case 2: interleaved_pair_of_avx512<F, 2>(group, group_bytes, x, r0, sums); break;
        case 3: interleaved_pair_of_avx512<F, 3>(group, group_bytes, x, r0, sums); break;
        case 4: interleaved_pair_of_avx512<F, 4>(group, group_bytes, x, r0, sums); break;
        default: interleaved_pair_of_avx512<F, 5>(group, group_bytes, x, r0, sums); break;
      }
      for (int r = 0; r < n; ++r) {
        const __m512 y = _mm512_add_ps(sums[r], b);
        const int64_t index = (r0 + r) * out_stride + first;
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
                                                    out_stride, first, end);
  }
}

// Format F's pair kernel, but for Q6_K, which keeps the 256-bit kernel: a pair kernel for it was
// no faster (docs/benchmarks.md).
template <QuantFormat F>
void set_pair_entry(KernelTable& t) {
  if constexpr (F != QuantFormat::kQ6_K) {
    t.quantized_linear_interleaved[interleaved_index(F)] = quantized_linear_interleaved_avx512<F>;
  }
}

template <int... kFormats>
void fill_pair_entries(KernelTable& t, std::integer_sequence<int, kFormats...>) {
  fill_interleaved_entries<Avx512Dot>(t, std::integer_sequence<int, kFormats...>{});
  (set_pair_entry<QuantFormat(kFormats)>(t), ...);
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
    fill_pair_entries(table, std::make_integer_sequence<int, kNumQuantFormats>{});
  }
}

}  // namespace kvflow::cpu

#pragma GCC pop_options

#else  // not x86-64: the AVX-512 tables are never selected

namespace kvflow::cpu {
void fill_avx512_quantized_entries(KernelTable&) {}
}  // namespace kvflow::cpu

#endif
