// AVX-512 with the BF16 extension. Include only inside a translation unit compiled for it
// (see isa_avx512_bf16.cpp).
#pragma once

#include <immintrin.h>

#include "kvflow/cpu/vec_avx512.h"

namespace kvflow::cpu {
namespace {  // private to each instruction-set translation unit (see kernels.h)

// AVX-512 plus the BF16 extension (Zen 4, Cooper Lake, Sapphire Rapids and later): one
// instruction rounds 16 floats to bfloat16 (nearest even, NaN kept), instead of eight.
struct VecAvx512Bf16 : VecAvx512 {
  using VecAvx512::store;
  static void store(bfloat16* p, Reg v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
};

}  // namespace
}  // namespace kvflow::cpu
