// quantized_linear on the CPU: out = input @ weight^T for a weight in GGUF blocks
// (gguf_blocks.h), from input rows quantized to int8 per 32-chunk, as llama.cpp's CPU backend
// multiplies them. Decode reads each weight byte once: a 4-bit format is a quarter of bfloat16's
// bytes. The loop over output features and row tiles is written once; the chunk dot products
// are plain C++ here, and intrinsics in quantized_linear_avx2.h. Included by kernels.h, inside
// each instruction set's translation unit: everything sits in an unnamed namespace.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "kvflow/cpu/gguf_blocks.h"
#include "kvflow/cpu/kernel_table.h"
#include "kvflow/numeric.h"

namespace kvflow::cpu {
namespace {

// Dot::run<kRows>(w, x, r0, sums): sums[r] = weight row w . input row r0 + r, for r < kRows.
template <class Dot>
void quantized_linear_rows(void* out, bool out_is_float32, const QuantizedRows& x, const uint8_t* weight,
                           int64_t row_bytes, const float* bias, int64_t rows, int64_t out_stride, int64_t begin,
                           int64_t end) {
  constexpr int kRowTile = 4;
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* w = weight + o * row_bytes;
    for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
      float sums[kRowTile];
      const int n = int(std::min<int64_t>(kRowTile, rows - r0));
      switch (n) {
        case 1: Dot::template run<1>(w, x, r0, sums); break;
        case 2: Dot::template run<2>(w, x, r0, sums); break;
        case 3: Dot::template run<3>(w, x, r0, sums); break;
        default: Dot::template run<4>(w, x, r0, sums); break;
      }
      for (int r = 0; r < n; ++r) {
        const float y = bias == nullptr ? sums[r] : sums[r] + bias[o];
        const int64_t index = (r0 + r) * out_stride + o;
        if (out_is_float32) {
          static_cast<float*>(out)[index] = y;
        } else {
          static_cast<bfloat16*>(out)[index] = from_float<bfloat16>(y);
        }
      }
    }
  }
}

template <QuantFormat F>
struct QuantDotGeneric {
  template <int kRows>
  static void run(const uint8_t* w, const QuantizedRows& x, int64_t r0, float* sums) {
    constexpr int64_t kChunks = quant_block_chunks(F);
    float acc[kRows] = {};
    WeightChunk chunk;
    for (int64_t b = 0; b < x.blocks; ++b) {
      decode_chunk(F, w + b / kChunks * quant_block_bytes(F), int(b % kChunks), &chunk);
      for (int r = 0; r < kRows; ++r) {
        const int64_t i = (r0 + r) * x.blocks + b;
        const int8_t* xq = x.q + i * kQuantBlock;
        int32_t low = 0, high = 0;
        for (int j = 0; j < 16; ++j) low += int32_t(chunk.code[j]) * int32_t(xq[j]);
        for (int j = 16; j < 32; ++j) high += int32_t(chunk.code[j]) * int32_t(xq[j]);
        acc[r] += x.scale_sum[2 * i] * (chunk.scale[0] * float(low) + chunk.scale[1] * float(high));
        if constexpr (has_offset(F)) acc[r] += chunk.offset * x.scale_sum[2 * i + 1];
      }
    }
    for (int r = 0; r < kRows; ++r) sums[r] = acc[r];
  }
};

// DequantizePanelFn (kernel_table.h). Chunk by chunk down the panel's rows: each chunk's 16 pairs
// land kPackedLinearPanel pairs apart, all within 3 KB that stay in L1 until the next chunk. The
// values round to bfloat16 without from_float's NaN branch, so that the loop vectorises (a
// block's scales are finite in any file a converter wrote).
template <QuantFormat F>
void dequantize_panel(const uint8_t* weight, int64_t row_bytes, int64_t out_features, int64_t panel, bfloat16* dst) {
  constexpr int64_t kPanel = kPackedLinearPanel, kChunks = quant_block_chunks(F), kBytes = quant_block_bytes(F);
  const int64_t chunks = row_bytes / kBytes * kChunks;
  const int64_t first = panel * kPanel, width = std::min<int64_t>(kPanel, out_features - first);
  auto* pairs = reinterpret_cast<uint32_t*>(dst);  // pairs[k / 2][j]: values k and k + 1 of row j
  for (int64_t b = 0; b < chunks; ++b) {
    uint32_t* block_pairs = pairs + b * (kQuantBlock / 2) * kPanel;
    for (int64_t j = 0; j < kPanel; ++j) {
      float values[kQuantBlock] = {};
      if (j < width) dequantize_chunk(F, weight + (first + j) * row_bytes + b / kChunks * kBytes, int(b % kChunks), values);
      uint32_t rounded[kQuantBlock];
      for (int k = 0; k < kQuantBlock; ++k) {
        uint32_t u;
        std::memcpy(&u, &values[k], sizeof u);
        rounded[k] = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
      }
      for (int64_t k2 = 0; k2 < kQuantBlock / 2; ++k2) {
        block_pairs[k2 * kPanel + j] = rounded[2 * k2] | (rounded[2 * k2 + 1] << 16);
      }
    }
  }
}

// QuantizeActivationsFn (kernel_table.h) in plain C++.
template <typename T>
void quantize_activations(const void* x, int64_t chunks, int8_t* q, float* scale_sum, int32_t* code_sum) {
  const T* values = static_cast<const T*>(x);
  float chunk[kQuantBlock];
  for (int64_t c = 0; c < chunks; ++c) {
    for (int j = 0; j < kQuantBlock; ++j) chunk[j] = to_float(values[c * kQuantBlock + j]);
    quantize_activation_block(chunk, q + c * kQuantBlock, scale_sum + 2 * c, code_sum + c);
  }
}

// The plain C++ entries of every format.
template <int... kFormats>
void fill_quantized_entries(KernelTable& t, std::integer_sequence<int, kFormats...>) {
  t.quantize_activations[0] = quantize_activations<float>;
  t.quantize_activations[1] = quantize_activations<bfloat16>;
  ((t.quantized_linear[kFormats] = quantized_linear_rows<QuantDotGeneric<QuantFormat(kFormats)>>), ...);
  ((t.dequantize_panel[kFormats] = dequantize_panel<QuantFormat(kFormats)>), ...);
  for (QuantizedLinearFn& kernel : t.quantized_linear_interleaved) kernel = nullptr;
}

}  // namespace
}  // namespace kvflow::cpu
