// packed_linear's kernel on CPUs with AVX-512 BF16. A tile of up to 8 rows x one 48-feature
// panel keeps 24 float32 accumulators in registers; per pair of input features it loads the
// panel's three vectors once and issues 24 vdpbf16ps, each against a broadcast input pair, so
// the loop is bound by the dot-product unit rather than by loads (measured: 450 GFLOP/s on two
// Zen 4 cores at 64 rows, against 410 for oneDNN's prepacked matmul). Include only in
// isa_avx512_bf16.cpp, after kernels.h.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kvflow/cpu/packed_linear.h"
#include "kvflow/numeric.h"

namespace kvflow::cpu {
namespace {

struct PackedLinearAvx512Bf16 {
  static constexpr int kMaxRows = 8;
  static constexpr int kVectors = int(kPackedLinearPanel / 16);

  template <int kRows>
  static void run(const PackedLinearPanel& p, int64_t r0) {
    __m512 acc[kRows][kVectors];
    for (int r = 0; r < kRows; ++r) {
      for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_setzero_ps();
    }
    const bfloat16* x = p.x + r0 * p.x_stride;
    const bfloat16* w = p.w;
    auto step = [&](const __m512i (&inputs)[kRows]) {
      __m512bh b[kVectors];
      for (int v = 0; v < kVectors; ++v) b[v] = (__m512bh)_mm512_loadu_si512(w + 32 * v);
      for (int r = 0; r < kRows; ++r) {
        for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], b[v], (__m512bh)inputs[r]);
      }
      w += 2 * kPackedLinearPanel;
    };
    const int64_t full_pairs = p.in_features / 2;
    for (int64_t k2 = 0; k2 < full_pairs; ++k2) {
      __m512i inputs[kRows];
      for (int r = 0; r < kRows; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * p.x_stride + 2 * k2, sizeof(pair));
        inputs[r] = _mm512_set1_epi32(pair);
      }
      step(inputs);
    }
    if (p.in_features % 2 != 0) {  // the last feature alone: its packed partner is zero, and x ends there
      __m512i inputs[kRows];
      for (int r = 0; r < kRows; ++r) inputs[r] = _mm512_set1_epi32(int32_t(x[r * p.x_stride + p.in_features - 1].bits));
      step(inputs);
    }

    for (int v = 0; v < kVectors; ++v) {
      const int lanes = std::clamp(p.width - 16 * v, 0, 16);
      if (lanes == 0) break;
      const __mmask16 mask = __mmask16((1u << lanes) - 1u);
      const int64_t o = p.first + 16 * v;
      __m512 bias = _mm512_setzero_ps();
      if (p.bias != nullptr) {
        const __m256i raw = _mm256_maskz_loadu_epi16(mask, p.bias + o);
        bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
      }
      for (int r = 0; r < kRows; ++r) {
        const __m512 y = _mm512_add_ps(acc[r][v], bias);
        const int64_t index = (r0 + r) * p.out_stride + o;
        if (p.out_is_float32) {
          _mm512_mask_storeu_ps(static_cast<float*>(p.out) + index, mask, y);
        } else {
          _mm256_mask_storeu_epi16(static_cast<bfloat16*>(p.out) + index, mask, (__m256i)_mm512_cvtneps_pbh(y));
        }
      }
    }
  }
};

}  // namespace
}  // namespace kvflow::cpu
