// The interleaved quantized products with vpdpbusd's byte products (isa_avx512_vnni.cpp,
// isa_avx_vnni.cpp), on any AVX2 CPU: the same policy (DpbusdDot) with the instruction replaced
// by its definition (per 32-bit lane, four products of an unsigned and a signed byte added to the
// lane), written as a plain loop, so that the kernels' 32-bit partial sums are checked against
// the float64 products of the dequantized blocks here, not only on a CPU with the instruction
// (where the Python suite runs the real one). The AVX2 byte products run beside them.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "check.h"
#include "kvflow/cpu/gguf_blocks.h"
#include "kvflow/cpu/kernel_table.h"
#include "kvflow/numeric.h"
#include "quantized_reference.h"

#if defined(__x86_64__)

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "kvflow/cpu/kernels.h"
#include "kvflow/cpu/quantized_linear_avx2.h"

using namespace kvflow;
using namespace kvflow::cpu;
using namespace kvflow::testing;

namespace {

// vpdpbusd written out from its definition: no saturation, each lane's four products summed in
// 32 bits onto the lane; kRegisters as AVX-VNNI's (16) or AVX-512's (32), for the kernels'
// forms that depend on it.
template <int kRegisters>
struct DefinedVpdpbusd {
  static constexpr int kVectorRegisters = kRegisters;
  static __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
    alignas(32) int32_t sums[8];
    alignas(32) uint8_t a[32];
    alignas(32) int8_t b[32];
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums), acc);
    _mm256_store_si256(reinterpret_cast<__m256i*>(a), u);
    _mm256_store_si256(reinterpret_cast<__m256i*>(b), s);
    for (int lane = 0; lane < 8; ++lane) {
      for (int j = 0; j < 4; ++j) sums[lane] += int32_t(a[4 * lane + j]) * int32_t(b[4 * lane + j]);
    }
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(sums));
  }
};

// out_features rows of format f in the interleaved layout, random codes and real float16 scales
// (every 2-byte header field is one: d, m, dmin), and the same rows in GGUF's layout.
std::pair<std::vector<uint8_t>, std::vector<uint8_t>> random_interleaved_rows(QuantFormat f, int64_t out_features,
                                                                             int64_t in_features, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
  const int64_t block_bytes = quant_block_bytes(f), blocks = in_features / quant_block_values(f);
  const int64_t row_bytes = blocks * block_bytes;
  std::vector<uint8_t> interleaved(size_t(out_features * row_bytes)), gguf(interleaved.size());
  for (auto& b : interleaved) b = uint8_t(byte(gen));
  for (int64_t group_block = 0; group_block < out_features / kInterleavedRows * blocks; ++group_block) {
    uint8_t* block = interleaved.data() + group_block * kInterleavedRows * block_bytes;
    int64_t offset = 0;
    for (int field = 0; interleaved_field_bytes(f, field) > 0; ++field) {
      if (interleaved_field_bytes(f, field) == 2) {
        for (int64_t r = 0; r < kInterleavedRows; ++r) {
          const float16 s = from_float<float16>(scale(gen));
          std::memcpy(block + kInterleavedRows * offset + 2 * r, &s.bits, 2);
        }
      }
      offset += interleaved_field_bytes(f, field);
    }
  }
  gather_interleaved_rows(interleaved.data(), row_bytes, f, 0, out_features, gguf.data());
  return {interleaved, gguf};
}

template <QuantFormat F, class Dot>
int mismatches(const std::vector<uint8_t>& weight, int64_t row_bytes, const QuantizedInput& in, int64_t rows,
               int64_t out_features, const ExpectedProducts& expected) {
  std::vector<float> out(size_t(rows * out_features), -1.f);
  quantized_linear_interleaved_avx2<F, Dot>(out.data(), true, in.rows(), weight.data(), row_bytes, nullptr, rows,
                                            out_features, 0, out_features);
  int bad = 0;
  for (size_t k = 0; k < out.size(); ++k) bad += !(std::fabs(out[k] - expected.value[k]) <= expected.bound[k]);
  return bad;
}

template <int kFormat>
void check_format() {
  constexpr QuantFormat F = QuantFormat(kFormat);
  const int64_t in_features = 512, out_features = 24;  // two K-quant blocks, three groups of rows
  const auto [interleaved, gguf] = random_interleaved_rows(F, out_features, in_features, uint32_t(40 + kFormat));
  const int64_t row_bytes = in_features / quant_block_values(F) * quant_block_bytes(F);
  for (int64_t rows : {1, 2, 3, 4, 5, 7, 9}) {  // every row tile, whole and with a remainder
    std::vector<float> x(size_t(rows * in_features));
    std::mt19937 gen{uint32_t(rows)};
    std::normal_distribution<float> normal(0.f, 1.f);
    for (auto& v : x) v = normal(gen);
    const QuantizedInput in = quantized_input(x, rows, in_features);
    const ExpectedProducts expected = expected_products(F, gguf, out_features, in, rows);
    const int vnni = mismatches<F, DpbusdDot<DefinedVpdpbusd<16>>>(interleaved, row_bytes, in, rows, out_features,
                                                                   expected) +
                     mismatches<F, DpbusdDot<DefinedVpdpbusd<32>>>(interleaved, row_bytes, in, rows, out_features,
                                                                   expected);
    const int avx2 = mismatches<F, MaddubsDot>(interleaved, row_bytes, in, rows, out_features, expected);
    if (vnni + avx2 != 0) {
      fail(__FILE__, __LINE__,
           "format " + std::to_string(kFormat) + ", " + std::to_string(rows) + " rows: " + std::to_string(vnni) +
               " mismatches with vpdpbusd's products, " + std::to_string(avx2) + " with AVX2's");
    }
  }
}

template <int... kFormats>
void check_every_format(std::integer_sequence<int, kFormats...>) {
  (check_format<kFormats>(), ...);
}

}  // namespace

KVFLOW_TEST(interleaved_products_with_vnni_byte_products_match_dequantized_blocks) {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c")) {
    std::cerr << "interleaved products: this CPU has no AVX2, which the kernels' structure needs\n";
    return;
  }
  check_every_format(std::make_integer_sequence<int, kNumQuantFormats>{});
}

#pragma GCC pop_options

#endif
