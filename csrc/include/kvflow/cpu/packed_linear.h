// packed_linear's loop over panels and row blocks, and its kernel written once in plain C++
// (each instruction set's compiler vectorises the loops over a panel's features). CPUs with
// AVX-512 BF16 run packed_linear_avx512_bf16.h's kernel in the same loop.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvflow/cpu/kernel_table.h"
#include "kvflow/numeric.h"

namespace kvflow::cpu {
namespace {

// One panel of packed_linear's weight and where its results go.
struct PackedLinearPanel {
  void* out;  // [rows, out_features], row stride out_stride
  int64_t out_stride;
  bool out_is_float32;
  bool silu_and_mul;  // a gate_up panel: out = silu(first half) * second half
  const bfloat16* x;  // [rows, in_features], row stride x_stride
  int64_t x_stride;
  const bfloat16* w;     // the panel: [ceil(in_features / 2)][kPackedLinearPanel][2]
  const bfloat16* bias;  // [out_features] or null
  int64_t in_features;
  int64_t first;  // the panel's first output feature
  int width;      // how many of its output features exist: up to kPackedLinearPanel, or up to
                  // kGateUpHalfPanel with silu_and_mul (fewer in the last panel)
};

// Calls Kernel::run<rows>(panel, r0) for a runtime row count of 1 to kRows.
template <class Kernel, int kRows = Kernel::kMaxRows>
inline void run_panel_rows(int rows, const PackedLinearPanel& panel, int64_t r0) {
  if constexpr (kRows >= 1) {
    if (rows == kRows) {
      Kernel::template run<kRows>(panel, r0);
    } else {
      run_panel_rows<Kernel, kRows - 1>(rows, panel, r0);
    }
  }
}

// Panels [begin, end) for every row, in blocks of kRowChunk rows x one panel x Kernel::kMaxRows
// rows at a time. A panel (55 KB at 576 input features) stays in L2 while a chunk's rows pass
// over it, and the chunk's rows (295 KB) stay there while the panels stream past: prefill's
// 2048 rows would otherwise be fetched again from L3 for every panel.
constexpr int64_t kRowChunk = 256;

template <class Kernel>
void packed_linear_panels(void* out, int64_t out_stride, bool out_is_float32, bool silu_and_mul, const bfloat16* x,
                          int64_t x_stride, const bfloat16* packed, const bfloat16* bias, int64_t rows,
                          int64_t in_features, int64_t out_features, int64_t begin, int64_t end) {
  const int64_t panel_elems = (in_features + 1) / 2 * 2 * kPackedLinearPanel;
  const int64_t features_per_panel = silu_and_mul ? kGateUpHalfPanel : kPackedLinearPanel;
  for (int64_t chunk = 0; chunk < rows; chunk += kRowChunk) {
    const int64_t chunk_end = std::min(rows, chunk + kRowChunk);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t first = p * features_per_panel;
      const PackedLinearPanel panel{out, out_stride, out_is_float32, silu_and_mul, x, x_stride,
                                    packed + p * panel_elems, bias, in_features, first,
                                    int(std::min(features_per_panel, out_features - first))};
      for (int64_t r0 = chunk; r0 < chunk_end; r0 += Kernel::kMaxRows) {
        run_panel_rows<Kernel>(int(std::min<int64_t>(Kernel::kMaxRows, chunk_end - r0)), panel, r0);
      }
    }
  }
}

struct PackedLinearGeneric {
  static constexpr int kMaxRows = 4;

  template <int kRows>
  static void run(const PackedLinearPanel& p, int64_t r0) {
    constexpr int kWidth = int(kPackedLinearPanel);
    float acc[kRows][kWidth] = {};
    const int64_t pairs = (p.in_features + 1) / 2;
    for (int64_t k2 = 0; k2 < pairs; ++k2) {
      const bfloat16* wp = p.w + k2 * 2 * kWidth;
      float even[kWidth], odd[kWidth];
      for (int j = 0; j < kWidth; ++j) {
        even[j] = to_float(wp[2 * j]);
        odd[j] = to_float(wp[2 * j + 1]);
      }
      for (int r = 0; r < kRows; ++r) {
        const bfloat16* xr = p.x + (r0 + r) * p.x_stride;
        const float a0 = to_float(xr[2 * k2]);
        // An odd in_features ends on half a pair: its packed partner is zero, and x has no value there.
        const float a1 = 2 * k2 + 1 < p.in_features ? to_float(xr[2 * k2 + 1]) : 0.f;
        for (int j = 0; j < kWidth; ++j) acc[r][j] += a0 * even[j] + a1 * odd[j];
      }
    }
    for (int r = 0; r < kRows; ++r) {
      if (p.silu_and_mul) {
        for (int j = 0; j < p.width; ++j) {
          const float gate = acc[r][j], up = acc[r][kGateUpHalfPanel + j];
          static_cast<bfloat16*>(p.out)[(r0 + r) * p.out_stride + p.first + j] =
              from_float<bfloat16>(gate / (1.f + std::exp(-gate)) * up);
        }
        continue;
      }
      for (int j = 0; j < p.width; ++j) {
        const int64_t o = p.first + j;
        const float y = p.bias == nullptr ? acc[r][j] : acc[r][j] + to_float(p.bias[o]);
        const int64_t index = (r0 + r) * p.out_stride + o;
        if (p.out_is_float32) {
          static_cast<float*>(p.out)[index] = y;
        } else {
          static_cast<bfloat16*>(p.out)[index] = from_float<bfloat16>(y);
        }
      }
    }
  }
};

}  // namespace
}  // namespace kvflow::cpu
