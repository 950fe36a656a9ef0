// The numeric conversions and the CPU kernel tables, without torch: every instruction set the
// CPU supports must agree with the formulas written out as plain loops.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "quantized_reference.h"
#include "kvflow/cpu/gguf_blocks.h"
#include "kvflow/cpu/kernel_table.h"
#include "kvflow/numeric.h"

using namespace kvflow;
using namespace kvflow::cpu;
using namespace kvflow::testing;

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

KVFLOW_TEST(every_isa_matches_plain_loops) {
  const int64_t rows = 5, hidden = 5125, d = hidden / 2;
  const auto x = random_floats(rows * hidden, 1, 2.f);
  const auto weight = random_floats(hidden, 3);
  std::vector<bfloat16> xb(x.size()), wb(weight.size());
  for (size_t i = 0; i < x.size(); ++i) xb[i] = from_float<bfloat16>(x[i]);
  for (size_t i = 0; i < weight.size(); ++i) wb[i] = from_float<bfloat16>(weight[i]);

  // The references: the formulas written out in double, independent of kernels.h.
  std::vector<double> norm_ref(x.size()), norm_bf16_ref(x.size()), silu_ref(rows * d), gelu_ref(rows * d);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0, ss_b = 0;
    for (int64_t i = 0; i < hidden; ++i) {
      ss += double(x[r * hidden + i]) * x[r * hidden + i];
      ss_b += double(to_float(xb[r * hidden + i])) * to_float(xb[r * hidden + i]);
    }
    for (int64_t i = 0; i < hidden; ++i) {
      norm_ref[r * hidden + i] = x[r * hidden + i] / std::sqrt(ss / hidden + 1e-6) * weight[i];
      norm_bf16_ref[r * hidden + i] = to_float(xb[r * hidden + i]) / std::sqrt(ss_b / hidden + 1e-6) * to_float(wb[i]);
    }
    for (int64_t i = 0; i < d; ++i) {
      const double g = x[r * hidden + i], u = x[r * hidden + d + i];
      silu_ref[r * d + i] = g / (1 + std::exp(-g)) * u;
      gelu_ref[r * d + i] = 0.5 * g * (1 + std::tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))) * u;
    }
  }
  for (const std::string& isa : supported_isas()) {
    const KernelTable& t = table_named(isa);
    std::vector<float> norm(x.size()), silu(rows * d), gelu(rows * d);
    std::vector<bfloat16> norm_bf16(x.size());
    t.rms_norm[int(DType::kFloat32)](norm.data(), hidden, x.data(), hidden, weight.data(), hidden, 1e-6f, 0.f, 0, rows);
    t.rms_norm[int(DType::kBFloat16)](norm_bf16.data(), hidden, xb.data(), hidden, wb.data(), hidden, 1e-6f, 0.f, 0,
                                      rows);
    t.silu_and_mul[int(DType::kFloat32)](silu.data(), d, x.data(), hidden, d, 0, rows);
    t.gelu_tanh_and_mul[int(DType::kFloat32)](gelu.data(), d, x.data(), hidden, d, 0, rows);
    int bad = 0;
    for (size_t i = 0; i < norm.size(); ++i) {
      bad += !close(norm[i], float(norm_ref[i]), 1e-5f);
      bad += !close(to_float(norm_bf16[i]), float(norm_bf16_ref[i]), 1.f / 256);  // one bf16 rounding
    }
    for (size_t i = 0; i < silu.size(); ++i) {
      bad += !close(silu[i], float(silu_ref[i]), 1e-5f);
      bad += !close(gelu[i], float(gelu_ref[i]), 1e-5f);
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

KVFLOW_TEST(activation_blocks_quantize_within_half_a_step) {
  auto x = random_floats(4 * kQuantBlock, 21, 3.f);
  std::fill(x.begin() + 2 * kQuantBlock, x.begin() + 3 * kQuantBlock, 0.f);  // an all-zero block
  std::vector<int8_t> q(x.size());
  for (int64_t b = 0; b < 4; ++b) {
    float scale_sum[2];
    int32_t block_code_sum = 0;
    quantize_activation_block(x.data() + b * kQuantBlock, q.data() + b * kQuantBlock, scale_sum, &block_code_sum);
    int code_sum = 0;
    for (int64_t j = 0; j < kQuantBlock; ++j) {
      const float v = x[size_t(b * kQuantBlock + j)];
      code_sum += q[size_t(b * kQuantBlock + j)];
      KVFLOW_CHECK(std::fabs(v - scale_sum[0] * q[size_t(b * kQuantBlock + j)]) <= 0.5001f * scale_sum[0] + 1e-7f);
    }
    KVFLOW_CHECK(scale_sum[1] == scale_sum[0] * float(code_sum));
    KVFLOW_CHECK(block_code_sum == code_sum);
  }
}

// An activation exactly halfway between two codes (frequent for bfloat16 inputs) rounds to the
// even one, in both directions: no bias in a block's ties.
KVFLOW_TEST(activation_ties_round_to_even) {
  std::vector<float> x(kQuantBlock, 0.f);
  x[0] = 127.f;  // the scale is 1: the codes are the values, rounded
  const float halves[] = {2.5f, 3.5f, -2.5f, -3.5f, 0.5f, -0.5f, 126.5f};
  const int expected[] = {2, 4, -2, -4, 0, 0, 126};
  for (int i = 0; i < 7; ++i) x[size_t(i + 1)] = halves[i];
  std::vector<int8_t> q(kQuantBlock);
  float scale_sum[2];
  int32_t code_sum = 0;
  quantize_activation_block(x.data(), q.data(), scale_sum, &code_sum);
  KVFLOW_CHECK(scale_sum[0] == 1.f);
  for (int i = 0; i < 7; ++i) KVFLOW_CHECK(q[size_t(i + 1)] == expected[i]);
}

// Every instruction set's quantize_activations gives quantize_activation_block's codes, scales
// and code sums bit for bit, from float32 and from bfloat16: random chunks, halfway values (bfloat16's
// many ties), a zero chunk, and chunks of very different magnitudes.
KVFLOW_TEST(quantize_activations_match_the_definition) {
  const int64_t chunks = 6;
  auto x = random_floats(size_t(chunks * kQuantBlock), 31);
  for (int j = 0; j < kQuantBlock; ++j) x[size_t(kQuantBlock + j)] = 0.f;
  for (int j = 0; j < kQuantBlock; ++j) x[size_t(2 * kQuantBlock + j)] = float(j - 15) + 0.5f;  // ties at amax 16.5
  for (int j = 0; j < kQuantBlock; ++j) x[size_t(3 * kQuantBlock + j)] *= 1e-6f;
  std::vector<bfloat16> x_bf16(x.size());
  for (size_t i = 0; i < x.size(); ++i) x_bf16[i] = from_float<bfloat16>(x[i]);
  for (int is_bf16 = 0; is_bf16 < 2; ++is_bf16) {
    std::vector<int8_t> expected_q(x.size());
    std::vector<float> expected_scales(size_t(2 * chunks));
    std::vector<int32_t> expected_sums(static_cast<size_t>(chunks));
    for (int64_t c = 0; c < chunks; ++c) {
      float chunk[kQuantBlock];
      for (int j = 0; j < kQuantBlock; ++j) {
        const size_t i = size_t(c * kQuantBlock + j);
        chunk[j] = is_bf16 ? to_float(x_bf16[i]) : x[i];
      }
      quantize_activation_block(chunk, expected_q.data() + c * kQuantBlock, expected_scales.data() + 2 * c,
                                expected_sums.data() + c);
    }
    for (const std::string& isa : supported_isas()) {
      std::vector<int8_t> q(x.size(), 99);
      std::vector<float> scales(size_t(2 * chunks), -1.f);
      std::vector<int32_t> sums(size_t(chunks), -1);
      const void* input = is_bf16 ? static_cast<const void*>(x_bf16.data()) : static_cast<const void*>(x.data());
      table_named(isa).quantize_activations[is_bf16](input, chunks, q.data(), scales.data(), sums.data());
      KVFLOW_CHECK(q == expected_q);
      KVFLOW_CHECK(sums == expected_sums);
      KVFLOW_CHECK(std::memcmp(scales.data(), expected_scales.data(), scales.size() * sizeof(float)) == 0);
    }
  }
  set_isa(supported_isas().back());
}

// Every instruction set's quantized_linear against a plain loop over dequantize_chunk and the
// activations as quantized, for each format: equal up to float32 accumulation.
KVFLOW_TEST(quantized_linear_matches_dequantized_blocks) {
  const int64_t rows = 5, in_features = 512, out_features = 9;
  const QuantizedInput in = quantized_input(random_floats(size_t(rows * in_features), 22), rows, in_features);
  for (int f = 0; f < kNumQuantFormats; ++f) {
    const QuantFormat format = QuantFormat(f);
    const int64_t row_bytes = in_features / quant_block_values(format) * quant_block_bytes(format);
    const std::vector<uint8_t> weight = random_gguf_rows(format, out_features, in_features, uint32_t(8 + f));
    const ExpectedProducts expected = expected_products(format, weight, out_features, in, rows);
    for (const std::string& isa : supported_isas()) {
      const KernelTable& t = table_named(isa);
      std::vector<float> out(expected.value.size(), -1.f);
      t.quantized_linear[int(format)](out.data(), true, in.rows(), weight.data(), row_bytes, nullptr, rows,
                                      out_features, 0, out_features);
      for (size_t k = 0; k < out.size(); ++k) KVFLOW_CHECK(std::fabs(out[k] - expected.value[k]) <= expected.bound[k]);
    }
  }
  set_isa(supported_isas().back());
}
