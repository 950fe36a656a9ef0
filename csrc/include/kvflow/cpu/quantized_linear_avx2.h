// quantized_linear's chunk dot products in AVX2 integer ops: a chunk's 32 codes, unpacked in
// registers, and the input chunk's int8 values multiply into 16-bit pair sums (vpmaddubsw, whose
// first operand is unsigned: the offset formats' codes as they are, or the centred formats' |w|
// against x carrying w's sign) and 32-bit sums (vpmaddwd), scaled into float accumulators once
// per chunk (per half chunk for Q6_K's 16-weight scales).
// Include only inside a translation unit compiled for AVX2 + FMA + F16C, after kernels.h.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kvflow/cpu/gguf_blocks.h"
#include "kvflow/cpu/vec_avx2.h"

namespace kvflow::cpu {
namespace {

// Thirty-two bits as 32 bytes: byte j is 0x10 where bit j is set (the 5-bit formats' fifth bits).
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int32_t(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// 32 bytes shifted right by n bits within each byte's 16-bit pair (callers mask what they keep).
inline __m256i shift_right(__m256i v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }

// The byte products of the interleaved kernels below, as a policy: in each 32-bit lane, four
// unsigned bytes of u times the four signed bytes of s. A kernel adds products into a partial
// sum (first, then add), widens it into 32-bit lane sums, and adds those. Here vpmaddubsw's
// 16-bit pair sums, widened by vpmaddwd: kernels add only as many products as 16 bits hold.
// vpdpbusd (AVX-512 VNNI, AVX-VNNI) sums into 32-bit lanes at once (isa_avx512_vnni.cpp,
// isa_avx_vnni.cpp).
struct MaddubsDot {
  static constexpr bool kSums32 = false;  // partials are 16-bit
  static constexpr int kVectorRegisters = 16;
  static __m256i first(__m256i u, __m256i s) { return _mm256_maddubs_epi16(u, s); }
  static __m256i add(__m256i partial, __m256i u, __m256i s) {
    return _mm256_add_epi16(partial, _mm256_maddubs_epi16(u, s));
  }
  static __m256i widen(__m256i partial) { return _mm256_madd_epi16(partial, _mm256_set1_epi16(1)); }
};

// The policy of a vpdpbusd form (Instruction::dpbusd(acc, u, s): acc plus each lane's four
// products), whose sums are 32-bit. Instruction::kVectorRegisters: the registers the form's
// instruction set has (AVX-512's 32, AVX-VNNI's 16), which bounds the chains a kernel can keep.
template <class Instruction>
struct DpbusdDot {
  static constexpr bool kSums32 = true;
  static constexpr int kVectorRegisters = Instruction::kVectorRegisters;
  static __m256i first(__m256i u, __m256i s) { return Instruction::dpbusd(_mm256_setzero_si256(), u, s); }
  static __m256i add(__m256i partial, __m256i u, __m256i s) { return Instruction::dpbusd(partial, u, s); }
  static __m256i widen(__m256i partial) { return partial; }
};

template <QuantFormat F>
struct QuantDotAvx2 {
  static constexpr int64_t kBytes = quant_block_bytes(F), kChunks = quant_block_chunks(F);
  // The stream of weight rows, asked for this far ahead (as small_linear streams its rows).
  static constexpr int64_t kAheadBytes = 2048;

  // Chunk c's 32 codes (gguf_blocks.h's chunk_codes), centred for the formats without offsets.
  static __m256i codes(const uint8_t* block, int c) {
    const __m256i low4 = _mm256_set1_epi8(0xF);
    if constexpr (F == QuantFormat::kQ8_0) {
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    } else if constexpr (!is_k_quant(F)) {
      constexpr int kHeader = F == QuantFormat::kQ4_0 ? 2 : F == QuantFormat::kQ4_1 ? 4 : F == QuantFormat::kQ5_0 ? 6 : 8;
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kHeader));
      __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), low4);
      if constexpr (F == QuantFormat::kQ5_0 || F == QuantFormat::kQ5_1) {
        q = _mm256_or_si256(q, fifth_bits(block_word(block + kHeader - 4)));
      }
      if constexpr (F == QuantFormat::kQ4_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
      if constexpr (F == QuantFormat::kQ5_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
      return q;
    } else if constexpr (F == QuantFormat::kQ4_K || F == QuantFormat::kQ5_K) {
      constexpr int kNibbles = F == QuantFormat::kQ5_K ? 48 : 16;
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kNibbles + 32 * (c / 2)));
      __m256i q = _mm256_and_si256(shift_right(bytes, 4 * (c % 2)), low4);
      if constexpr (F == QuantFormat::kQ5_K) {
        const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16));
        q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(shift_right(high, c), _mm256_set1_epi8(1)), 4));
      }
      return q;
    } else {  // Q6_K
      const int h = c / 4, k = c % 4;
      const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h + 32 * (k % 2)));
      const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h));
      const __m256i q = _mm256_or_si256(
          _mm256_and_si256(shift_right(low, 4 * (k / 2)), low4),
          _mm256_slli_epi16(_mm256_and_si256(shift_right(high, 2 * k), _mm256_set1_epi8(3)), 4));
      return _mm256_sub_epi8(q, _mm256_set1_epi8(32));
    }
  }

  // The chunk's eight 32-bit partial sums of codes * x, as float32: lanes 0-3 sum its first 16
  // weights, lanes 4-7 its last 16.
  static __m256 dot(__m256i w, __m256i xq) {
    __m256i pairs;
    if constexpr (has_offset(F)) {
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

  // [d, m] of a 32-weight block (lane 1 unused without offsets); the K-quants' products take a
  // block's eight chunks' scales at once (KScales).
  static __m128 scales(const uint8_t* block) { return _mm_cvtph_ps(_mm_cvtsi32_si128(int32_t(block_word(block)))); }

  // A K-quant block's eight chunks: their scales (Q6_K: of each chunk's first and last 16
  // weights) and offsets, as gguf_blocks.h's chunk_scales defines them, decoded together.
  struct KScales {
    alignas(32) float low[8];
    alignas(32) float high[8];
    alignas(32) float offset[8];
  };

  static void k_scales(const uint8_t* block, KScales* s) {
    if constexpr (F == QuantFormat::kQ6_K) {
      const float d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(int32_t(block_half_bits(block + 208)))));
      // Even scales first, then odd: chunk c's halves are scales 2c and 2c + 1.
      const __m128i sc = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192)),
                                          _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
      const __m256 dv = _mm256_set1_ps(d);
      _mm256_store_ps(s->low, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
      _mm256_store_ps(s->high, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
      _mm256_store_ps(s->offset, _mm256_setzero_ps());
    } else {
      // The 6-bit scales and mins (k_scale_min) four at a time in 32-bit words: chunks 0-3 in
      // the low six bits of words 0 and 1; chunks 4-7 in word 2's nibbles, topped by the high
      // two bits of words 0 and 1.
      const uint32_t w0 = block_word(block + 4), w1 = block_word(block + 8), w2 = block_word(block + 12);
      const uint32_t packed[4] = {w0 & 0x3f3f3f3fu, (w2 & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u),
                                  w1 & 0x3f3f3f3fu, ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u)};
      const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
      const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(int32_t(block_word(block))));
      const __m256 d = _mm256_broadcastss_ps(dd), dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(dd));
      const __m256 low = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)));
      _mm256_store_ps(s->low, low);
      _mm256_store_ps(s->high, low);
      _mm256_store_ps(s->offset, _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), dmin),
                                               _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8)))));
    }
  }

  template <int kRows>
  static void run(const uint8_t* w, const QuantizedRows& x, int64_t r0, float* sums) {
    // Two accumulators a row, even and odd chunks, so that one row is not bound by the latency
    // of the FMA (nor, with offsets, of their adds: lane 1 of `offsets` gathers m * sum(x)).
    __m256 acc[kRows][2];
    __m128 offsets[kRows][2];
    for (int r = 0; r < kRows; ++r) {
      acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      offsets[r][0] = offsets[r][1] = _mm_setzero_ps();
    }
    // Chunk b of the row, its codes q, [scale, offset] dm, and (Q6_K) the scale of its last 16.
    auto chunk = [&](int64_t b, __m256i q, __m128 dm, float high, int chain) {
      for (int r = 0; r < kRows; ++r) {
        const int64_t i = (r0 + r) * x.blocks + b;
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + i * kQuantBlock));
        // [d * scale, m * sum]
        const __m128 products =
            _mm_mul_ps(dm, _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(x.scale_sum + 2 * i))));
        __m256 scale = _mm256_broadcastss_ps(products);
        if constexpr (F == QuantFormat::kQ6_K) {
          scale = _mm256_insertf128_ps(scale, _mm_set1_ps(high * x.scale_sum[2 * i]), 1);
        }
        acc[r][chain] = _mm256_fmadd_ps(scale, dot(q, xq), acc[r][chain]);
        if constexpr (has_offset(F)) offsets[r][chain] = _mm_add_ps(offsets[r][chain], products);
      }
    };
    if constexpr (kChunks == 1) {
      int64_t b = 0;
      for (; b + 2 <= x.blocks; b += 2) {
        const uint8_t* wb = w + b * kBytes;
        __builtin_prefetch(wb + kAheadBytes, 0, 2);
        chunk(b, codes(wb, 0), scales(wb), 0.f, 0);
        chunk(b + 1, codes(wb + kBytes, 0), scales(wb + kBytes), 0.f, 1);
      }
      if (b < x.blocks) chunk(b, codes(w + b * kBytes, 0), scales(w + b * kBytes), 0.f, 0);
    } else {
      KScales s;
      for (int64_t block = 0; block < x.blocks / kChunks; ++block) {
        const uint8_t* wb = w + block * kBytes;
        for (int64_t line = 0; line < kBytes; line += 64) __builtin_prefetch(wb + kAheadBytes + line, 0, 2);
        k_scales(wb, &s);
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) {
          chunk(block * kChunks + c, codes(wb, c), _mm_setr_ps(s.low[c], s.offset[c], 0.f, 0.f), s.high[c], c % 2);
        }
      }
    }
    for (int r = 0; r < kRows; ++r) {
      const __m128 offset = _mm_add_ps(offsets[r][0], offsets[r][1]);
      sums[r] = reduce(_mm256_add_ps(acc[r][0], acc[r][1])) + _mm_cvtss_f32(_mm_shuffle_ps(offset, offset, 1));
    }
  }
};

// 0x10 in byte b of each 32-bit lane where bit first + b of the lane is set, b = 0..3 (first a
// multiple of 4): the fifth bits of the 4 codes a piece holds of each row.
inline __m256i lane_fifth_bits(__m256i bits, int first) {
  const __m256i lane_bytes = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
                                              0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
  const __m256i spread = _mm256_shuffle_epi8(bits, _mm256_add_epi8(lane_bytes, _mm256_set1_epi8(char(first / 8))));
  const __m256i bit = _mm256_set1_epi32(first % 8 == 0 ? 0x08040201 : int32_t(0x80402010u));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// How far ahead of its reads an interleaved kernel asks for its weight stream: far enough for a
// one-row product to keep up with the memory of a fast machine (docs/benchmarks.md).
constexpr int64_t kInterleavedAheadBytes = 6144;

// One group of 8 weight rows in the interleaved layout (gguf_blocks.h) times input rows
// r0 .. r0 + kRows: out[r][j] = row j of the group . input row r0 + r. Per block, each 32-byte
// piece holds 4 codes of each of the 8 rows (row j in 32-bit lane j); a byte product (Dot)
// against the input's matching 4 codes, broadcast to every lane, gives each row's sums. The 8
// rows' scales convert in one vcvtph2ps. With 16-bit partials (MaddubsDot):
// - Q4_0, Q4_1: a piece's low and high nibbles are two sets of 4 codes; the pair sums add in 16
//   bits over the block's 8 half-pieces (at most 8 x 2 x 15 x 127 = 30480, no overflow) and
//   widen once.
// - Q5_0, Q5_1: as Q4 with each code's fifth bit (a 32-bit word per row: lane_fifth_bits) set
//   into its byte; a piece's pair sums (up to 2 x 2 x 31 x 127 = 15748) widen and add in 32 bits.
// - Q8_0: eight pieces of signed codes, so the product takes |w| against x carrying w's sign;
//   its pair sums (up to 2 x 127 x 127) leave no room for a 16-bit sum, so each piece's widen
//   and add in 32 bits.
// With 32-bit partials a block's products all add into one, and Q8_0's codes go in biased to
// unsigned (w + 128, one flip a piece for all rows), the sum starting from -128 times the input
// row's code sum: no sign carried to each row's input. Where Q4_0's and Q4_1's high nibbles have
// a chain of their own (kTwoChains), they stay in place, masked but not shifted: each of their
// products is 16 times the code's, so their sum is too, and an arithmetic shift by 4 of the sum
// takes the factor out exactly, once a block rather than once a piece.
template <QuantFormat F, int kRows, class Dot>
void interleaved_group_avx2(const uint8_t* group, const QuantizedRows& x, int64_t r0, __m256* out) {
  constexpr bool kSigned = F == QuantFormat::kQ8_0;
  constexpr bool kFifthBit = F == QuantFormat::kQ5_0 || F == QuantFormat::kQ5_1;
  constexpr int kPieces = kSigned ? 8 : 4;
  constexpr int kPiecesPerSum = Dot::kSums32 ? kPieces : kSigned || kFifthBit ? 1 : 4;
  // With 32-bit sums and one or two input rows, the 4- and 5-bit formats' low and high nibbles'
  // products add in two chains: in one, a block's 8 dependent vpdpbusd held the few-row kernel
  // back (docs/benchmarks.md).
  constexpr bool kTwoChains = !kSigned && Dot::kSums32 && kRows <= 2;
  constexpr bool kHighInPlace = kTwoChains && !kFifthBit;  // the high nibbles' sums carry a factor 16
  constexpr int64_t kBytes = quant_block_bytes(F), kHeader = interleaved_header_bytes(F);
  constexpr int64_t kFifthBits = kInterleavedRows * (kHeader - 4);  // the 8 rows' fifth bits: the header's last field
  constexpr int64_t kGroupBlock = kInterleavedRows * kBytes, kFirstPiece = kInterleavedRows * kHeader;
  constexpr int64_t kAheadBytes = (kSigned ? 2 : 1) * kInterleavedAheadBytes;  // about as many blocks ahead either way
  const __m256i low4 = _mm256_set1_epi8(0xF), high4 = _mm256_set1_epi8(char(0xF0));
  __m256 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    const uint8_t* block = group + b * kGroupBlock;
    for (int64_t line = 0; line < kGroupBlock; line += 64) __builtin_prefetch(block + kAheadBytes + line, 0, 2);
    auto input_word = [&](int r, int byte) {  // 4 input codes of row r0 + r, from byte `byte` of its chunk b
      const auto* xq = reinterpret_cast<const uint8_t*>(x.q + ((r0 + r) * x.blocks + b) * kQuantBlock);
      return _mm256_set1_epi32(int32_t(block_word(xq + byte)));
    };
    __m256i partial[kRows], sums[kRows];  // a partial's sums widen into 32-bit sums every kPiecesPerSum pieces
    __m256i partial_high[kRows];          // with kTwoChains, the high nibbles' own sums
    auto widen_at = [&](int r, int k) {
      if (k % kPiecesPerSum != kPiecesPerSum - 1) return;
      const __m256i widened = Dot::widen(partial[r]);
      sums[r] = k < kPiecesPerSum ? widened : _mm256_add_epi32(sums[r], widened);
    };
    // The piece loops are unrolled by pragma: left to itself, GCC kept Q4_1's rolled under vpdpbusd,
    // its partials moving between registers at every piece (docs/benchmarks.md).
    if constexpr (kSigned && Dot::kSums32) {
      const __m256i flip = _mm256_set1_epi8(char(0x80));
#pragma GCC unroll 8
      for (int k = 0; k < kPieces; ++k) {
        const __m256i biased =
            _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kFirstPiece + 32 * k)), flip);
#pragma GCC unroll 5
        for (int r = 0; r < kRows; ++r) {
          const __m256i so_far = k == 0 ? _mm256_set1_epi32(-128 * x.code_sum[(r0 + r) * x.blocks + b]) : sums[r];
          sums[r] = Dot::add(so_far, biased, input_word(r, 4 * k));
        }
      }
    } else if constexpr (kSigned) {
#pragma GCC unroll 8
      for (int k = 0; k < kPieces; ++k) {
        const __m256i piece = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kFirstPiece + 32 * k));
        const __m256i magnitude = _mm256_sign_epi8(piece, piece);
#pragma GCC unroll 5
        for (int r = 0; r < kRows; ++r) {
          const __m256i signed_x = _mm256_sign_epi8(input_word(r, 4 * k), piece);
          partial[r] = k % kPiecesPerSum == 0 ? Dot::first(magnitude, signed_x) : Dot::add(partial[r], magnitude, signed_x);
          widen_at(r, k);
        }
      }
    } else {
      const __m256i fifth = kFifthBit ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kFifthBits))
                                      : _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int k = 0; k < kPieces; ++k) {
        const __m256i piece = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kFirstPiece + 32 * k));
        __m256i low = _mm256_and_si256(piece, low4);
        __m256i high = kHighInPlace ? _mm256_and_si256(piece, high4) : _mm256_and_si256(_mm256_srli_epi16(piece, 4), low4);
        if constexpr (kFifthBit) {
          low = _mm256_or_si256(low, lane_fifth_bits(fifth, 4 * k));
          high = _mm256_or_si256(high, lane_fifth_bits(fifth, 16 + 4 * k));
        }
#pragma GCC unroll 5
        for (int r = 0; r < kRows; ++r) {
          const __m256i x_low = input_word(r, 4 * k), x_high = input_word(r, 16 + 4 * k);
          if constexpr (kTwoChains) {
            partial[r] = k == 0 ? Dot::first(low, x_low) : Dot::add(partial[r], low, x_low);
            partial_high[r] = k == 0 ? Dot::first(high, x_high) : Dot::add(partial_high[r], high, x_high);
            continue;
          }
          partial[r] = k % kPiecesPerSum == 0 ? Dot::first(low, x_low) : Dot::add(partial[r], low, x_low);
          partial[r] = Dot::add(partial[r], high, x_high);
          widen_at(r, k);
        }
      }
      if constexpr (kTwoChains) {
        for (int r = 0; r < kRows; ++r) {
          sums[r] = _mm256_add_epi32(partial[r], kHighInPlace ? _mm256_srai_epi32(partial_high[r], 4) : partial_high[r]);
        }
      }
      // Q4_0 and Q5_0 take their codes' centre off in integers; Q4_1 and Q5_1 add an offset in float.
      if constexpr (!has_offset(F)) {
        for (int r = 0; r < kRows; ++r) {
          sums[r] = _mm256_add_epi32(sums[r], _mm256_set1_epi32(-code_centre(F) * x.code_sum[(r0 + r) * x.blocks + b]));
        }
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    // Q4_1, Q5_1: w = d q + m, the offset times the input's d * sum(q).
    const __m256 m = has_offset(F) ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16)))
                                   : _mm256_setzero_ps();
    for (int r = 0; r < kRows; ++r) {
      const float* scale_sum = x.scale_sum + 2 * ((r0 + r) * x.blocks + b);
      const __m256 dot = _mm256_cvtepi32_ps(sums[r]);
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(scale_sum[0])), acc[r]);
      if constexpr (has_offset(F)) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(scale_sum[1]), acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = acc[r];
}

// One group of 8 Q4_K or Q5_K weight rows in the interleaved layout (gguf_blocks.h) times input
// rows r0 .. r0 + kRows, as interleaved_group_avx2 does for the 32-weight formats. Per 256-weight
// block: the 8 rows' d and dmin, then scale byte t of the 8 rows at 32 + 8t, then (Q5_K) 8
// pieces of the fifth bits, piece k holding qh bytes 4k..4k+3 of each row (bit c of a byte: chunk
// c's), then 32 pieces of nibbles, of which 8g .. 8g + 7 hold chunk 2g's codes in their low
// nibbles and chunk 2g + 1's in their high ones. The 8 chunks' scales and mins of the 8 rows
// (k_scale_min, one row a 32-bit lane) are decoded once per block for every input row. With
// 16-bit partials a chunk's pair sums add over its 8 pieces (Q4_K: at most 8 x 2 x 15 x 127 =
// 30480), or over 4 (Q5_K: 4 x 2 x 31 x 127 = 31496), before they widen. With 32-bit sums and one
// or two input rows, the chunks go in pairs: a pair's pieces hold the first chunk's codes in their
// low nibbles and the second's in their high ones, so each piece is read once and feeds four
// chains a row (the two chunks' even and odd pieces) side by side; the float steps then run
// chunk by chunk as elsewhere (one row of Q4_K 7% faster, two rows 13%: docs/benchmarks.md).
// The mins' terms add up apart from the scaled sums and come off once at the end, so that each
// chunk puts one multiply-add, not two, on the accumulator's chain (one row of Q5_K 5% faster).
template <QuantFormat F, int kRows, class Dot>
void interleaved_k_group_avx2(const uint8_t* group, const QuantizedRows& x, int64_t r0, __m256* out) {
  static_assert(F == QuantFormat::kQ4_K || F == QuantFormat::kQ5_K);
  constexpr bool kFifthBit = F == QuantFormat::kQ5_K;
  constexpr int kPiecesPerSum = kFifthBit && !Dot::kSums32 ? 4 : 8;
  constexpr bool kChunkPairs = Dot::kSums32 && kRows <= 2;
  constexpr int64_t kGroupBlock = kInterleavedRows * quant_block_bytes(F);
  constexpr int64_t kScaleBytes = 32, kFifthBits = 128, kPieces = kInterleavedRows * interleaved_header_bytes(F);
  constexpr int64_t kAheadBytes = kInterleavedAheadBytes;
  const __m256i low4 = _mm256_set1_epi8(0xF), low6 = _mm256_set1_epi32(63);
  __m256 acc[kRows], min_acc[kRows];  // the scaled sums, and the mins apart: two chains
  for (int r = 0; r < kRows; ++r) acc[r] = min_acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.blocks / 8; ++b) {
    const uint8_t* block = group + b * kGroupBlock;
    for (int64_t line = 0; line < kGroupBlock; line += 64) __builtin_prefetch(block + kAheadBytes + line, 0, 2);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16)));
    __m256i bytes[12];  // scale byte t of the 8 rows
    for (int t = 0; t < 12; ++t) {
      bytes[t] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + kScaleBytes + 8 * t)));
    }
    alignas(32) float scale[8][kInterleavedRows], min[8][kInterleavedRows];
    for (int j = 0; j < 8; ++j) {
      __m256i sc, m;
      if (j < 4) {
        sc = _mm256_and_si256(bytes[j], low6);
        m = _mm256_and_si256(bytes[j + 4], low6);
      } else {
        sc = _mm256_or_si256(_mm256_and_si256(bytes[j + 4], _mm256_set1_epi32(0xF)),
                             _mm256_slli_epi32(_mm256_srli_epi32(bytes[j - 4], 6), 4));
        m = _mm256_or_si256(_mm256_srli_epi32(bytes[j + 4], 4), _mm256_slli_epi32(_mm256_srli_epi32(bytes[j], 6), 4));
      }
      _mm256_store_ps(scale[j], _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
      _mm256_store_ps(min[j], _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m)));
    }
    // w = d sc q - dmin m: the codes' sum times the input's d, less the min times d * sum(q).
    auto add_chunk = [&](int j, const __m256i* sums) {
      for (int r = 0; r < kRows; ++r) {
        const float* scale_sum = x.scale_sum + 2 * ((r0 + r) * x.blocks + 8 * b + j);
        const __m256 dot = _mm256_cvtepi32_ps(sums[r]);
        acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(_mm256_load_ps(scale[j]), _mm256_set1_ps(scale_sum[0])), acc[r]);
        min_acc[r] = _mm256_fmadd_ps(_mm256_load_ps(min[j]), _mm256_set1_ps(scale_sum[1]), min_acc[r]);
      }
    };
    if constexpr (kChunkPairs) {
      // A pair of chunks at once, each piece's low nibbles for the first and high ones for the
      // second: four chains a row side by side, which the core overlaps better than the two of
      // one chunk after another.
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const uint8_t* pieces = block + kPieces + 32 * 8 * g;
        __m256i low_even[kRows], low_odd[kRows], high_even[kRows], high_odd[kRows];
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          const __m256i piece = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pieces + 32 * k));
          __m256i low = _mm256_and_si256(piece, low4), high = _mm256_and_si256(_mm256_srli_epi16(piece, 4), low4);
          if constexpr (kFifthBit) {
            const __m256i fifth = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kFifthBits + 32 * k));
            const __m256i one = _mm256_set1_epi8(1);
            low = _mm256_or_si256(low, _mm256_slli_epi16(_mm256_and_si256(shift_right(fifth, 2 * g), one), 4));
            high = _mm256_or_si256(high, _mm256_slli_epi16(_mm256_and_si256(shift_right(fifth, 2 * g + 1), one), 4));
          }
          for (int r = 0; r < kRows; ++r) {
            const auto* xq = reinterpret_cast<const uint8_t*>(x.q + ((r0 + r) * x.blocks + 8 * b + 2 * g) * kQuantBlock);
            const __m256i input_low = _mm256_set1_epi32(int32_t(block_word(xq + 4 * k)));
            const __m256i input_high = _mm256_set1_epi32(int32_t(block_word(xq + kQuantBlock + 4 * k)));
            __m256i& chain_low = k % 2 == 0 ? low_even[r] : low_odd[r];
            __m256i& chain_high = k % 2 == 0 ? high_even[r] : high_odd[r];
            chain_low = k < 2 ? Dot::first(low, input_low) : Dot::add(chain_low, low, input_low);
            chain_high = k < 2 ? Dot::first(high, input_high) : Dot::add(chain_high, high, input_high);
          }
        }
        __m256i sums[kRows];
        for (int r = 0; r < kRows; ++r) sums[r] = _mm256_add_epi32(low_even[r], low_odd[r]);
        add_chunk(2 * g, sums);
        for (int r = 0; r < kRows; ++r) sums[r] = _mm256_add_epi32(high_even[r], high_odd[r]);
        add_chunk(2 * g + 1, sums);
      }
      continue;
    }
    for (int j = 0; j < 8; ++j) {
      const int64_t chunk = 8 * b + j;
      const uint8_t* pieces = block + kPieces + 32 * 8 * (j / 2);
      __m256i sums[kRows];     // 32-bit sums of the chunk
      __m256i partial[kRows];  // sums of up to kPiecesPerSum pieces
      for (int k = 0; k < 8; ++k) {
        const __m256i piece = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pieces + 32 * k));
        __m256i codes = _mm256_and_si256(j % 2 == 0 ? piece : _mm256_srli_epi16(piece, 4), low4);
        if constexpr (kFifthBit) {
          const __m256i fifth = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kFifthBits + 32 * k));
          codes = _mm256_or_si256(codes, _mm256_slli_epi16(_mm256_and_si256(shift_right(fifth, j), _mm256_set1_epi8(1)), 4));
        }
        for (int r = 0; r < kRows; ++r) {
          const auto* xq = reinterpret_cast<const uint8_t*>(x.q + ((r0 + r) * x.blocks + chunk) * kQuantBlock);
          const __m256i input = _mm256_set1_epi32(int32_t(block_word(xq + 4 * k)));
          partial[r] = k % kPiecesPerSum == 0 ? Dot::first(codes, input) : Dot::add(partial[r], codes, input);
          if (k % kPiecesPerSum == kPiecesPerSum - 1) {
            const __m256i widened = Dot::widen(partial[r]);
            sums[r] = k < kPiecesPerSum ? widened : _mm256_add_epi32(sums[r], widened);
          }
        }
      }
      add_chunk(j, sums);
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = _mm256_sub_ps(acc[r], min_acc[r]);
}

// Input row r's sums of the codes in each half of a chunk (16 signed bytes each): from the sums
// made once with the input's quantization where it has them, else biased by 128 to unsigned and
// summed by vpsadbw in four eighths.
inline void input_half_sums(const QuantizedRows& x, int64_t row, int64_t chunk, int32_t& first, int32_t& second) {
  if (x.first_half_sum != nullptr) {
    first = x.first_half_sum[row * x.blocks + chunk];
    second = x.code_sum[row * x.blocks + chunk] - first;
    return;
  }
  const auto* codes = reinterpret_cast<const __m256i*>(x.q + (row * x.blocks + chunk) * kQuantBlock);
  const __m256i eighths = _mm256_sad_epu8(_mm256_xor_si256(_mm256_loadu_si256(codes), _mm256_set1_epi8(char(0x80))),
                                          _mm256_setzero_si256());
  const __m128i low = _mm256_castsi256_si128(eighths), high = _mm256_extracti128_si256(eighths, 1);
  first = int32_t(_mm_cvtsi128_si32(low) + _mm_extract_epi32(low, 2)) - 16 * 128;
  second = int32_t(_mm_cvtsi128_si32(high) + _mm_extract_epi32(high, 2)) - 16 * 128;
}

// Half `half` of a Q6_K chunk with 32-bit sums of unsigned codes, added to each row's
// accumulator: the sum less 32 times the input's code sum over that half (half_sums), times
// the half's scale (row_scale, the 8 rows') and the input's.
template <int kRows>
inline void q6_k_add_half(const QuantizedRows& x, int64_t r0, int64_t chunk, int half, const float* row_scale,
                          const __m256i* sums, const int32_t (*half_sums)[2], __m256* acc) {
  const __m256 scale = _mm256_load_ps(row_scale);
  for (int r = 0; r < kRows; ++r) {
    const float x_scale = x.scale_sum[2 * ((r0 + r) * x.blocks + chunk)];
    const __m256i centred = _mm256_sub_epi32(sums[r], _mm256_set1_epi32(32 * half_sums[r][half]));
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), _mm256_mul_ps(scale, _mm256_set1_ps(x_scale)), acc[r]);
  }
}

// Chunk c of a Q6_K block of 8 interleaved rows (the layout: interleaved_q6_k_group_avx2) with 32-bit
// sums (vpdpbusd): the codes go in unsigned, 0..63, and each half's sum takes 32 times the
// input's code sum back out, two instructions a piece fewer than carrying w's sign to the input.
// Exact integer sums: the float steps, and so the results, are those of the other form.
template <int kRows, class Dot>
inline void q6_k_chunk_sums32(const uint8_t* pieces, const QuantizedRows& x, int64_t r0, int64_t chunk, int c,
                              const float (*scale)[kInterleavedRows], __m256* acc) {
  const int h = c / 4, k = c % 4;
  const __m256i low4 = _mm256_set1_epi8(0xF), bits45 = _mm256_set1_epi8(0x30);
  int32_t half_sums[kRows][2];
  for (int r = 0; r < kRows; ++r) input_half_sums(x, r0 + r, chunk, half_sums[r][0], half_sums[r][1]);
  for (int half = 0; half < 2; ++half) {
    __m256i sums[kRows];
#pragma GCC unroll 4
    for (int p = 4 * half; p < 4 * half + 4; ++p) {
      const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pieces + 32 * (16 * h + 8 * (k % 2) + p)));
      const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pieces + 32 * (32 + 8 * h + p)));
      // Bits 2k..2k + 1 of each high byte moved to bits 4..5 (16-bit shifts by at most 4 bring
      // no bits of the neighbouring byte into those two).
      const __m256i top = k == 0 ? _mm256_slli_epi16(high, 4)
                          : k == 1 ? _mm256_slli_epi16(high, 2)
                          : k == 2 ? high
                                   : _mm256_srli_epi16(high, 2);
      const __m256i codes = _mm256_or_si256(_mm256_and_si256(k < 2 ? low : _mm256_srli_epi16(low, 4), low4),
                                            _mm256_and_si256(top, bits45));
      for (int r = 0; r < kRows; ++r) {
        const auto* xq = reinterpret_cast<const uint8_t*>(x.q + ((r0 + r) * x.blocks + chunk) * kQuantBlock);
        const __m256i input = _mm256_set1_epi32(int32_t(block_word(xq + 4 * p)));
        sums[r] = p == 4 * half ? Dot::first(codes, input) : Dot::add(sums[r], codes, input);
      }
    }
    q6_k_add_half<kRows>(x, r0, chunk, half, scale[2 * c + half], sums, half_sums, acc);
  }
}

// Half h of a Q6_K block (chunks 4h .. 4h + 3) with 32-bit sums, at one or two rows, or at up
// to five with 32 vector registers: chunks 4h + k and 4h + k + 2 read the same low pieces (low
// and high nibbles) and all four the same high pieces, so a pair of chunks goes at once, four
// chains a row (two chunks, two halves) side by side, each piece read once; the float steps
// then run in q6_k_chunk_sums32's order.
template <int kRows, class Dot>
inline void q6_k_half_block_sums32(const uint8_t* pieces, const QuantizedRows& x, int64_t r0, int64_t first_chunk,
                                   int h, const float (*scale)[kInterleavedRows], __m256* acc) {
  const __m256i low4 = _mm256_set1_epi8(0xF), bits45 = _mm256_set1_epi8(0x30);
  __m256i sums[4][2][kRows];  // [chunk of the half block][half of the chunk][row]
#pragma GCC unroll 2
  for (int k = 0; k < 2; ++k) {  // chunks k and k + 2 of the half block
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        const int p = 4 * half + q;
        const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pieces + 32 * (16 * h + 8 * k + p)));
        const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pieces + 32 * (32 + 8 * h + p)));
        // Bits 2j..2j + 1 of each high byte to bits 4..5 for chunk j (see q6_k_chunk_sums32).
        const __m256i top_first = k == 0 ? _mm256_slli_epi16(high, 4) : _mm256_slli_epi16(high, 2);
        const __m256i top_second = k == 0 ? high : _mm256_srli_epi16(high, 2);
        const __m256i first = _mm256_or_si256(_mm256_and_si256(low, low4), _mm256_and_si256(top_first, bits45));
        const __m256i second =
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low, 4), low4), _mm256_and_si256(top_second, bits45));
        for (int r = 0; r < kRows; ++r) {
          const auto* xq = reinterpret_cast<const uint8_t*>(x.q + ((r0 + r) * x.blocks + first_chunk + k) * kQuantBlock);
          const __m256i input_first = _mm256_set1_epi32(int32_t(block_word(xq + 4 * p)));
          const __m256i input_second = _mm256_set1_epi32(int32_t(block_word(xq + 2 * kQuantBlock + 4 * p)));
          __m256i& chain_first = sums[k][half][r];
          __m256i& chain_second = sums[k + 2][half][r];
          chain_first = q == 0 ? Dot::first(first, input_first) : Dot::add(chain_first, first, input_first);
          chain_second = q == 0 ? Dot::first(second, input_second) : Dot::add(chain_second, second, input_second);
        }
      }
    }
  }
  for (int j = 0; j < 4; ++j) {
    const int64_t chunk = first_chunk + j;
    int32_t half_sums[kRows][2];
    for (int r = 0; r < kRows; ++r) input_half_sums(x, r0 + r, chunk, half_sums[r][0], half_sums[r][1]);
    for (int half = 0; half < 2; ++half) {
      q6_k_add_half<kRows>(x, r0, chunk, half, scale[2 * (4 * h + j) + half], sums[j][half], half_sums, acc);
    }
  }
}

// One group of 8 Q6_K weight rows in the interleaved layout (gguf_blocks.h) times input rows
// r0 .. r0 + kRows. Per 256-weight block: scale t of the 8 rows at 8t (int8), their d at 128,
// then 48 pieces: 32 of the low four bits (GGUF's ql), 16 of the high two (qh). Chunk c = 4h + k
// (h the block's half) takes piece 16h + 8(k % 2) + p's nibble k / 2 and piece 32 + 8h + p's bits
// 2k..2k+1 for its codes 4p..4p+3, centred by 32; its first and last 16 weights have scales 2c
// and 2c + 1. With 16-bit partials (vpmaddubsw) the byte product takes |w| against x carrying
// w's sign, and a half chunk's 4 pieces add into one partial (at most 4 x 2 x 32 x 127 = 32512)
// before it widens; with 32-bit sums, q6_k_chunk_sums32 and q6_k_half_block_sums32 above.
template <int kRows, class Dot>
void interleaved_q6_k_group_avx2(const uint8_t* group, const QuantizedRows& x, int64_t r0, __m256* out) {
  constexpr int64_t kGroupBlock = kInterleavedRows * quant_block_bytes(QuantFormat::kQ6_K);
  constexpr int64_t kD = 16 * kInterleavedRows, kPieces = kInterleavedRows * interleaved_header_bytes(QuantFormat::kQ6_K);
  constexpr int64_t kAheadBytes = kInterleavedAheadBytes;
  const __m256i low4 = _mm256_set1_epi8(0xF), low2 = _mm256_set1_epi8(3);
  __m256 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.blocks / 8; ++b) {
    const uint8_t* block = group + b * kGroupBlock;
    for (int64_t line = 0; line < kGroupBlock; line += 64) __builtin_prefetch(block + kAheadBytes + line, 0, 2);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kD)));
    alignas(32) float scale[16][kInterleavedRows];
    for (int t = 0; t < 16; ++t) {
      const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 8 * t)));
      _mm256_store_ps(scale[t], _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
    }
    const uint8_t* pieces = block + kPieces;
    if constexpr (Dot::kSums32 && (kRows <= 2 || Dot::kVectorRegisters >= 32)) {
      for (int h = 0; h < 2; ++h) q6_k_half_block_sums32<kRows, Dot>(pieces, x, r0, 8 * b + 4 * h, h, scale, acc);
      continue;
    }
    if constexpr (Dot::kSums32) {
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) q6_k_chunk_sums32<kRows, Dot>(pieces, x, r0, 8 * b + c, c, scale, acc);
      continue;
    }
    for (int c = 0; c < 8; ++c) {
      const int h = c / 4, k = c % 4;
      const int64_t chunk = 8 * b + c;
      for (int half = 0; half < 2; ++half) {
        __m256i sums[kRows];
        for (int p = 4 * half; p < 4 * half + 4; ++p) {
          const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pieces + 32 * (16 * h + 8 * (k % 2) + p)));
          const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pieces + 32 * (32 + 8 * h + p)));
          const __m256i codes = _mm256_or_si256(_mm256_and_si256(shift_right(low, 4 * (k / 2)), low4),
                                                _mm256_slli_epi16(_mm256_and_si256(shift_right(high, 2 * k), low2), 4));
          const __m256i w = _mm256_sub_epi8(codes, _mm256_set1_epi8(32));
          const __m256i magnitude = _mm256_sign_epi8(w, w);
          for (int r = 0; r < kRows; ++r) {
            const auto* xq = reinterpret_cast<const uint8_t*>(x.q + ((r0 + r) * x.blocks + chunk) * kQuantBlock);
            const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(int32_t(block_word(xq + 4 * p))), w);
            sums[r] = p == 4 * half ? Dot::first(magnitude, signed_x) : Dot::add(sums[r], magnitude, signed_x);
          }
        }
        const __m256 row_scale = _mm256_load_ps(scale[2 * c + half]);
        for (int r = 0; r < kRows; ++r) {
          const float x_scale = x.scale_sum[2 * ((r0 + r) * x.blocks + chunk)];
          const __m256 dot = _mm256_cvtepi32_ps(Dot::widen(sums[r]));
          acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(row_scale, _mm256_set1_ps(x_scale)), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = acc[r];
}

// The group kernel of format F.
template <QuantFormat F, int kRows, class Dot>
void interleaved_group_of_avx2(const uint8_t* group, const QuantizedRows& x, int64_t r0, __m256* out) {
  if constexpr (F == QuantFormat::kQ4_K || F == QuantFormat::kQ5_K) {
    interleaved_k_group_avx2<F, kRows, Dot>(group, x, r0, out);
  } else if constexpr (F == QuantFormat::kQ6_K) {
    interleaved_q6_k_group_avx2<kRows, Dot>(group, x, r0, out);
  } else {
    interleaved_group_avx2<F, kRows, Dot>(group, x, r0, out);
  }
}

// QuantizedLinearFn on the interleaved layout, with the byte products of Dot; begin and end are
// multiples of kInterleavedRows.
template <QuantFormat F, class Dot>
void quantized_linear_interleaved_avx2(void* out, bool out_is_float32, const QuantizedRows& x, const uint8_t* weight,
                                       int64_t row_bytes, const float* bias, int64_t rows, int64_t out_stride,
                                       int64_t begin, int64_t end) {
  constexpr int kRowTile = 4;
  for (int64_t first = begin; first < end; first += kInterleavedRows) {
    const uint8_t* group = weight + first * row_bytes;
    const __m256 b = bias == nullptr ? _mm256_setzero_ps() : _mm256_loadu_ps(bias + first);
    for (int64_t r0 = 0; r0 < rows;) {
      __m256 sums[kRowTile + 1];
      const int n = rows - r0 == kRowTile + 1 ? kRowTile + 1 : int(std::min<int64_t>(kRowTile, rows - r0));
      switch (n) {
        case 1: interleaved_group_of_avx2<F, 1, Dot>(group, x, r0, sums); break;
        case 2: interleaved_group_of_avx2<F, 2, Dot>(group, x, r0, sums); break;
        case 3: interleaved_group_of_avx2<F, 3, Dot>(group, x, r0, sums); break;
        case 4: interleaved_group_of_avx2<F, 4, Dot>(group, x, r0, sums); break;
        default: interleaved_group_of_avx2<F, 5, Dot>(group, x, r0, sums); break;
      }
      for (int r = 0; r < n; ++r) {
        const __m256 y = _mm256_add_ps(sums[r], b);
        const int64_t index = (r0 + r) * out_stride + first;
        if (out_is_float32) {
          _mm256_storeu_ps(static_cast<float*>(out) + index, y);
        } else {
          VecAvx2::store(static_cast<bfloat16*>(out) + index, y);
        }
      }
      r0 += n;
    }
  }
}

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

// DequantizePanelFn (kernel_table.h) in AVX2: eight rows of a chunk at a time, each row's 32
// values dequantized in registers, rounded to bfloat16 and paired (values k and k + 1 in one
// 32-bit word), then the 8 rows x 16 pairs transposed so that each pair of the 8 rows is one
// 32-byte store. A K-quant block's scales are decoded once per row, at its first chunk.
template <QuantFormat F>
void dequantize_panel_avx2(const uint8_t* weight, int64_t row_bytes, int64_t out_features, int64_t panel,
                           bfloat16* dst) {
  using Dot = QuantDotAvx2<F>;
  constexpr int64_t kPanel = kPackedLinearPanel;
  const int64_t chunks = row_bytes / Dot::kBytes * Dot::kChunks;
  const int64_t first = panel * kPanel, width = std::min<int64_t>(kPanel, out_features - first);
  auto* pairs = reinterpret_cast<uint32_t*>(dst);  // pairs[k / 2][j]: values k and k + 1 of row j
  const __m256i round_bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
  // Eight floats to bfloat16 bits (round to nearest even) in the low half of each 32-bit lane.
  auto bfloat16_bits = [&](__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(round_bias, odd)), 16);
  };
  typename Dot::KScales row_scales[is_k_quant(F) ? kPanel : 1];  // K-quants: each row's current block
  for (int64_t b = 0; b < chunks; ++b) {
    uint32_t* block_pairs = pairs + b * (kQuantBlock / 2) * kPanel;
    const int c = int(b % Dot::kChunks);
    if constexpr (is_k_quant(F)) {
      if (c == 0) {
        for (int64_t j = 0; j < width; ++j) {
          Dot::k_scales(weight + (first + j) * row_bytes + b / Dot::kChunks * Dot::kBytes, &row_scales[j]);
        }
      }
    }
    for (int64_t j0 = 0; j0 < kPanel; j0 += 8) {
      __m256i low[8], high[8];  // per row: pairs 0-7, pairs 8-15
      for (int r = 0; r < 8; ++r) {
        if (j0 + r >= width) {
          low[r] = high[r] = _mm256_setzero_si256();
          continue;
        }
        const uint8_t* block = weight + (first + j0 + r) * row_bytes + b / Dot::kChunks * Dot::kBytes;
        const __m256i q = Dot::codes(block, c);
        float scale_high = 0.f;
        __m128 dm;
        if constexpr (is_k_quant(F)) {
          const typename Dot::KScales& s = row_scales[j0 + r];
          dm = _mm_setr_ps(s.low[c], s.offset[c], 0.f, 0.f);
          scale_high = s.high[c];
        } else {
          dm = Dot::scales(block);
        }
        const __m256 d_low = _mm256_set1_ps(_mm_cvtss_f32(dm));
        const __m256 d_high = F == QuantFormat::kQ6_K ? _mm256_set1_ps(scale_high) : d_low;
        const __m256 m = has_offset(F) ? _mm256_set1_ps(_mm_cvtss_f32(_mm_shuffle_ps(dm, dm, 1))) : _mm256_setzero_ps();
        const __m128i q_low = _mm256_castsi256_si128(q), q_high = _mm256_extracti128_si256(q, 1);
        const __m128i eights[4] = {q_low, _mm_srli_si128(q_low, 8), q_high, _mm_srli_si128(q_high, 8)};
        __m256i bits[4];
        for (int e = 0; e < 4; ++e) {
          const __m256 values = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eights[e]));
          bits[e] = bfloat16_bits(_mm256_fmadd_ps(values, e < 2 ? d_low : d_high, m));
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

// QuantizeActivationsFn (kernel_table.h) in AVX2: the same float32 operations as
// quantize_activation_block (127 x, divided by max|x|, rounded to nearest even), eight at a time.
template <typename T>
void quantize_activations_avx2(const void* x, int64_t chunks, int8_t* q, float* scale_sum, int32_t* code_sum) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), c127 = _mm256_set1_ps(127.f);
  for (int64_t c = 0; c < chunks; ++c) {
    __m256 v[4];
    for (int k = 0; k < 4; ++k) {
      if constexpr (std::is_same_v<T, float>) {
        v[k] = _mm256_loadu_ps(static_cast<const float*>(x) + c * kQuantBlock + 8 * k);
      } else {
        const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const bfloat16*>(x) +
                                                                              c * kQuantBlock + 8 * k));
        v[k] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
      }
    }
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                             _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    int8_t* codes = q + c * kQuantBlock;
    if (!(amax > 0.f)) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), _mm256_setzero_si256());
      scale_sum[2 * c] = amax / 127.f;
      scale_sum[2 * c + 1] = 0.f;
      code_sum[c] = 0;
      continue;
    }
    const __m256 divisor = _mm256_set1_ps(amax);
    __m256i ints[4];
    for (int k = 0; k < 4; ++k) {
      const __m256 scaled = _mm256_div_ps(_mm256_mul_ps(v[k], c127), divisor);
      ints[k] = _mm256_cvtps_epi32(_mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    // packs works within 128-bit lanes: the bytes come out in the order of 32-bit groups
    // 0, 2, 4, 6, 1, 3, 5, 7, which one permute puts back.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]), _mm256_packs_epi32(ints[2], ints[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(ints[0], ints[1]), _mm256_add_epi32(ints[2], ints[3]));
    __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4E));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xB1));
    const float d = amax / 127.f;
    scale_sum[2 * c] = d;
    code_sum[c] = _mm_cvtsi128_si32(sum4);
    scale_sum[2 * c + 1] = d * float(code_sum[c]);
  }
}

// The interleaved products of every format (all of them interleave), with the byte products of Dot.
template <class Dot, int... kFormats>
void fill_interleaved_entries(KernelTable& t, std::integer_sequence<int, kFormats...>) {
  static_assert(sizeof...(kFormats) == kNumInterleavedFormats);
  ((t.quantized_linear_interleaved[interleaved_index(QuantFormat(kFormats))] =
        quantized_linear_interleaved_avx2<QuantFormat(kFormats), Dot>),
   ...);
}

// The AVX2 entries of every format.
template <int... kFormats>
void fill_quantized_entries_avx2(KernelTable& t, std::integer_sequence<int, kFormats...>) {
  t.quantize_activations[0] = quantize_activations_avx2<float>;
  t.quantize_activations[1] = quantize_activations_avx2<bfloat16>;
  ((t.quantized_linear[kFormats] = quantized_linear_rows<QuantDotAvx2<QuantFormat(kFormats)>>), ...);
  ((t.dequantize_panel[kFormats] = dequantize_panel_avx2<QuantFormat(kFormats)>), ...);
  fill_interleaved_entries<MaddubsDot>(t, std::integer_sequence<int, kFormats...>{});
}

}  // namespace
}  // namespace kvflow::cpu
