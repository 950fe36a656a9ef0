// The sampler's vectorised passes over a row of logits on the CPU: its max, exp and sum, and
// the indices above a threshold (the twin of kvflow/sampling.cuh; the selections that use them
// are in cpu/sampling_select.h).
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

}  // namespace
}  // namespace kvflow::cpu
