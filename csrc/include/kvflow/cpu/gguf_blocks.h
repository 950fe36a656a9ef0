// GGUF's quantized weight blocks (the formats llama.cpp writes) and the int8 activations their
// products run on. Torch-free; the block decoding compiles for CUDA devices too. A quantized weight [out_features, in_features] is stored as GGUF
// stores it: each row is in_features / block values consecutive blocks.
//   Q4_0 (type 2):  f16 d, 16 bytes of nibbles                  w = d * (q - 8)           18 bytes / 32
//   Q4_1 (type 3):  f16 d, f16 m, 16 bytes                      w = d * q + m             20 bytes / 32
//   Q5_0 (type 6):  f16 d, 4 bytes of fifth bits, 16 bytes      w = d * (q - 16)          22 bytes / 32
//   Q5_1 (type 7):  f16 d, f16 m, 4 bytes, 16 bytes             w = d * q + m             24 bytes / 32
//   Q8_0 (type 8):  f16 d, 32 int8                              w = d * q                 34 bytes / 32
//   Q4_K (type 12): f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles;
//                   8 sub-blocks of 32, w = d * sc * q - dmin * m                        144 bytes / 256
//   Q5_K (type 13): as Q4_K plus 32 bytes of fifth bits                                  176 bytes / 256
//   Q6_K (type 14): 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales, f16 d;
//                   16 sub-blocks of 16, w = d * sc * (q - 32)                           210 bytes / 256
// In the 32-weight 4- and 5-bit blocks, byte j holds weight j in its low nibble and weight j + 16
// in its high one; the fifth bit of weight j is bit j of the 4 bytes. The K-quants' layouts are
// spelled out in decode_chunk. Every product here works on chunks of 32 weights: a 32-weight
// block is one chunk, a K-quant block eight.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvflow/numeric.h"

namespace kvflow::cpu {

constexpr int64_t kQuantBlock = 32;  // weights per chunk, and per block of the 32-weight formats

// GGML's type ids, as GGUF files and the gguf package name them.
enum class GgufType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

// The formats quantized_linear runs, in the order of KernelTable::quantized_linear.
enum class QuantFormat : int { kQ4_0 = 0, kQ4_1, kQ8_0, kQ5_0, kQ5_1, kQ4_K, kQ5_K, kQ6_K };
constexpr int kNumQuantFormats = 8;

// The format of a GGML type id, or -1 for one quantized_linear does not run.
KVFLOW_HOST_DEVICE int quant_format_of(int64_t ggml_type) {
  switch (GgufType(ggml_type)) {
    case GgufType::kQ4_0: return int(QuantFormat::kQ4_0);
    case GgufType::kQ4_1: return int(QuantFormat::kQ4_1);
    case GgufType::kQ5_0: return int(QuantFormat::kQ5_0);
    case GgufType::kQ5_1: return int(QuantFormat::kQ5_1);
    case GgufType::kQ8_0: return int(QuantFormat::kQ8_0);
    case GgufType::kQ4_K: return int(QuantFormat::kQ4_K);
    case GgufType::kQ5_K: return int(QuantFormat::kQ5_K);
    case GgufType::kQ6_K: return int(QuantFormat::kQ6_K);
  }
  return -1;
}

// What the error messages list.
constexpr const char* kQuantTypesText =
    "Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), Q5_K (13) and Q6_K (14)";

KVFLOW_HOST_DEVICE constexpr bool is_k_quant(QuantFormat f) {
  return f == QuantFormat::kQ4_K || f == QuantFormat::kQ5_K || f == QuantFormat::kQ6_K;
}

KVFLOW_HOST_DEVICE constexpr int64_t quant_block_values(QuantFormat f) { return is_k_quant(f) ? 256 : 32; }

KVFLOW_HOST_DEVICE constexpr int64_t quant_block_bytes(QuantFormat f) {
  switch (f) {
    case QuantFormat::kQ4_0: return 18;
    case QuantFormat::kQ4_1: return 20;
    case QuantFormat::kQ8_0: return 34;
    case QuantFormat::kQ5_0: return 22;
    case QuantFormat::kQ5_1: return 24;
    case QuantFormat::kQ4_K: return 144;
    case QuantFormat::kQ5_K: return 176;
    case QuantFormat::kQ6_K: return 210;
  }
  return 0;
}

KVFLOW_HOST_DEVICE constexpr int64_t quant_block_chunks(QuantFormat f) { return quant_block_values(f) / kQuantBlock; }

// Weight codes the products take as unsigned (the format adds an offset instead of centring).
KVFLOW_HOST_DEVICE constexpr bool has_offset(QuantFormat f) {
  return f == QuantFormat::kQ4_1 || f == QuantFormat::kQ5_1 || f == QuantFormat::kQ4_K || f == QuantFormat::kQ5_K;
}

// What the 4- and 5-bit formats without an offset take off their stored codes: w = d (q - centre).
KVFLOW_HOST_DEVICE constexpr int code_centre(QuantFormat f) {
  return f == QuantFormat::kQ4_0 ? 8 : f == QuantFormat::kQ5_0 ? 16 : 0;
}

// Little-endian fields at any byte offset (blocks are not aligned).
KVFLOW_HOST_DEVICE uint16_t block_half_bits(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }

KVFLOW_HOST_DEVICE float block_half(const uint8_t* p) { return to_float(float16{block_half_bits(p)}); }

KVFLOW_HOST_DEVICE uint32_t block_word(const uint8_t* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}

// Sub-block j's 6-bit scale and min in a Q4_K / Q5_K block's 12 bytes: j < 4 in the low six bits
// of bytes j and j + 4; j >= 4 in the nibbles of byte j + 4, topped by the high two bits of bytes
// j - 4 and j.
KVFLOW_HOST_DEVICE void k_scale_min(const uint8_t* scales, int j, int* scale, int* min) {
  if (j < 4) {
    *scale = scales[j] & 63;
    *min = scales[j + 4] & 63;
  } else {
    *scale = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4);
    *min = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
  }
}

// One chunk of 32 weights: weight j = scale[j / 16] * code[j] + offset.
struct WeightChunk {
  int8_t code[kQuantBlock];
  float scale[2];
  float offset;
};

// The scales and offset of chunk c of a block (the formats' definition, shared by every kernel).
KVFLOW_HOST_DEVICE void chunk_scales(QuantFormat f, const uint8_t* block, int c, float* scale_low, float* scale_high,
                         float* offset) {
  *offset = 0.f;
  switch (f) {
    case QuantFormat::kQ4_1:
    case QuantFormat::kQ5_1:
      *offset = block_half(block + 2);
      [[fallthrough]];
    case QuantFormat::kQ4_0:
    case QuantFormat::kQ8_0:
    case QuantFormat::kQ5_0:
      *scale_low = *scale_high = block_half(block);
      return;
    case QuantFormat::kQ4_K:
    case QuantFormat::kQ5_K: {
      int sc, m;
      k_scale_min(block + 4, c, &sc, &m);
      *scale_low = *scale_high = block_half(block) * float(sc);
      *offset = -block_half(block + 2) * float(m);
      return;
    }
    case QuantFormat::kQ6_K: {
      // Chunk c = 4h + k reads scales 8h + 2k (its first 16 weights) and 8h + 2k + 1.
      const auto* sc = reinterpret_cast<const int8_t*>(block + 192) + 8 * (c / 4) + 2 * (c % 4);
      const float d = block_half(block + 208);
      *scale_low = d * float(sc[0]);
      *scale_high = d * float(sc[1]);
      return;
    }
  }
}

// Chunk c's 32 codes. Q4_K / Q5_K: chunk c's weights are the low (c even) or high nibbles of bytes
// 16 + 32 (c / 2) ... of the nibbles, Q5_K's fifth bit bit c of the 32 high-bit bytes. Q6_K: the
// 256 weights are two halves of 128; in half h, chunk k (c = 4h + k) takes the low (k < 2) or high
// nibbles of ql[64h + 32 (k % 2) + l] and bits 2k, 2k + 1 of qh[32h + l].
KVFLOW_HOST_DEVICE void chunk_codes(QuantFormat f, const uint8_t* block, int c, int8_t* code) {
  switch (f) {
    case QuantFormat::kQ8_0:
      for (int j = 0; j < kQuantBlock; ++j) code[j] = int8_t(block[2 + j]);
      return;
    case QuantFormat::kQ4_0:
    case QuantFormat::kQ4_1: {
      const uint8_t* nibbles = block + (f == QuantFormat::kQ4_1 ? 4 : 2);
      for (int j = 0; j < 16; ++j) {
        code[j] = int8_t((nibbles[j] & 0xF) - code_centre(f));
        code[j + 16] = int8_t((nibbles[j] >> 4) - code_centre(f));
      }
      return;
    }
    case QuantFormat::kQ5_0:
    case QuantFormat::kQ5_1: {
      const int header = f == QuantFormat::kQ5_1 ? 4 : 2;
      const uint32_t high = block_word(block + header);
      const uint8_t* nibbles = block + header + 4;
      for (int j = 0; j < 16; ++j) {
        code[j] = int8_t(((nibbles[j] & 0xF) | (((high >> j) & 1) << 4)) - code_centre(f));
        code[j + 16] = int8_t(((nibbles[j] >> 4) | (((high >> (j + 16)) & 1) << 4)) - code_centre(f));
      }
      return;
    }
    case QuantFormat::kQ4_K:
    case QuantFormat::kQ5_K: {
      const bool five = f == QuantFormat::kQ5_K;
      const uint8_t* nibbles = block + (five ? 48 : 16) + 32 * (c / 2);
      const uint8_t* high = block + 16;
      const int shift = 4 * (c % 2);
      for (int l = 0; l < 32; ++l) {
        code[l] = int8_t(((nibbles[l] >> shift) & 0xF) | (five ? ((high[l] >> c) & 1) << 4 : 0));
      }
      return;
    }
    case QuantFormat::kQ6_K: {
      const int h = c / 4, k = c % 4;
      const uint8_t* low = block + 64 * h + 32 * (k % 2);
      const uint8_t* high = block + 128 + 32 * h;
      for (int l = 0; l < 32; ++l) {
        code[l] = int8_t((((low[l] >> (4 * (k / 2))) & 0xF) | (((high[l] >> (2 * k)) & 3) << 4)) - 32);
      }
      return;
    }
  }
}

KVFLOW_HOST_DEVICE void decode_chunk(QuantFormat f, const uint8_t* block, int c, WeightChunk* chunk) {
  chunk_codes(f, block, c, chunk->code);
  chunk_scales(f, block, c, &chunk->scale[0], &chunk->scale[1], &chunk->offset);
}

// Chunk c of a block as float32 (the formats' definition; the many-row path and the embedding
// use it where no intrinsics do, and so do the CUDA kernels).
KVFLOW_HOST_DEVICE void dequantize_chunk(QuantFormat f, const uint8_t* block, int c, float* out) {
  WeightChunk chunk;
  decode_chunk(f, block, c, &chunk);
  for (int j = 0; j < kQuantBlock; ++j) out[j] = chunk.scale[j / 16] * float(chunk.code[j]) + chunk.offset;
}

// Activation rows quantized for the products: row r's chunk i = r * blocks + b is
// q[i * 32 ...] (int8) times scale_sum[2i]; scale_sum[2i + 1] is the sum of the chunk's quantized
// values, scale times the sum of q (the offsets multiply it). Side by side, one 8-byte load
// reads both. The quantized sum, not the exact one: then a product with offsets is the dot product
// of the weights w = d q + m with the quantized activations, and its error sums w_j (x'_j - x_j),
// whose weights are centred on zero; with the exact sum it would sum d q_j (x'_j - x_j), whose
// weights are not, and the product's error nearly doubles.
// code_sum[i] is the sum of chunk i's codes as an integer: the interleaved kernels take the
// weights' bias (Q8_0's w + 128) or centre (code_centre) back out of their integer sums with it.
struct QuantizedRows {
  const int8_t* q;
  const float* scale_sum;
  const int32_t* code_sum;
  int64_t blocks;  // in_features / 32
  // The sum of each block's first 16 codes (Q6_K's kernels take the halves' sums apart), or null:
  // those kernels then sum them per group of weight rows.
  const int32_t* first_half_sum = nullptr;
};

// Quantizes one block of 32 activations: scale = max|x| / 127 and q = round(x / scale), so that
// |x - scale * q| <= scale / 2 for every value (the bound the tests hold the products to).
// q is computed as 127 x / max|x|, not x times a rounded reciprocal: bfloat16 activations land
// exactly halfway between two codes often, and a rounded reciprocal would break all of a
// block's ties the same way, a bias that grows through the layers. 127 x is exact for a
// bfloat16 x, so a tie stays a tie and rounds to even.
inline void quantize_activation_block(const float* x, int8_t* q, float* scale_sum, int32_t* code_sum) {
  float amax = 0.f;
  for (int j = 0; j < kQuantBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.f;
  int32_t sum = 0;
  for (int j = 0; j < kQuantBlock; ++j) {
    const float code = amax > 0.f ? std::nearbyint(x[j] * 127.f / amax) : 0.f;
    q[j] = int8_t(std::max(-127.f, std::min(127.f, code)));
    sum += q[j];
  }
  scale_sum[0] = d;
  scale_sum[1] = d * float(sum);
  *code_sum = sum;
}


// kvflow's interleaved layout of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K weights, made
// once at load for the CPU's products (type id kInterleavedTypeBase + the GGML type). The rows go
// in groups of kInterleavedRows; a group stores block b of its 8 rows together: each field of the
// block's header in turn for the 8 rows (interleaved_field_bytes), then 32-byte pieces (four of
// nibbles, eight of Q8_0's codes, thirty-two of the K-quants' nibbles, forty-eight of Q6_K's low
// then high bits), piece k holding code bytes 4k..4k+3 (the block's bytes outside its header, in
// order) of row 0, of row 1, ... of row 7. The same bytes as the GGUF rows, so the same memory; a
// row's 32-bit lane in each piece lets the AVX2 kernel multiply 8 rows with one instruction, and
// convert their 8 scales with another.
constexpr int64_t kInterleavedRows = 8;
constexpr int64_t kInterleavedTypeBase = 1000;
constexpr int kNumInterleavedFormats = 8;  // Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K, Q5_K

// Whether weights of this GGML type are interleaved on the CPU.
KVFLOW_HOST_DEVICE constexpr bool interleaves(int64_t ggml_type) {
  return ggml_type == int64_t(GgufType::kQ4_0) || ggml_type == int64_t(GgufType::kQ4_1) ||
         ggml_type == int64_t(GgufType::kQ5_0) || ggml_type == int64_t(GgufType::kQ5_1) ||
         ggml_type == int64_t(GgufType::kQ8_0) || ggml_type == int64_t(GgufType::kQ4_K) ||
         ggml_type == int64_t(GgufType::kQ5_K) || ggml_type == int64_t(GgufType::kQ6_K);
}

// The GGML type an interleaved type id lays out, or -1 for any other id.
KVFLOW_HOST_DEVICE constexpr int64_t interleaved_base_type(int64_t type) {
  return interleaves(type - kInterleavedTypeBase) ? type - kInterleavedTypeBase : -1;
}

// The index of an interleaved format among KernelTable::quantized_linear_interleaved's entries.
constexpr int interleaved_index(QuantFormat f) {
  return f == QuantFormat::kQ4_0   ? 0
         : f == QuantFormat::kQ4_1 ? 1
         : f == QuantFormat::kQ5_0 ? 2
         : f == QuantFormat::kQ5_1 ? 3
         : f == QuantFormat::kQ8_0 ? 4
         : f == QuantFormat::kQ4_K ? 5
         : f == QuantFormat::kQ6_K ? 6
                                   : 7;
}

// The bytes of one row's header field i of an interleaved format's block (0 past its last):
// d, then m (Q4_1, Q5_1), then the fifth bits (Q5_0, Q5_1); Q4_K: d, dmin, then its 12 scale
// bytes one by one, so that byte t of the 8 rows' scales lies in 8 bytes together; Q6_K: its 16
// scales one by one, then d; Q5_K: as Q4_K, then its fifth bits in 8 fields of 4 bytes, so that
// they lie as the pieces of codes do.
constexpr int64_t interleaved_field_bytes(QuantFormat f, int i) {
  if (f == QuantFormat::kQ4_K) return i < 2 ? 2 : i < 14 ? 1 : 0;
  if (f == QuantFormat::kQ5_K) return i < 2 ? 2 : i < 14 ? 1 : i < 22 ? 4 : 0;
  if (f == QuantFormat::kQ6_K) return i < 16 ? 1 : i == 16 ? 2 : 0;
  const bool offset = f == QuantFormat::kQ4_1 || f == QuantFormat::kQ5_1;
  const bool fifth = f == QuantFormat::kQ5_0 || f == QuantFormat::kQ5_1;
  const int64_t fields[3] = {2, offset ? 2 : (fifth ? 4 : 0), offset && fifth ? 4 : 0};
  return i < 3 ? fields[i] : 0;
}

// The bytes of an interleaved block's header for one row (all its fields).
constexpr int64_t interleaved_header_bytes(QuantFormat f) {
  int64_t bytes = 0;
  for (int i = 0; interleaved_field_bytes(f, i) > 0; ++i) bytes += interleaved_field_bytes(f, i);
  return bytes;
}

// Where a GGUF block's header starts: at its first byte, but after Q6_K's 192 bytes of codes.
constexpr int64_t gguf_header_start(QuantFormat f) { return f == QuantFormat::kQ6_K ? 192 : 0; }

// Rows [first, first + count) of a weight in the interleaved layout, written out in GGUF's
// (count * row_bytes bytes): what the kernels without an interleaved version read.
inline void gather_interleaved_rows(const uint8_t* weight, int64_t row_bytes, QuantFormat f, int64_t first,
                                    int64_t count, uint8_t* out) {
  const int64_t bytes = quant_block_bytes(f), blocks = row_bytes / bytes, header = interleaved_header_bytes(f);
  const int64_t header_start = gguf_header_start(f);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t row = first + i, r = row % kInterleavedRows;
    const uint8_t* group = weight + row / kInterleavedRows * kInterleavedRows * row_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* src = group + b * kInterleavedRows * bytes;
      uint8_t* block = out + i * row_bytes + b * bytes;
      int64_t offset = 0;  // of the field in a row's block; its 8 rows' copies start 8 times as far in
      for (int field = 0; interleaved_field_bytes(f, field) > 0; ++field) {
        const int64_t size = interleaved_field_bytes(f, field);
        std::memcpy(block + header_start + offset, src + kInterleavedRows * offset + size * r, size);
        offset += size;
      }
      for (int64_t k = 0; k < (bytes - header) / 4; ++k) {
        const int64_t code_byte = 4 * k < header_start ? 4 * k : 4 * k + header;  // where the piece's bytes lie
        std::memcpy(block + code_byte, src + header * kInterleavedRows + 32 * k + 4 * r, 4);
      }
    }
  }
}

}  // namespace kvflow::cpu
