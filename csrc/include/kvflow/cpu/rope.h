// rotary_embedding on the CPU, NeoX and GPT-J pairings (the twin of kvflow/rope.cuh).
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

}  // namespace
}  // namespace kvflow::cpu
