// A family's last step on the LM head's logits, on the CPU (the twin of kvflow/logits.cuh):
// x / divisor (Granite's logits_scaling), then cap * tanh(x / cap) where cap > 0 (Gemma 2's final
// soft cap), with tanh(z) = 2 / (1 + exp(-2z)) - 1.
// Included by kernels.h, inside each instruction set's translation unit: everything sits in an
// unnamed namespace (see kernels.h).
#pragma once

#include <algorithm>
#include <cstdint>

#include "kvflow/cpu/kernel_table.h"

namespace kvflow::cpu {
namespace {

template <class V>
typename V::Reg scale_and_cap(typename V::Reg x, float inv_divisor, float soft_cap) {
  x = V::mul(x, V::set1(inv_divisor));
  if (soft_cap <= 0.f) return x;
  const auto e = V::exp(V::mul(x, V::set1(-2.f / soft_cap)));
  const auto tanh_x = V::fmadd(V::set1(2.f), V::reciprocal(V::add(V::set1(1.f), e)), V::set1(-1.f));
  return V::mul(tanh_x, V::set1(soft_cap));
}

// x[0, n) in place. The tail shorter than a vector goes through a padded copy, so every value
// comes out of the same vector arithmetic wherever a thread's share of a row begins or ends.
template <class V>
void scale_logits(float* x, int64_t n, float inv_divisor, float soft_cap) {
  constexpr int W = V::kWidth;
  int64_t i = 0;
  for (; i + W <= n; i += W) V::store(x + i, scale_and_cap<V>(V::load(x + i), inv_divisor, soft_cap));
  if (i < n) {
    float tail[W] = {};
    std::copy(x + i, x + n, tail);
    V::store(tail, scale_and_cap<V>(V::load(tail), inv_divisor, soft_cap));
    std::copy(tail, tail + (n - i), x + i);
  }
}

}  // namespace
}  // namespace kvflow::cpu
