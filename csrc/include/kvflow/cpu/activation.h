// The gated activations act(gate) * up on the CPU: SiLU, GELU (tanh and erf) (the twin of
// kvflow/activation.cuh).
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
