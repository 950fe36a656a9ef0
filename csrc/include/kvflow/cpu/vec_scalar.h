// One float per "vector": the portable fallback that every x86-64 (and any other CPU) runs.
#pragma once

#include <cmath>

#include "kvflow/numeric.h"

namespace kvflow::cpu {
namespace {  // private to each instruction-set translation unit (see kernels.h)

struct VecScalar {
  static constexpr int kWidth = 1;
  using Reg = float;

  static Reg zero() { return 0.f; }
  static Reg set1(float x) { return x; }
  template <typename T>
  static Reg load(const T* p) { return to_float(*p); }
  template <typename T>
  static void store(T* p, Reg v) { *p = from_float<T>(v); }
  static Reg add(Reg a, Reg b) { return a + b; }
  static Reg sub(Reg a, Reg b) { return a - b; }
  static Reg mul(Reg a, Reg b) { return a * b; }
  static Reg fmadd(Reg a, Reg b, Reg c) { return a * b + c; }
  static Reg reciprocal(Reg x) { return 1.f / x; }
  static Reg exp(Reg x) { return std::exp(x); }
  static float reduce_add(Reg a) { return a; }
  static float reduce_max(Reg a) { return a; }
  static Reg max(Reg a, Reg b) { return a > b ? a : b; }
  static bool any_nan(Reg a) { return a != a; }
  // Bit j set where lane j of a > lane j of b (false for NaN).
  static unsigned greater_mask(Reg a, Reg b) { return a > b ? 1u : 0u; }
  // lane j of the result = sum of the lanes of sums[j], for j < kWidth.
  static Reg transpose_sum(const Reg* sums) { return sums[0]; }
};

}  // namespace
}  // namespace kvflow::cpu
