// The numeric conversions and the CPU kernel tables, without torch: every instruction set the
// CPU supports must agree with the scalar table.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "kvflow/cpu/kernel_table.h"
#include "kvflow/numeric.h"

using namespace kvflow;
using namespace kvflow::cpu;

namespace {

const KernelTable& table_named(const std::string& isa) {
  set_isa(isa);
  return active_kernels();
}

std::vector<float> random_floats(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

bool close(float a, float b, float tol) { return std::fabs(a - b) <= tol * (1.f + std::fabs(b)); }

}  // namespace

KVFLOW_TEST(half_round_trips_every_value) {
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const float16 h{uint16_t(bits)};
    const float f = to_float(h);
    if (std::isnan(f)) {
      KVFLOW_CHECK(std::isnan(to_float(from_float<float16>(f))));
      continue;
    }
    KVFLOW_CHECK(from_float<float16>(f).bits == h.bits);
  }
}

KVFLOW_TEST(half_rounds_to_nearest_even_and_saturates) {
  KVFLOW_CHECK(to_float(from_float<float16>(1.f + 1.f / 2048)) == 1.f);            // tie -> even
  KVFLOW_CHECK(to_float(from_float<float16>(1.f + 3.f / 2048)) == 1.f + 2.f / 1024);  // tie -> even
  KVFLOW_CHECK(std::isinf(to_float(from_float<float16>(65520.f))));
  KVFLOW_CHECK(to_float(from_float<float16>(65519.f)) == 65504.f);
  KVFLOW_CHECK(to_float(from_float<float16>(std::ldexp(1.f, -24))) == std::ldexp(1.f, -24));  // smallest subnormal
  KVFLOW_CHECK(to_float(from_float<float16>(std::ldexp(1.f, -25))) == 0.f);                   // tie -> even (zero)
}

KVFLOW_TEST(bfloat16_rounds_to_nearest_even) {
  KVFLOW_CHECK(from_float<bfloat16>(1.f).bits == 0x3f80);
  KVFLOW_CHECK(from_float<bfloat16>(bits_float(0x3f808000u)).bits == 0x3f80);  // tie -> even
  KVFLOW_CHECK(from_float<bfloat16>(bits_float(0x3f818000u)).bits == 0x3f82);  // tie -> even (up)
  KVFLOW_CHECK(from_float<bfloat16>(bits_float(0x3f808001u)).bits == 0x3f81);
  KVFLOW_CHECK(std::isnan(to_float(from_float<bfloat16>(NAN))));
  KVFLOW_CHECK(std::isinf(to_float(from_float<bfloat16>(INFINITY))));
}

KVFLOW_TEST(every_isa_matches_scalar_rms_norm_and_activations) {
  const int64_t rows = 5, hidden = 5125;
  const auto x = random_floats(rows * hidden, 1, 2.f);
  const auto residual = random_floats(rows * hidden, 2);
  const auto weight = random_floats(hidden, 3);
  std::vector<bfloat16> xb(x.size()), wb(weight.size());
  for (size_t i = 0; i < x.size(); ++i) xb[i] = from_float<bfloat16>(x[i]);
  for (size_t i = 0; i < weight.size(); ++i) wb[i] = from_float<bfloat16>(weight[i]);

  std::vector<float> expected_norm(x.size()), expected_silu(x.size() / 2), expected_gelu(x.size() / 2);
  std::vector<bfloat16> expected_norm_bf16(x.size());
  const KernelTable& scalar = table_named("scalar");
  scalar.rms_norm[int(DType::kFloat32)](expected_norm.data(), hidden, x.data(), hidden, weight.data(), hidden, 1e-6f,
                                        0.f, 0, rows);
  scalar.rms_norm[int(DType::kBFloat16)](expected_norm_bf16.data(), hidden, xb.data(), hidden, wb.data(), hidden,
                                         1e-6f, 0.f, 0, rows);
  scalar.silu_and_mul[int(DType::kFloat32)](expected_silu.data(), hidden / 2, x.data(), hidden, hidden / 2, 0, rows);
  scalar.gelu_tanh_and_mul[int(DType::kFloat32)](expected_gelu.data(), hidden / 2, x.data(), hidden, hidden / 2, 0,
                                                 rows);
  for (const std::string& isa : supported_isas()) {
    const KernelTable& t = table_named(isa);
    std::vector<float> norm(x.size()), silu(x.size() / 2), gelu(x.size() / 2);
    std::vector<bfloat16> norm_bf16(x.size());
    t.rms_norm[int(DType::kFloat32)](norm.data(), hidden, x.data(), hidden, weight.data(), hidden, 1e-6f, 0.f, 0, rows);
    t.rms_norm[int(DType::kBFloat16)](norm_bf16.data(), hidden, xb.data(), hidden, wb.data(), hidden, 1e-6f, 0.f, 0,
                                      rows);
    t.silu_and_mul[int(DType::kFloat32)](silu.data(), hidden / 2, x.data(), hidden, hidden / 2, 0, rows);
    t.gelu_tanh_and_mul[int(DType::kFloat32)](gelu.data(), hidden / 2, x.data(), hidden, hidden / 2, 0, rows);
    int bad = 0;
    for (size_t i = 0; i < norm.size(); ++i) {
      bad += !close(norm[i], expected_norm[i], 1e-5f);
      // One bfloat16 ulp: the float32 results differ in the last bits, which may round apart.
      bad += !close(to_float(norm_bf16[i]), to_float(expected_norm_bf16[i]), 1.f / 128);
    }
    for (size_t i = 0; i < silu.size(); ++i) {
      bad += !close(silu[i], expected_silu[i], 1e-5f);
      bad += !close(gelu[i], expected_gelu[i], 1e-5f);
    }
    if (bad != 0) ::kvflow::testing::fail(__FILE__, __LINE__, isa + ": " + std::to_string(bad) + " mismatches");
  }
  set_isa(supported_isas().back());
}

KVFLOW_TEST(fused_add_rms_norm_rows_outside_the_range_are_untouched) {
  const int64_t rows = 4, hidden = 96;
  auto x = random_floats(rows * hidden, 4);
  auto residual = random_floats(rows * hidden, 5);
  const auto weight = random_floats(hidden, 6);
  const auto x_before = x, residual_before = residual;
  const KernelTable& t = active_kernels();
  t.fused_add_rms_norm[int(DType::kFloat32)](x.data(), hidden, residual.data(), hidden, weight.data(), hidden, 1e-6f,
                                             0.f, 1, 3);
  for (int64_t i = 0; i < hidden; ++i) {
    KVFLOW_CHECK(x[i] == x_before[i] && residual[i] == residual_before[i]);
    KVFLOW_CHECK(x[3 * hidden + i] == x_before[3 * hidden + i]);
    KVFLOW_CHECK(residual[hidden + i] == x_before[hidden + i] + residual_before[hidden + i]);
  }
}

KVFLOW_TEST(set_isa_rejects_unknown_names) {
  KVFLOW_CHECK_THROWS(set_isa("sse9"), std::invalid_argument);
  KVFLOW_CHECK(std::string(active_kernels().isa) == supported_isas().back());
}
