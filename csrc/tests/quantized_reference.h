// The quantized products written out from the formats' definition (gguf_blocks.h's decode_chunk)
// in float64, for the kernel tests: GGUF-layout weight rows with random codes and real float16
// scales, activations quantized by quantize_activation_block, and each expected output with the
// bound of float32 accumulation.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kvflow/cpu/gguf_blocks.h"
#include "kvflow/numeric.h"

namespace kvflow::testing {

// out_features rows of in_features weights of format f, in GGUF's layout. Random bits could make
// a scale inf or nan, so d (and m or dmin) are written as float16 values; Q6_K's d comes last.
inline std::vector<uint8_t> random_gguf_rows(cpu::QuantFormat f, int64_t out_features, int64_t in_features,
                                             uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
  const int64_t block_bytes = cpu::quant_block_bytes(f), blocks = in_features / cpu::quant_block_values(f);
  std::vector<uint8_t> weight(size_t(out_features * blocks * block_bytes));
  for (auto& b : weight) b = uint8_t(byte(gen));
  const int64_t halves = f == cpu::QuantFormat::kQ6_K ? 1 : cpu::has_offset(f) ? 2 : 1;
  const int64_t first_half = f == cpu::QuantFormat::kQ6_K ? 208 : 0;
  for (int64_t i = 0; i < out_features * blocks; ++i) {
    for (int64_t half = 0; half < halves; ++half) {
      const float16 s = from_float<float16>(scale(gen));
      std::memcpy(weight.data() + i * block_bytes + first_half + 2 * half, &s.bits, 2);
    }
  }
  return weight;
}

// rows x in_features activations, quantized into codes and [scale, scale * sum] per chunk.
struct QuantizedInput {
  std::vector<int8_t> q;
  std::vector<float> scale_sum;
  int64_t chunks;
  std::vector<int32_t> code_sum;
  cpu::QuantizedRows rows() const { return {q.data(), scale_sum.data(), code_sum.data(), chunks}; }
};

inline QuantizedInput quantized_input(const std::vector<float>& x, int64_t rows, int64_t in_features) {
  QuantizedInput in{std::vector<int8_t>(x.size()), std::vector<float>(size_t(2 * rows * in_features / cpu::kQuantBlock)),
                    in_features / cpu::kQuantBlock, std::vector<int32_t>(size_t(rows * in_features / cpu::kQuantBlock))};
  for (int64_t i = 0; i < rows * in.chunks; ++i) {
    cpu::quantize_activation_block(x.data() + i * cpu::kQuantBlock, in.q.data() + i * cpu::kQuantBlock,
                                   in.scale_sum.data() + 2 * i, in.code_sum.data() + i);
  }
  return in;
}

// out[r][o] = GGUF row o . input row r, and the bound of a float32 sum of the same terms.
struct ExpectedProducts {
  std::vector<float> value, bound;
};

inline ExpectedProducts expected_products(cpu::QuantFormat f, const std::vector<uint8_t>& weight, int64_t out_features,
                                          const QuantizedInput& in, int64_t rows) {
  const int64_t block_bytes = cpu::quant_block_bytes(f), per_block = cpu::quant_block_chunks(f);
  const int64_t row_bytes = in.chunks / per_block * block_bytes;
  ExpectedProducts e{std::vector<float>(size_t(rows * out_features)), std::vector<float>(size_t(rows * out_features))};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out_features; ++o) {
      double total = 0, magnitude = 0;
      for (int64_t b = 0; b < in.chunks; ++b) {
        const uint8_t* block = weight.data() + o * row_bytes + b / per_block * block_bytes;
        cpu::WeightChunk chunk;
        cpu::decode_chunk(f, block, int(b % per_block), &chunk);
        const int64_t i = r * in.chunks + b;
        for (int64_t j = 0; j < cpu::kQuantBlock; ++j) {
          const double term = double(chunk.scale[j / 16]) * chunk.code[j] * in.scale_sum[size_t(2 * i)] *
                              in.q[size_t(i * cpu::kQuantBlock + j)];
          total += term;
          magnitude += std::fabs(term);
        }
        total += double(chunk.offset) * in.scale_sum[size_t(2 * i + 1)];
        magnitude += std::fabs(double(chunk.offset) * in.scale_sum[size_t(2 * i + 1)]);
      }
      e.value[size_t(r * out_features + o)] = float(total);
      e.bound[size_t(r * out_features + o)] = float(2e-6 * magnitude + 1e-6);
    }
  }
  return e;
}

}  // namespace kvflow::testing
