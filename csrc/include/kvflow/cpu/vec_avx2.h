// Eight floats per register with AVX2 + FMA + F16C. Include only inside a translation unit
// compiled for those features (see isa_avx2.cpp).
#pragma once

#include <immintrin.h>

#include "kvflow/cpu/vec_exp.h"
#include "kvflow/numeric.h"

namespace kvflow::cpu {
namespace {  // private to each instruction-set translation unit (see kernels.h)

struct VecAvx2 {
  static constexpr int kWidth = 8;
  using Reg = __m256;

  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg set1(float x) { return _mm256_set1_ps(x); }

  static Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static Reg load(const bfloat16* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static Reg load(const float16* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // 8 features of the pair layout [feature][2] (16 bfloat16 values): the even input feature is
  // the low half of each 32-bit lane, the odd one the high half.
  static void load_pair_halves(const bfloat16* p, Reg& even, Reg& odd) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(int32_t(0xffff0000u))));
  }

  static void store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static void store(bfloat16* p, Reg v) {
    // Round to nearest even; NaN lanes become a quiet NaN.
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), is_nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0xd8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static void store(float16* p, Reg v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }

  static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg min(Reg a, Reg b) { return _mm256_min_ps(a, b); }
  static Reg max(Reg a, Reg b) { return _mm256_max_ps(a, b); }
  static bool any_nan(Reg a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)) != 0; }
  // Bit j set where lane j of a > lane j of b (false for NaN).
  static unsigned greater_mask(Reg a, Reg b) { return unsigned(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ))); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static Reg round(Reg a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // x * 2^n for integral n in [-126, 127], 2^n built in the exponent field.
  static Reg ldexp(Reg x, Reg n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_mul_ps(x, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
  }
  // 1/x from the 12-bit estimate and one Newton step (about 23 bits), cheaper than a divide.
  static Reg reciprocal(Reg x) {
    const Reg r = _mm256_rcp_ps(x);
    return _mm256_mul_ps(r, _mm256_fnmadd_ps(x, r, _mm256_set1_ps(2.f)));
  }
  static Reg exp(Reg x) { return vec_exp<VecAvx2>(x); }
  static float reduce_max(Reg a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  // lane j of the result = sum of the lanes of sums[j], for j < 8: three rounds of pairwise
  // horizontal adds instead of eight separate reductions.
  static Reg transpose_sum(const Reg* sums) {
    const __m256 t0 = _mm256_hadd_ps(sums[0], sums[1]);
    const __m256 t1 = _mm256_hadd_ps(sums[2], sums[3]);
    const __m256 t2 = _mm256_hadd_ps(sums[4], sums[5]);
    const __m256 t3 = _mm256_hadd_ps(sums[6], sums[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1);  // per 128-bit half: sums 0..3
    const __m256 u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half: sums 4..7
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }
  static float reduce_add(Reg a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};

}  // namespace
}  // namespace kvflow::cpu
