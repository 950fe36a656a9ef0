// The CPU kernels, written once over a vector type V (VecScalar, VecAvx2, VecAvx512) and an
// element type T (float, float16, bfloat16). Every load widens to float32 and every store
// rounds once, so all three instruction sets compute the same float32 math; only the order of
// the sum-of-squares reduction differs.
//
// Everything here sits in an unnamed namespace: each instruction-set translation unit gets its
// own private copies, compiled for its own target, so the linker can never substitute an
// AVX-512 body for a baseline one (which would crash older CPUs).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "kvflow/cpu/kernel_table.h"
#include "kvflow/cpu/packed_linear.h"
#include "kvflow/cpu/vec_scalar.h"
#include "kvflow/numeric.h"

namespace kvflow::cpu {
namespace {

template <class V, typename T>
float sum_of_squares(const T* x, int64_t n) {
  constexpr int W = V::kWidth;
  typename V::Reg acc0 = V::zero(), acc1 = V::zero();
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    const auto a = V::load(x + i);
    const auto b = V::load(x + i + W);
    acc0 = V::fmadd(a, a, acc0);
    acc1 = V::fmadd(b, b, acc1);
  }
  for (; i + W <= n; i += W) {
    const auto a = V::load(x + i);
    acc0 = V::fmadd(a, a, acc0);
  }
  float sum = V::reduce_add(V::add(acc0, acc1));
  for (; i < n; ++i) {
    const float v = to_float(x[i]);
    sum += v * v;
  }
  return sum;
}

// out[i] = x[i] * scale * (weight[i] + weight_offset)
template <class V, typename T>
void scale_by_weight(T* out, const T* x, const T* weight, int64_t n, float scale, float weight_offset) {
  constexpr int W = V::kWidth;
  const auto vscale = V::set1(scale);
  const auto voffset = V::set1(weight_offset);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const auto w = V::add(V::load(weight + i), voffset);
    V::store(out + i, V::mul(V::mul(V::load(x + i), vscale), w));
  }
  for (; i < n; ++i) {
    out[i] = from_float<T>(to_float(x[i]) * scale * (to_float(weight[i]) + weight_offset));
  }
}

template <class V, typename T>
void rms_norm(void* out, int64_t out_stride, const void* input, int64_t in_stride, const void* weight,
              int64_t hidden, float eps, float weight_offset, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* x = static_cast<const T*>(input) + r * in_stride;
    T* y = static_cast<T*>(out) + r * out_stride;
    const float scale = 1.f / std::sqrt(sum_of_squares<V>(x, hidden) / float(hidden) + eps);
    scale_by_weight<V>(y, x, static_cast<const T*>(weight), hidden, scale, weight_offset);
  }
}

// residual = round(x + residual) first, then the norm of the rounded residual, so the result
// equals an unfused add followed by rms_norm in the same dtype.
template <class V, typename T>
void fused_add_rms_norm(void* input, int64_t in_stride, void* residual, int64_t res_stride,
                        const void* weight, int64_t hidden, float eps, float weight_offset, int64_t begin,
                        int64_t end) {
  constexpr int W = V::kWidth;
  for (int64_t r = begin; r < end; ++r) {
    T* x = static_cast<T*>(input) + r * in_stride;
    T* res = static_cast<T*>(residual) + r * res_stride;
    int64_t i = 0;
    for (; i + W <= hidden; i += W) V::store(res + i, V::add(V::load(x + i), V::load(res + i)));
    for (; i < hidden; ++i) res[i] = from_float<T>(to_float(x[i]) + to_float(res[i]));
    const float scale = 1.f / std::sqrt(sum_of_squares<V>(res, hidden) / float(hidden) + eps);
    scale_by_weight<V>(x, res, static_cast<const T*>(weight), hidden, scale, weight_offset);
  }
}

// NeoX style: x[i] and x[i + half] form a pair.
template <class V, typename T, typename C>
void rotate_neox(T* x, const C* cos, const C* sin, int64_t half) {
  constexpr int W = V::kWidth;
  int64_t i = 0;
  for (; i + W <= half; i += W) {
    const auto c = V::load(cos + i);
    const auto s = V::load(sin + i);
    const auto x1 = V::load(x + i);
    const auto x2 = V::load(x + half + i);
    V::store(x + i, V::sub(V::mul(x1, c), V::mul(x2, s)));
    V::store(x + half + i, V::fmadd(x1, s, V::mul(x2, c)));
  }
  for (; i < half; ++i) {
    const float c = to_float(cos[i]), s = to_float(sin[i]);
    const float x1 = to_float(x[i]), x2 = to_float(x[half + i]);
    x[i] = from_float<T>(x1 * c - x2 * s);
    x[half + i] = from_float<T>(x2 * c + x1 * s);
  }
}

// GPT-J style: x[2i] and x[2i + 1] form a pair. Interleaved pairs do not map onto plain vector
// loads; this layout is rare in Llama-family checkpoints, so it stays scalar.
template <typename T, typename C>
void rotate_gptj(T* x, const C* cos, const C* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float c = to_float(cos[i]), s = to_float(sin[i]);
    const float x1 = to_float(x[2 * i]), x2 = to_float(x[2 * i + 1]);
    x[2 * i] = from_float<T>(x1 * c - x2 * s);
    x[2 * i + 1] = from_float<T>(x2 * c + x1 * s);
  }
}

template <class V, typename T, typename C>
void rotate_heads(T* token, int64_t num_heads, int64_t head_size, const C* cos, const C* sin, int64_t half,
                  bool is_neox) {
  for (int64_t h = 0; h < num_heads; ++h) {
    T* x = token + h * head_size;
    if (is_neox) {
      rotate_neox<V>(x, cos, sin, half);
    } else {
      rotate_gptj(x, cos, sin, half);
    }
  }
}

template <class V, typename T, typename C>
void rotary_embedding(const RotaryArgs& a, int64_t begin, int64_t end) {
  const int64_t half = a.rotary_dim / 2;
  for (int64_t t = begin; t < end; ++t) {
    const C* cos = static_cast<const C*>(a.cos_sin) + a.positions[t] * a.rotary_dim;
    const C* sin = cos + half;
    rotate_heads<V>(static_cast<T*>(a.query) + t * a.q_stride, a.num_q_heads, a.head_size, cos, sin, half,
                    a.is_neox);
    if (a.key != nullptr) {
      rotate_heads<V>(static_cast<T*>(a.key) + t * a.k_stride, a.num_kv_heads, a.head_size, cos, sin, half,
                      a.is_neox);
    }
  }
}

struct Silu {
  template <class V>
  static typename V::Reg apply(typename V::Reg x) {
    return V::mul(x, V::reciprocal(V::add(V::set1(1.f), V::exp(V::mul(x, V::set1(-1.f))))));
  }
};

// 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), computed as x * sigmoid(2u):
// the same value, one exp and one reciprocal, and exact zeros/identities in both tails.
struct GeluTanh {
  template <class V>
  static typename V::Reg apply(typename V::Reg x) {
    const auto x3 = V::mul(V::mul(x, x), x);
    const auto minus_2u = V::mul(V::set1(-2.f * 0.7978845608028654f), V::fmadd(V::set1(0.044715f), x3, x));
    return V::mul(x, V::reciprocal(V::add(V::set1(1.f), V::exp(minus_2u))));
  }
};

// gelu(x) = x Phi(x) with erf from Abramowitz and Stegun 7.1.26 (|error| < 1.5e-7): with
// a = |x|, Phi(x) = 1 - q for x >= 0 and q for x < 0, where q = 0.5 poly(t) e^(-a^2/2), so that
// x Phi(x) = max(x, 0) - a q in both cases, without a branch or a select.
struct Gelu {
  template <class V>
  static typename V::Reg apply(typename V::Reg x) {
    const auto a = V::max(x, V::sub(V::zero(), x));
    const auto z = V::mul(a, V::set1(0.7071067811865476f));
    const auto t = V::reciprocal(V::fmadd(V::set1(0.3275911f), z, V::set1(1.f)));
    auto poly = V::fmadd(V::set1(1.061405429f), t, V::set1(-1.453152027f));
    poly = V::fmadd(poly, t, V::set1(1.421413741f));
    poly = V::fmadd(poly, t, V::set1(-0.284496736f));
    poly = V::fmadd(poly, t, V::set1(0.254829592f));
    poly = V::mul(poly, t);
    const auto q = V::mul(V::mul(V::set1(0.5f), poly), V::exp(V::mul(V::mul(z, z), V::set1(-1.f))));
    return V::sub(V::max(x, V::zero()), V::mul(a, q));
  }
};

template <class V, class Act, typename T>
void gated_activation(void* out, int64_t out_stride, const void* input, int64_t in_stride, int64_t d,
                      int64_t begin, int64_t end) {
  constexpr int W = V::kWidth;
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = static_cast<const T*>(input) + r * in_stride;
    const T* up = gate + d;
    T* y = static_cast<T*>(out) + r * out_stride;
    int64_t i = 0;
    // Two independent vectors per iteration: the activation is a long dependency chain.
    for (; i + 2 * W <= d; i += 2 * W) {
      const auto a = Act::template apply<V>(V::load(gate + i));
      const auto b = Act::template apply<V>(V::load(gate + i + W));
      V::store(y + i, V::mul(a, V::load(up + i)));
      V::store(y + i + W, V::mul(b, V::load(up + i + W)));
    }
    for (; i + W <= d; i += W) {
      V::store(y + i, V::mul(Act::template apply<V>(V::load(gate + i)), V::load(up + i)));
    }
    for (; i < d; ++i) {
      const float g = Act::template apply<VecScalar>(to_float(gate[i]));
      y[i] = from_float<T>(g * to_float(up[i]));
    }
  }
}

}  // namespace
}  // namespace kvflow::cpu

#include "kvflow/cpu/attention.h"

namespace kvflow::cpu {
namespace {

// -inf (a masked token) is legal; *non_finite reports a NaN or a +inf.
template <class V, typename T>
float row_max(const void* input, int64_t n, bool* non_finite) {
  constexpr int W = V::kWidth;
  const T* x = static_cast<const T*>(input);
  auto vmax = V::set1(-std::numeric_limits<float>::infinity());
  bool nan = false;
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const auto v = V::load(x + i);
    vmax = V::max(vmax, v);
    nan |= V::any_nan(v);
  }
  float m = V::reduce_max(vmax);
  for (; i < n; ++i) {
    const float v = to_float(x[i]);
    m = v > m ? v : m;
    nan |= v != v;
  }
  *non_finite = nan || m == std::numeric_limits<float>::infinity();
  return m;
}

template <class V, typename T>
double exp_sum(const void* input, int64_t n, float max, float inv_temperature, float* p) {
  constexpr int W = V::kWidth;
  const T* x = static_cast<const T*>(input);
  const auto vmax = V::set1(max), vscale = V::set1(inv_temperature);
  auto acc = V::zero();
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const auto e = V::exp(V::mul(V::sub(V::load(x + i), vmax), vscale));
    V::store(p + i, e);
    acc = V::add(acc, e);
  }
  double sum = V::reduce_add(acc);
  for (; i < n; ++i) {
    p[i] = std::exp((to_float(x[i]) - max) * inv_temperature);
    sum += p[i];
  }
  return sum;
}

template <class V, typename T>
int64_t collect_greater(const void* input, int64_t begin, int64_t end, float threshold, int32_t* out) {
  constexpr int W = V::kWidth;
  const T* x = static_cast<const T*>(input);
  const auto vthr = V::set1(threshold);
  int64_t count = 0, i = begin;
  for (; i + W <= end; i += W) {
    unsigned mask = V::greater_mask(V::load(x + i), vthr);
    while (mask != 0) {
      out[count++] = int32_t(i + __builtin_ctz(mask));
      mask &= mask - 1;
    }
  }
  for (; i < end; ++i) {
    if (to_float(x[i]) > threshold) out[count++] = int32_t(i);
  }
  return count;
}

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

template <class V, typename T>
void fill_row_entries(KernelTable& t, DType dtype) {
  t.row_max[int(dtype)] = row_max<V, T>;
  t.exp_sum[int(dtype)] = exp_sum<V, T>;
  t.collect_greater[int(dtype)] = collect_greater<V, T>;
  t.small_linear[int(dtype)] = small_linear<V, T>;
}

template <class V, typename T>
void fill_attention_row(PagedAttentionFn (&row)[3]) {
  row[0] = paged_attention<V, T, 64>;
  row[1] = paged_attention<V, T, 128>;
  row[2] = paged_attention<V, T, 256>;
}

template <class V>
KernelTable make_kernel_table(const char* isa) {
  KernelTable t{};
  t.isa = isa;
  t.rms_norm[int(DType::kFloat32)] = rms_norm<V, float>;
  t.rms_norm[int(DType::kFloat16)] = rms_norm<V, float16>;
  t.rms_norm[int(DType::kBFloat16)] = rms_norm<V, bfloat16>;
  t.fused_add_rms_norm[int(DType::kFloat32)] = fused_add_rms_norm<V, float>;
  t.fused_add_rms_norm[int(DType::kFloat16)] = fused_add_rms_norm<V, float16>;
  t.fused_add_rms_norm[int(DType::kBFloat16)] = fused_add_rms_norm<V, bfloat16>;
  t.rotary_embedding[int(DType::kFloat32)][0] = rotary_embedding<V, float, float>;
  t.rotary_embedding[int(DType::kFloat32)][1] = rotary_embedding<V, float, float>;
  t.rotary_embedding[int(DType::kFloat16)][0] = rotary_embedding<V, float16, float>;
  t.rotary_embedding[int(DType::kFloat16)][1] = rotary_embedding<V, float16, float16>;
  t.rotary_embedding[int(DType::kBFloat16)][0] = rotary_embedding<V, bfloat16, float>;
  t.rotary_embedding[int(DType::kBFloat16)][1] = rotary_embedding<V, bfloat16, bfloat16>;
  t.silu_and_mul[int(DType::kFloat32)] = gated_activation<V, Silu, float>;
  t.silu_and_mul[int(DType::kFloat16)] = gated_activation<V, Silu, float16>;
  t.silu_and_mul[int(DType::kBFloat16)] = gated_activation<V, Silu, bfloat16>;
  t.gelu_tanh_and_mul[int(DType::kFloat32)] = gated_activation<V, GeluTanh, float>;
  t.gelu_tanh_and_mul[int(DType::kFloat16)] = gated_activation<V, GeluTanh, float16>;
  t.gelu_tanh_and_mul[int(DType::kBFloat16)] = gated_activation<V, GeluTanh, bfloat16>;
  t.gelu_and_mul[int(DType::kFloat32)] = gated_activation<V, Gelu, float>;
  t.gelu_and_mul[int(DType::kFloat16)] = gated_activation<V, Gelu, float16>;
  t.gelu_and_mul[int(DType::kBFloat16)] = gated_activation<V, Gelu, bfloat16>;
  fill_attention_row<V, float>(t.paged_attention[int(DType::kFloat32)]);
  fill_attention_row<V, float16>(t.paged_attention[int(DType::kFloat16)]);
  fill_attention_row<V, bfloat16>(t.paged_attention[int(DType::kBFloat16)]);
  fill_row_entries<V, float>(t, DType::kFloat32);
  fill_row_entries<V, float16>(t, DType::kFloat16);
  fill_row_entries<V, bfloat16>(t, DType::kBFloat16);
  t.packed_linear = packed_linear_panels<PackedLinearGeneric>;
  return t;
}

}  // namespace
}  // namespace kvflow::cpu
