// rms_norm, fused_add_rms_norm and rms_norm_add on the CPU, over a vector type V and an element type T (the
// twin of kvflow/norm.cuh).
// Included by kernels.h, inside each instruction set's translation unit: everything sits in an
// unnamed namespace (see kernels.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvflow/cpu/kernel_table.h"
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

// residual += round(rms_norm(x)): the norm rounded to T first, so the result equals an unfused
// rms_norm followed by the add in T (the post-norms of OLMo 2).
template <class V, typename T>
void rms_norm_add(void* residual, int64_t res_stride, const void* input, int64_t in_stride, const void* weight,
                  int64_t hidden, float eps, float weight_offset, int64_t begin, int64_t end) {
  constexpr int W = V::kWidth;
  constexpr int64_t kChunk = 256;  // normed in a buffer that stays in L1, then added
  static_assert(kChunk % W == 0);
  T normed[kChunk];
  for (int64_t r = begin; r < end; ++r) {
    const T* x = static_cast<const T*>(input) + r * in_stride;
    T* res = static_cast<T*>(residual) + r * res_stride;
    const float scale = 1.f / std::sqrt(sum_of_squares<V>(x, hidden) / float(hidden) + eps);
    for (int64_t c = 0; c < hidden; c += kChunk) {
      const int64_t n = std::min(kChunk, hidden - c);
      scale_by_weight<V>(normed, x + c, static_cast<const T*>(weight) + c, n, scale, weight_offset);
      int64_t i = 0;
      for (; i + W <= n; i += W) V::store(res + c + i, V::add(V::load(res + c + i), V::load(normed + i)));
      for (; i < n; ++i) res[c + i] = from_float<T>(to_float(res[c + i]) + to_float(normed[i]));
    }
  }
}

}  // namespace
}  // namespace kvflow::cpu
