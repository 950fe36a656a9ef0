// packed_linear's kernel for CPUs without a bf16 dot product (AVX2 + FMA): each bfloat16 weight
// is widened to float32 in registers and multiplied with float32 FMAs. bf16 -> fp32 is a 16-bit
// shift, and one load of the pair layout gives a vector's features at both k and k + 1: the
// even input feature is the low half of each 32-bit lane (shift it up), the odd one the high
// half (mask off the low). The input rows are widened once per row chunk into a float32 buffer,
// so the inner loop broadcasts them straight from memory.
//
// A tile is kRows rows x kVectors registers of features, swept over the panel's
// kPackedLinearPanel / (kVectors * W) sub-tiles while the tile's input rows stay in L1; its sums
// land in a small float32 buffer, and the epilogue (bias, silu_and_mul, rounding) runs on that.
// Include only inside a translation unit compiled for the vector type's instruction set.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvflow/cpu/kernel_table.h"
#include "kvflow/cpu/packed_linear.h"
#include "kvflow/cpu/vec_scalar.h"
#include "kvflow/numeric.h"

namespace kvflow::cpu {
namespace {

// V provides, besides the float ops of vec_*.h: load_pair_halves(p, even, odd), which reads
// 2 * kWidth bfloat16 values of the pair layout ([feature][2]) and widens them into the values at
// the even and at the odd input feature of kWidth consecutive features.
template <class V, int kRows, int kVectors>
struct PackedLinearWidened {
  static constexpr int W = V::kWidth;
  static constexpr int kTileFeatures = kVectors * W;
  static constexpr int kPanel = int(kPackedLinearPanel);
  static_assert(kPanel % kTileFeatures == 0, "a panel splits into whole sub-tiles");
  static_assert(kPanel % (2 * W) == 0, "a panel splits into two whole halves");
  // Rows widened at a time: the chunk's float32 rows (at most 64 x in_features x 4 bytes) stay
  // in L2 beside the panel they pass over.
  static constexpr int64_t kChunkRows = 64;

  // Up to kFewRows rows go through the panel kFewRowBlock rows at a time, one or two rows over
  // the whole panel in one pass, three or four over each half in turn (24 float32 sums fit the
  // registers), so that each thread reads its panels as one sequential stream, prefetched
  // kStreamAhead values ahead. The sub-tiles of many rows would read a panel as kPanel /
  // kTileFeatures strided streams. Each feature's sum runs in the same order either way.
  static constexpr int64_t kFewRows = kPackedLinearFewRows;
  static constexpr int kFewRowBlock = 4;
  static constexpr int64_t kStreamAhead = 2048;  // bfloat16 values
  static constexpr int kPanelVectors = kPanel / W;
  static_assert(kFewRowBlock <= kRows, "the sums buffer holds kRows rows");

  // Asks for the kStreamAhead-th step's lines after w (one step is 2 * kPanel values).
  static void prefetch_step_ahead(const bfloat16* w) {
    for (int line = 0; line < 2 * kPanel; line += 32) __builtin_prefetch(w + kStreamAhead + line, 0, 2);
  }

  // sums[r][j] = x[r] . panel feature j for j in [0, kVectorsNow * W); stream: ask for all of
  // each step's lines kStreamAhead values ahead (the panel's first pass).
  template <int kRowsNow, int kVectorsNow>
  static void panel_pass(const float* x, int64_t x_stride, const bfloat16* w, int64_t pairs, float* sums,
                         bool stream) {
    typename V::Reg acc[kRowsNow][kVectorsNow];
    for (int r = 0; r < kRowsNow; ++r) {
      for (int v = 0; v < kVectorsNow; ++v) acc[r][v] = V::zero();
    }
    for (int64_t k2 = 0; k2 < pairs; ++k2) {
      if (stream) prefetch_step_ahead(w);
      typename V::Reg a0[kRowsNow], a1[kRowsNow];
      for (int r = 0; r < kRowsNow; ++r) {
        a0[r] = V::set1(x[r * x_stride + 2 * k2]);
        a1[r] = V::set1(x[r * x_stride + 2 * k2 + 1]);
      }
      for (int v = 0; v < kVectorsNow; ++v) {
        typename V::Reg even, odd;
        V::load_pair_halves(w + 2 * W * v, even, odd);
        for (int r = 0; r < kRowsNow; ++r) {
          acc[r][v] = V::fmadd(a0[r], even, acc[r][v]);
          acc[r][v] = V::fmadd(a1[r], odd, acc[r][v]);
        }
      }
      w += 2 * kPanel;
    }
    for (int r = 0; r < kRowsNow; ++r) {
      for (int v = 0; v < kVectorsNow; ++v) V::store(sums + r * kPanel + v * W, acc[r][v]);
    }
  }

  template <int kRowsNow>
  static void half_panel_passes(const float* x, int64_t x_stride, const bfloat16* w, int64_t pairs, float* sums,
                                bool stream) {
    constexpr int kHalf = kPanelVectors / 2;
    panel_pass<kRowsNow, kHalf>(x, x_stride, w, pairs, sums, stream);
    panel_pass<kRowsNow, kPanelVectors - kHalf>(x, x_stride, w + 2 * kHalf * W, pairs, sums + kHalf * W, false);
  }

  // sums for rows in [1, kFewRowBlock].
  static void few_rows(int rows, const float* x, int64_t x_stride, const bfloat16* w, int64_t pairs, float* sums,
                       bool stream) {
    switch (rows) {
      case 1: return panel_pass<1, kPanelVectors>(x, x_stride, w, pairs, sums, stream);
      case 2: return panel_pass<2, kPanelVectors>(x, x_stride, w, pairs, sums, stream);
      case 3: return half_panel_passes<3>(x, x_stride, w, pairs, sums, stream);
      default: return half_panel_passes<4>(x, x_stride, w, pairs, sums, stream);
    }
  }

  // stream: this pass is the panel's first, and asks for all of each step's lines kStreamAhead
  // values ahead, so that the panel arrives as one sequential stream and the later passes find it
  // in L2.
  template <int kRowsNow>
  static void tile(const float* x, int64_t x_stride, const bfloat16* w, int64_t pairs, float* sums, bool stream) {
    typename V::Reg acc[kRowsNow][kVectors];
    for (int r = 0; r < kRowsNow; ++r) {
      for (int v = 0; v < kVectors; ++v) acc[r][v] = V::zero();
    }
    for (int64_t k2 = 0; k2 < pairs; ++k2) {
      if (stream) prefetch_step_ahead(w);
      typename V::Reg even[kVectors], odd[kVectors];
      for (int v = 0; v < kVectors; ++v) V::load_pair_halves(w + 2 * W * v, even[v], odd[v]);
      for (int r = 0; r < kRowsNow; ++r) {
        const typename V::Reg a0 = V::set1(x[r * x_stride + 2 * k2]);
        for (int v = 0; v < kVectors; ++v) acc[r][v] = V::fmadd(a0, even[v], acc[r][v]);
      }
      for (int r = 0; r < kRowsNow; ++r) {
        const typename V::Reg a1 = V::set1(x[r * x_stride + 2 * k2 + 1]);
        for (int v = 0; v < kVectors; ++v) acc[r][v] = V::fmadd(a1, odd[v], acc[r][v]);
      }
      w += 2 * kPanel;
    }
    for (int r = 0; r < kRowsNow; ++r) {
      for (int v = 0; v < kVectors; ++v) V::store(sums + r * kPanel + v * W, acc[r][v]);
    }
  }

  template <int kRowsNow = kRows>
  static void tile_rows(int rows, const float* x, int64_t x_stride, const bfloat16* w, int64_t pairs, float* sums,
                        bool stream) {
    if constexpr (kRowsNow >= 1) {
      if (rows == kRowsNow) {
        tile<kRowsNow>(x, x_stride, w, pairs, sums, stream);
      } else {
        tile_rows<kRowsNow - 1>(rows, x, x_stride, w, pairs, sums, stream);
      }
    }
  }

  // Bias, the gate_up activation and the store of one row's panel sums [kPanel].
  static void epilogue(const PackedLinearPanel& p, int64_t row, const float* sums) {
    if (p.silu_and_mul) {
      bfloat16* y = static_cast<bfloat16*>(p.out) + row * p.out_stride + p.first;
      int j = 0;
      for (; j + W <= p.width; j += W) {
        const auto gate = V::load(sums + j);
        const auto silu = V::mul(gate, V::reciprocal(V::add(V::set1(1.f), V::exp(V::sub(V::zero(), gate)))));
        V::store(y + j, V::mul(silu, V::load(sums + kGateUpHalfPanel + j)));
      }
      for (; j < p.width; ++j) {
        const float gate = sums[j];
        y[j] = from_float<bfloat16>(gate / (1.f + std::exp(-gate)) * sums[kGateUpHalfPanel + j]);
      }
      return;
    }
    const int64_t index = row * p.out_stride + p.first;
    for (int j = 0; j < p.width; ++j) {
      const float value = p.bias == nullptr ? sums[j] : sums[j] + to_float(p.bias[p.first + j]);
      if (p.out_is_float32) {
        static_cast<float*>(p.out)[index + j] = value;
      } else {
        static_cast<bfloat16*>(p.out)[index + j] = from_float<bfloat16>(value);
      }
    }
  }

  // The packed_linear table entry: panels [begin, end) of every row.
  static void run(void* out, int64_t out_stride, bool out_is_float32, bool silu_and_mul, const bfloat16* x,
                  int64_t x_stride, const bfloat16* packed, const bfloat16* bias, int64_t rows, int64_t in_features,
                  int64_t out_features, int64_t begin, int64_t end) {
    const int64_t pairs = (in_features + 1) / 2;
    const int64_t padded = 2 * pairs;  // an odd in_features ends on half a pair, whose partner is zero
    const int64_t panel_elems = pairs * 2 * kPanel;
    const int64_t features_per_panel = silu_and_mul ? kGateUpHalfPanel : kPanel;
    thread_local std::vector<float> widened;
    widened.resize(size_t(kChunkRows * padded));
    alignas(64) float sums[kRows * kPanel];
    for (int64_t chunk = 0; chunk < rows; chunk += kChunkRows) {
      const int64_t chunk_rows = std::min(kChunkRows, rows - chunk);
      for (int64_t r = 0; r < chunk_rows; ++r) {
        const bfloat16* src = x + (chunk + r) * x_stride;
        float* dst = widened.data() + r * padded;
        int64_t k = 0;
        for (; k + W <= in_features; k += W) V::store(dst + k, V::load(src + k));
        for (; k < padded; ++k) dst[k] = k < in_features ? to_float(src[k]) : 0.f;
      }
      for (int64_t panel = begin; panel < end; ++panel) {
        const int64_t first = panel * features_per_panel;
        const PackedLinearPanel p{out, out_stride, out_is_float32, silu_and_mul, x, x_stride,
                                  packed + panel * panel_elems, bias, in_features, first,
                                  int(std::min(features_per_panel, out_features - first))};
        const bool few = chunk_rows <= kFewRows;
        const int block_rows = few ? kFewRowBlock : kRows;
        for (int64_t r0 = 0; r0 < chunk_rows; r0 += block_rows) {
          const int rows_now = int(std::min<int64_t>(block_rows, chunk_rows - r0));
          const float* xr = widened.data() + r0 * padded;
          if (few) {
            few_rows(rows_now, xr, padded, p.w, pairs, sums, r0 == 0);
          } else {
            for (int s = 0; s < kPanel / kTileFeatures; ++s) {
              tile_rows(rows_now, xr, padded, p.w + 2 * kTileFeatures * s, pairs, sums + kTileFeatures * s,
                        r0 == 0 && s == 0);
            }
          }
          for (int r = 0; r < rows_now; ++r) epilogue(p, chunk + r0 + r, sums + r * kPanel);
        }
      }
    }
  }
};

}  // namespace
}  // namespace kvflow::cpu
