// exp(x) for a SIMD register, shared by the AVX2 and AVX-512 vector types.
// Include only inside a translation unit compiled for that instruction set.
#pragma once

namespace kvflow::cpu {
namespace {  // private to each instruction-set translation unit (see kernels.h)

// Cody-Waite range reduction x = n ln2 + r, |r| <= ln2/2, then a degree-6 polynomial for e^r
// and 2^n built in the exponent field. Relative error about 2 ulp over the clamped range;
// inputs are clamped so that the result stays finite and normal (e^-87.3 .. e^88.3).
template <class V>
inline typename V::Reg vec_exp(typename V::Reg x) {
  using Reg = typename V::Reg;
  x = V::min(V::max(x, V::set1(-87.3f)), V::set1(88.3f));
  const Reg n = V::round(V::mul(x, V::set1(1.44269504088896341f)));
  Reg r = V::fmadd(n, V::set1(-0.693359375f), x);
  r = V::fmadd(n, V::set1(2.12194440e-4f), r);
  Reg p = V::set1(1.0f / 720.0f);
  p = V::fmadd(p, r, V::set1(1.0f / 120.0f));
  p = V::fmadd(p, r, V::set1(1.0f / 24.0f));
  p = V::fmadd(p, r, V::set1(1.0f / 6.0f));
  p = V::fmadd(p, r, V::set1(0.5f));
  p = V::fmadd(p, r, V::set1(1.0f));
  p = V::fmadd(p, r, V::set1(1.0f));
  return V::ldexp(p, n);
}

}  // namespace
}  // namespace kvflow::cpu
