// small_linear on the CPU: the few-row product of decode, bound by reading the weights once.
// Included by kernels.h, inside each instruction set's translation unit: everything sits in an
// unnamed namespace (see kernels.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvflow/cpu/batch_invariance.h"
#include "kvflow/cpu/kernel_table.h"
#include "kvflow/cpu/vec_scalar.h"
#include "kvflow/numeric.h"

namespace kvflow::cpu {
namespace {

// One tile of small_linear: kOut consecutive output features times kRows input rows. Each
// weight vector loaded serves kRows dot products and each input vector kOut, which keeps up to
// eight rows bound by reading the weights rather than by loads.
// small_linear's output: of the weights' type T, or float32.
template <typename T>
struct LinearOut {
  void* base;  // [rows, out_features]
  bool is_float32;

  void store(int64_t index, float value) const {
    if (is_float32) {
      static_cast<float*>(base)[index] = value;
    } else {
      static_cast<T*>(base)[index] = from_float<T>(value);
    }
  }
};

template <class V, typename T, int kOut, int kRows>
inline void small_linear_tile(const LinearOut<T>& y, int64_t y_index, const T* x, const T* w, const T* b,
                              int64_t in_features, int64_t out_features) {
  constexpr int W = V::kWidth;
  // Fewer than four dot products would wait on the FMA's latency (4 cycles) rather than on
  // the weights: those keep kSplit partial sums each, over interleaved vectors of k.
  constexpr int kSplit = kRows * kOut >= 4 ? 1 : 4 / (kRows * kOut);
  typename V::Reg acc[kRows][kOut];
  for (int r = 0; r < kRows; ++r) {
    for (int o = 0; o < kOut; ++o) acc[r][o] = V::zero();
  }
  // The same position two blocks of kOut rows ahead goes to L2 while this block is read: the
  // rows are too short for the hardware prefetcher to follow kOut streams at once, and L1 is
  // left to the rows being read (at 4-8 input rows they are read once per row block).
  const int64_t ahead = 2 * kOut * in_features;
  int64_t k = 0;
  if constexpr (kSplit > 1) {
    typename V::Reg part[kSplit - 1][kRows][kOut];
    for (int i = 0; i < kSplit - 1; ++i) {
      for (int r = 0; r < kRows; ++r) {
        for (int o = 0; o < kOut; ++o) part[i][r][o] = V::zero();
      }
    }
    for (; k + kSplit * W <= in_features; k += kSplit * W) {
      for (int r = 0; r < kRows; ++r) {
        for (int o = 0; o < kOut; ++o) {
          acc[r][o] = V::fmadd(V::load(x + r * in_features + k), V::load(w + o * in_features + k), acc[r][o]);
          for (int i = 0; i < kSplit - 1; ++i) {
            const int64_t ki = k + (i + 1) * W;
            part[i][r][o] = V::fmadd(V::load(x + r * in_features + ki), V::load(w + o * in_features + ki), part[i][r][o]);
          }
        }
      }
    }
    for (int i = 0; i < kSplit - 1; ++i) {
      for (int r = 0; r < kRows; ++r) {
        for (int o = 0; o < kOut; ++o) acc[r][o] = V::add(acc[r][o], part[i][r][o]);
      }
    }
  }
  for (; k + W <= in_features; k += W) {
    typename V::Reg wv[kOut];
    if constexpr (kOut > 1) {
      for (int o = 0; o < kOut; ++o) __builtin_prefetch(w + ahead + o * in_features + k, 0, 2);
    }
    for (int o = 0; o < kOut; ++o) wv[o] = V::load(w + o * in_features + k);
    for (int r = 0; r < kRows; ++r) {
      const auto xv = V::load(x + r * in_features + k);
      for (int o = 0; o < kOut; ++o) acc[r][o] = V::fmadd(xv, wv[o], acc[r][o]);
    }
  }
  // Fully unrolled, so that every accumulator is a named register rather than stack memory.
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
    for (int o = 0; o < kOut; ++o) {
      float sum = V::reduce_add(acc[r][o]);
      for (int64_t kk = k; kk < in_features; ++kk) sum += to_float(x[r * in_features + kk]) * to_float(w[o * in_features + kk]);
      if (b != nullptr) sum += to_float(b[o]);
      y.store(y_index + r * out_features + o, sum);
    }
  }
}

// Calls tile.run<kOut, rows>() for a runtime row count of 1 to 4.
template <int kOut, class Tile>
inline void dispatch_rows(int rows, const Tile& tile) {
  switch (rows) {
    case 1: tile.template run<kOut, 1>(); break;
    case 2: tile.template run<kOut, 2>(); break;
    case 3: tile.template run<kOut, 3>(); break;
    default: tile.template run<kOut, 4>(); break;
  }
}

// Output features in blocks of four, and for each block every row, four at a time: the block's
// weights come from memory once and from L1/L2 for the further rows. tile_at(o, r0) returns a
// Tile whose run<kOut, kRows>() computes outputs [o, o + kOut) of rows [r0, r0 + kRows).
// One or two rows take one output feature at a time instead: the weights then stream as one
// sequential read per thread, which the hardware prefetcher follows at the machine's full
// bandwidth (measured 46 GB/s against 40 for four-row tiles with software prefetch, when the
// machine reads at 47), and a tile of four dot products is not needed to hide arithmetic.
template <class TileAt>
inline void small_linear_blocks(int64_t rows, int64_t begin, int64_t end, const TileAt& tile_at) {
  constexpr int kOutBlock = 4, kRowBlock = 4;
  int64_t o = begin;
  if (batch_invariant()) {  // one accumulator per dot product (kSplit 1) at every row count
    for (; o + kOutBlock <= end; o += kOutBlock) {
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
        dispatch_rows<kOutBlock>(int(std::min<int64_t>(kRowBlock, rows - r0)), tile_at(o, r0));
      }
    }
    for (; o < end; ++o) {  // a last feature or three past the tiles: one row at a time
      for (int64_t r = 0; r < rows; ++r) dispatch_rows<1>(1, tile_at(o, r));
    }
    return;
  }
  if (rows <= 2) {
    for (; o < end; ++o) dispatch_rows<1>(int(rows), tile_at(o, 0));
    return;
  }
  for (; o + kOutBlock <= end; o += kOutBlock) {
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
      dispatch_rows<kOutBlock>(int(std::min<int64_t>(kRowBlock, rows - r0)), tile_at(o, r0));
    }
  }
  for (; o < end; ++o) {
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
      dispatch_rows<1>(int(std::min<int64_t>(kRowBlock, rows - r0)), tile_at(o, r0));
    }
  }
}

template <class V, typename T>
struct SmallLinearTile {
  LinearOut<T> y;
  int64_t y_index;  // of output (r0, o)
  const T* x;
  const T* w;
  const T* b;
  int64_t in_features, out_features;

  template <int kOut, int kRows>
  void run() const {
    small_linear_tile<V, T, kOut, kRows>(y, y_index, x, w, b, in_features, out_features);
  }
};

template <class V, typename T>
void small_linear(void* out, bool out_is_float32, const void* input, const void* weight, const void* bias,
                  int64_t rows, int64_t in_features, int64_t out_features, int64_t begin, int64_t end) {
  const T* x = static_cast<const T*>(input);
  const T* w = static_cast<const T*>(weight);
  const T* b = static_cast<const T*>(bias);
  const LinearOut<T> y{out, out_is_float32};
  small_linear_blocks(rows, begin, end, [&](int64_t o, int64_t r0) {
    return SmallLinearTile<V, T>{y, r0 * out_features + o, x + r0 * in_features, w + o * in_features,
                                 b == nullptr ? nullptr : b + o, in_features, out_features};
  });
}

}  // namespace
}  // namespace kvflow::cpu
