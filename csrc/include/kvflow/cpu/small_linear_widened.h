// small_linear for bfloat16 weights on vector units without bf16 dot products (AVX2): each
// 32-bit lane of a weight load holds two neighbouring bf16 weights, widened in place, the even
// one by a shift and the odd one by a mask (V::load_pair_halves). The input rows are widened
// once per call into float32, even and odd positions apart, so that the loop spends two
// integer ops per 16 weights rather than a widening per 8 weights and per 8 inputs, which
// left one or two rows bound by the shift/shuffle ports instead of by memory.
// Include only inside a translation unit compiled for V's instruction set, after kernels.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kvflow::cpu {
namespace {  // private to each instruction-set translation unit (see kernels.h)

template <class V>
struct SmallLinearWidened {
  static constexpr int W = V::kWidth;
  static constexpr int kPair = 2 * W;  // weights per load_pair_halves
  // One or two rows read the weights as one sequential stream per thread; asking for the bytes
  // 4 KiB ahead keeps more of it in flight than the hardware prefetcher does on its own
  // (docs/benchmarks.md, AVX2 section).
  static constexpr int64_t kStreamAhead = 2048;  // bfloat16 weights

  // Row r's input as float32: for each whole block of kPair positions, its W even positions,
  // then its W odd ones; the positions after the last whole block are not stored.
  static const float* widen_inputs(const bfloat16* x, int64_t rows, int64_t in_features) {
    thread_local std::vector<float> widened;
    const int64_t blocks = in_features / kPair;
    widened.resize(size_t(std::max<int64_t>(1, rows * blocks * kPair)));
    for (int64_t r = 0; r < rows; ++r) {
      const bfloat16* row = x + r * in_features;
      float* out = widened.data() + r * blocks * kPair;
      for (int64_t k = 0; k < blocks * kPair; k += kPair) {
        typename V::Reg even, odd;
        V::load_pair_halves(row + k, even, odd);
        V::store(out + k, even);
        V::store(out + k + W, odd);
      }
    }
    return widened.data();
  }

  template <int kOut, int kRows>
  static void tile(const LinearOut<bfloat16>& y, int64_t y_index, const bfloat16* x, const float* xw,
                   const bfloat16* w, const bfloat16* b, int64_t in_features, int64_t out_features) {
    // Fewer than four dot products in the tile would wait on the FMA's latency: each then keeps
    // kChains sums, the even and odd halves of kSteps interleaved blocks apart. Four or more
    // keep one sum each, so that a 4 x 4 tile's accumulators stay in registers.
    constexpr int kChains = kRows * kOut >= 4 ? 1 : 4 / (kRows * kOut);
    constexpr int kSteps = kChains > 2 ? kChains / 2 : 1;
    const int64_t blocks = in_features / kPair;
    const int64_t x_stride = blocks * kPair;
    typename V::Reg acc[kChains][kRows][kOut];
    for (int c = 0; c < kChains; ++c) {
      for (int r = 0; r < kRows; ++r) {
        for (int o = 0; o < kOut; ++o) acc[c][r][o] = V::zero();
      }
    }
    // As in small_linear_tile: the same position two blocks of kOut rows ahead goes to L2.
    const int64_t ahead = 2 * kOut * in_features;
    auto block_at = [&](int64_t k, int even_chain, int odd_chain) {
      typename V::Reg we[kOut], wo[kOut];
      for (int o = 0; o < kOut; ++o) {
        if constexpr (kOut > 1) {
          __builtin_prefetch(w + ahead + o * in_features + k, 0, 2);
        } else {
          __builtin_prefetch(w + o * in_features + k + kStreamAhead, 0, 2);
        }
        V::load_pair_halves(w + o * in_features + k, we[o], wo[o]);
      }
      for (int r = 0; r < kRows; ++r) {
        const auto xe = V::load(xw + r * x_stride + k);
        const auto xo = V::load(xw + r * x_stride + k + W);
        for (int o = 0; o < kOut; ++o) {
          acc[even_chain][r][o] = V::fmadd(xe, we[o], acc[even_chain][r][o]);
          acc[odd_chain][r][o] = V::fmadd(xo, wo[o], acc[odd_chain][r][o]);
        }
      }
    };
    int64_t block = 0;
    for (; block + kSteps <= blocks; block += kSteps) {
      for (int s = 0; s < kSteps; ++s) block_at((block + s) * kPair, (2 * s) % kChains, (2 * s + 1) % kChains);
    }
    for (; block < blocks; ++block) block_at(block * kPair, 0, kChains > 1 ? 1 : 0);
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
      for (int o = 0; o < kOut; ++o) {
        typename V::Reg sum = acc[0][r][o];
        for (int c = 1; c < kChains; ++c) sum = V::add(sum, acc[c][r][o]);
        float total = V::reduce_add(sum);
        for (int64_t kk = blocks * kPair; kk < in_features; ++kk) {
          total += to_float(x[r * in_features + kk]) * to_float(w[o * in_features + kk]);
        }
        if (b != nullptr) total += to_float(b[o]);
        y.store(y_index + r * out_features + o, total);
      }
    }
  }

  struct Tile {
    LinearOut<bfloat16> y;
    int64_t y_index;  // of output (r0, o)
    const bfloat16* x;
    const float* xw;
    const bfloat16* w;
    const bfloat16* b;
    int64_t in_features, out_features;

    template <int kOut, int kRows>
    void run() const {
      tile<kOut, kRows>(y, y_index, x, xw, w, b, in_features, out_features);
    }
  };

  static void run(void* out, bool out_is_float32, const void* input, const void* weight, const void* bias,
                  int64_t rows, int64_t in_features, int64_t out_features, int64_t begin, int64_t end) {
    const auto* x = static_cast<const bfloat16*>(input);
    const auto* w = static_cast<const bfloat16*>(weight);
    const auto* b = static_cast<const bfloat16*>(bias);
    const float* xw = widen_inputs(x, rows, in_features);
    const int64_t x_stride = in_features / kPair * kPair;
    const LinearOut<bfloat16> y{out, out_is_float32};
    small_linear_blocks(rows, begin, end, [&](int64_t o, int64_t r0) {
      return Tile{y, r0 * out_features + o, x + r0 * in_features, xw + r0 * x_stride, w + o * in_features,
                  b == nullptr ? nullptr : b + o, in_features, out_features};
    });
  }
};

}  // namespace
}  // namespace kvflow::cpu
