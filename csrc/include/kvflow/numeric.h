// Numeric helpers shared by the CPU and CUDA paths: the 16-bit float formats as plain bit
// containers, their conversions to and from float32, and the element type tags used by the
// torch-free kernels. No torch, no CUDA runtime: host code and device code both include this.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVFLOW_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVFLOW_HOST_DEVICE inline
#endif

namespace kvflow {

// bfloat16 and IEEE float16 as raw bits. The kernels convert to float32 at load and round
// back at store, so arithmetic never happens in 16 bits.
struct bfloat16 {
  uint16_t bits;
};
struct float16 {
  uint16_t bits;
};

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
constexpr int kNumDTypes = 3;

KVFLOW_HOST_DEVICE uint32_t float_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
}

KVFLOW_HOST_DEVICE float bits_float(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof(x));
  return x;
}

KVFLOW_HOST_DEVICE float to_float(float x) { return x; }

KVFLOW_HOST_DEVICE float to_float(bfloat16 x) { return bits_float(uint32_t(x.bits) << 16); }

// IEEE binary16 -> binary32, exact (every half value is representable as a float).
KVFLOW_HOST_DEVICE float to_float(float16 x) {
  const uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1fu;
  uint32_t mantissa = x.bits & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // inf / nan
  if (exponent != 0) return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_float(sign);  // signed zero
  // Subnormal half: normalise it into a float exponent.
  int shift = 0;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    ++shift;
  }
  mantissa &= 0x3ffu;
  return bits_float(sign | uint32_t(113 - shift) << 23 | (mantissa << 13));
}

template <typename T>
KVFLOW_HOST_DEVICE T from_float(float x);

template <>
KVFLOW_HOST_DEVICE float from_float<float>(float x) {
  return x;
}

// float32 -> bfloat16 with round-to-nearest-even; NaN stays a (quiet) NaN.
template <>
KVFLOW_HOST_DEVICE bfloat16 from_float<bfloat16>(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bfloat16{uint16_t((u >> 16) | 0x40u)};
  const uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return bfloat16{uint16_t((u + rounding_bias) >> 16)};
}

// float32 -> IEEE binary16 with round-to-nearest-even, overflow to inf, gradual underflow.
template <>
KVFLOW_HOST_DEVICE float16 from_float<float16>(float x) {
  const uint32_t u = float_bits(x);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs_bits = u & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return float16{uint16_t(sign | 0x7e00u)};  // nan
  if (abs_bits >= 0x477ff000u) return float16{uint16_t(sign | 0x7c00u)};  // rounds to >= 65520: inf
  if (abs_bits >= 0x38800000u) {                                           // normal half
    const uint32_t rounded = abs_bits + 0x0fffu + ((abs_bits >> 13) & 1u);
    return float16{uint16_t(sign | ((rounded - 0x38000000u) >> 13))};
  }
  if (abs_bits < 0x33000000u) return float16{sign};  // below half the smallest subnormal: zero
  // Subnormal half: shift the implicit-one mantissa right, rounding to nearest even.
  const uint32_t exponent = abs_bits >> 23;
  const uint32_t mantissa = (abs_bits & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - exponent;  // 14..24
  const uint32_t halfway = 1u << (shift - 1);
  uint32_t result = mantissa >> shift;
  const uint32_t remainder = mantissa & ((1u << shift) - 1u);
  if (remainder > halfway || (remainder == halfway && (result & 1u))) ++result;
  return float16{uint16_t(sign | result)};
}

}  // namespace kvflow
