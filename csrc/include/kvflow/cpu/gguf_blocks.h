// GGUF's quantized weight blocks (the formats llama.cpp writes) and the int8 activations their
// products run on. Torch-free. A quantized weight [out_features, in_features] is stored as GGUF
// stores it: each row is in_features / 32 consecutive blocks of 32 weights.
//   Q4_0 (type 2):  float16 d, 16 bytes of nibbles        w = d * (q - 8)      18 bytes
//   Q4_1 (type 3):  float16 d, float16 m, 16 bytes        w = d * q + m        20 bytes
//   Q8_0 (type 8):  float16 d, 32 int8                    w = d * q            34 bytes
// In the 4-bit blocks, byte j holds weight j in its low nibble and weight j + 16 in its high one.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvflow/numeric.h"

namespace kvflow::cpu {

constexpr int64_t kQuantBlock = 32;  // weights per block, in every format here

// GGML's type ids, as GGUF files and the gguf package name them.
enum class GgufType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

// The formats quantized_linear runs, in the order of KernelTable::quantized_linear.
enum class QuantFormat : int { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };
constexpr int kNumQuantFormats = 3;

// The format of a GGML type id, or -1 for one quantized_linear does not run.
inline int quant_format_of(int64_t ggml_type) {
  switch (GgufType(ggml_type)) {
    case GgufType::kQ4_0:
      return int(QuantFormat::kQ4_0);
    case GgufType::kQ4_1:
      return int(QuantFormat::kQ4_1);
    case GgufType::kQ8_0:
      return int(QuantFormat::kQ8_0);
  }
  return -1;
}

inline int64_t quant_block_bytes(QuantFormat format) {
  switch (format) {
    case QuantFormat::kQ4_0:
      return 18;
    case QuantFormat::kQ4_1:
      return 20;
    case QuantFormat::kQ8_0:
      return 34;
  }
  return 0;
}

inline float block_half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return to_float(float16{bits});
}

// The 32 weights of one block as float32 (the formats' definition; the products never call it).
inline void dequantize_block(QuantFormat format, const uint8_t* block, float* out) {
  const float d = block_half(block);
  switch (format) {
    case QuantFormat::kQ4_0:
      for (int j = 0; j < 16; ++j) {
        out[j] = d * float((block[2 + j] & 0xF) - 8);
        out[j + 16] = d * float((block[2 + j] >> 4) - 8);
      }
      break;
    case QuantFormat::kQ4_1: {
      const float m = block_half(block + 2);
      for (int j = 0; j < 16; ++j) {
        out[j] = d * float(block[4 + j] & 0xF) + m;
        out[j + 16] = d * float(block[4 + j] >> 4) + m;
      }
      break;
    }
    case QuantFormat::kQ8_0:
      for (int j = 0; j < 32; ++j) out[j] = d * float(int8_t(block[2 + j]));
      break;
  }
}

// Activation rows quantized for the products: row r's block i = r * blocks + b is
// q[i * 32 ...] (int8) times scale_sum[2i]; scale_sum[2i + 1] is the sum of the block's quantized
// values, scale times the sum of q (Q4_1's offsets m multiply it). Side by side, one 8-byte load
// reads both. The quantized sum, not the exact one: then a Q4_1 product is the dot product of the
// weights w = d q + m with the quantized activations, and its error sums w_j (x'_j - x_j), whose
// weights are centred on zero; with the exact sum it would sum d q_j (x'_j - x_j), whose weights
// are not, and the product's error nearly doubles.
struct QuantizedRows {
  const int8_t* q;
  const float* scale_sum;
  int64_t blocks;  // in_features / 32
};

// Quantizes one block of 32 activations: scale = max|x| / 127 and q = round(x / scale), so that
// |x - scale * q| <= scale / 2 for every value (the bound the tests hold the products to).
// q is computed as 127 x / max|x|, not x times a rounded reciprocal: bfloat16 activations land
// exactly halfway between two codes often, and a rounded reciprocal would break all of a
// block's ties the same way, a bias that grows through the layers. 127 x is exact for a
// bfloat16 x, so a tie stays a tie and rounds to even.
inline void quantize_activation_block(const float* x, int8_t* q, float* scale_sum) {
  float amax = 0.f;
  for (int j = 0; j < kQuantBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.f;
  int code_sum = 0;
  for (int j = 0; j < kQuantBlock; ++j) {
    const float code = amax > 0.f ? std::nearbyint(x[j] * 127.f / amax) : 0.f;
    q[j] = int8_t(std::max(-127.f, std::min(127.f, code)));
    code_sum += q[j];
  }
  scale_sum[0] = d;
  scale_sum[1] = d * float(code_sum);
}

}  // namespace kvflow::cpu
