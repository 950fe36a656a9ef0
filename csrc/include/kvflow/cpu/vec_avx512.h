// Sixteen floats per register with AVX-512 F/BW/VL/DQ. Include only inside a translation unit
// compiled for those features (see isa_avx512.cpp).
#pragma once

#include <immintrin.h>

#include "kvflow/cpu/vec_exp.h"
#include "kvflow/numeric.h"

namespace kvflow::cpu {
namespace {  // private to each instruction-set translation unit (see kernels.h)

struct VecAvx512 {
  static constexpr int kWidth = 16;
  using Reg = __m512;

  static Reg zero() { return _mm512_setzero_ps(); }
  static Reg set1(float x) { return _mm512_set1_ps(x); }

  static Reg load(const float* p) { return _mm512_loadu_ps(p); }
  static Reg load(const bfloat16* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static Reg load(const float16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }

  static void store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static void store(bfloat16* p, Reg v) {
    // Round to nearest even; NaN lanes become a quiet NaN. (Plain AVX-512F integer ops, so
    // CPUs without the BF16 extension take this path too.)
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, is_nan, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
  }
  static void store(float16* p, Reg v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }

  static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg min(Reg a, Reg b) { return _mm512_min_ps(a, b); }
  static Reg max(Reg a, Reg b) { return _mm512_max_ps(a, b); }
  static bool any_nan(Reg a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0; }
  // Bit j set where lane j of a > lane j of b (false for NaN).
  static unsigned greater_mask(Reg a, Reg b) { return unsigned(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ)); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static Reg round(Reg a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // x * 2^n for integral n, in one instruction.
  static Reg ldexp(Reg x, Reg n) { return _mm512_scalef_ps(x, n); }
  // 1/x from the 14-bit estimate and one Newton step (full float precision), cheaper than a divide.
  static Reg reciprocal(Reg x) {
    const Reg r = _mm512_rcp14_ps(x);
    return _mm512_mul_ps(r, _mm512_fnmadd_ps(x, r, _mm512_set1_ps(2.f)));
  }
  static Reg exp(Reg x) { return vec_exp<VecAvx512>(x); }
  static float reduce_max(Reg a) {
    const __m256 m8 = _mm256_max_ps(_mm512_extractf32x8_ps(a, 0), _mm512_extractf32x8_ps(a, 1));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  // lane j of the result = sum of the lanes of sums[j], for j < 16: a transpose-and-add tree
  // (about 3 instructions per input) instead of sixteen separate reductions.
  static Reg transpose_sum(const Reg* sums) {
    __m512 pairs[8];  // per 128-bit lane: partial sums of sums[2i] and sums[2i + 1], interleaved
    for (int i = 0; i < 8; ++i) {
      pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(sums[2 * i], sums[2 * i + 1]),
                               _mm512_unpackhi_ps(sums[2 * i], sums[2 * i + 1]));
    }
    __m512 quads[4];  // per 128-bit lane L: that lane's sums of sums[4i .. 4i + 3]
    for (int i = 0; i < 4; ++i) {
      quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                               _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xee));
    }
    // Add the four 128-bit lanes of quads[i] into 128-bit lane i of the result.
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], 0xee));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44),
                                     _mm512_shuffle_f32x4(quads[2], quads[3], 0xee));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xdd));
  }
  static float reduce_add(Reg a) {
    const __m256 s8 = _mm256_add_ps(_mm512_extractf32x8_ps(a, 0), _mm512_extractf32x8_ps(a, 1));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};

}  // namespace
}  // namespace kvflow::cpu
