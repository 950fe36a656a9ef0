// The sampler's selections (kvflow/cpu/sampling_select.h) against plain sorting, on the scalar
// kernels: top-p keeps the shortest prefix of the (p desc, index asc) order that reaches the mass,
// top-k the k best logits (ties to the lower index), min-p drops what falls under it, greedy the
// first maximum; draws follow the kept probabilities.
#include <algorithm>
#include <iostream>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "check.h"
#include "kvflow/cpu/kernel_table.h"
#include "kvflow/cpu/sampling_select.h"

using kvflow::DType;
using namespace kvflow::cpu;

namespace {

std::vector<float> random_logits(int64_t vocab, uint32_t seed, int distinct) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> value(0, distinct - 1);  // few distinct values: many ties
  std::vector<float> logits(vocab);
  for (float& x : logits) x = 0.25f * float(value(rng)) - 3.f;
  return logits;
}

// What the selection must keep, by sorting every token: indices in increasing order.
std::vector<int32_t> expected_kept(const std::vector<float>& logits, const RowParams& r) {
  const int64_t vocab = int64_t(logits.size());
  const float max = *std::max_element(logits.begin(), logits.end());
  // The probabilities as the selection sees them: std::exp for top-k candidates, else the kernel's
  // exp pass (and its total), whose rounding decides ties at the top-p boundary.
  const bool top_k = r.top_k > 0 && r.top_k < vocab;
  std::vector<float> p(vocab);
  const double kernel_total =
      scalar_kernels().exp_sum[int(DType::kFloat32)](logits.data(), vocab, max, 1.f / r.temperature, p.data());
  std::vector<Token> all;
  for (int64_t i = 0; i < vocab; ++i) {
    all.push_back({int32_t(i), top_k ? std::exp((logits[i] - max) * (1.f / r.temperature)) : p[i]});
  }
  std::sort(all.begin(), all.end(), [&](const Token& a, const Token& b) {
    return logits[a.index] > logits[b.index] || (logits[a.index] == logits[b.index] && a.index < b.index);
  });
  if (top_k) all.resize(r.top_k);
  double total = kernel_total;
  if (top_k) {
    total = 0;
    for (const Token& t : all) total += t.p;
  }
  std::vector<Token> prefix;
  double taken = 0;
  for (const Token& t : all) {
    if (r.top_p < 1.f && taken >= double(r.top_p) * total) break;
    prefix.push_back(t);
    taken += t.p;
  }
  std::vector<int32_t> kept;
  for (const Token& t : prefix) {
    if (t.p >= r.min_p) kept.push_back(t.index);
  }
  std::sort(kept.begin(), kept.end());
  return kept;
}

}  // namespace

KVFLOW_TEST(kept_tokens_match_sorting) {
  const KernelTable& kt = scalar_kernels();
  Scratch scratch;
  const RowParams cases[] = {{1.f, 0, 1.f, 0.f},   {0.7f, 0, 0.9f, 0.f}, {1.f, 5, 1.f, 0.f},
                             {1.3f, 40, 0.5f, 0.f}, {1.f, 0, 0.95f, 0.2f}, {0.5f, 3, 1.f, 0.3f},
                             {1.f, 0, 0.01f, 0.f}};
  for (int64_t vocab : {1, 7, 100, 5000}) {
    for (uint32_t seed = 0; seed < 5; ++seed) {
      const std::vector<float> logits = random_logits(vocab, seed, seed % 2 ? 6 : 1000);
      const float max = *std::max_element(logits.begin(), logits.end());
      for (const RowParams& r : cases) {
        kept_tokens(kt, DType::kFloat32, logits.data(), vocab, r, max, scratch);
        std::vector<int32_t> got;
        for (const Token& t : scratch.kept) got.push_back(t.index);
        const std::vector<int32_t> want = expected_kept(logits, r);
        if (got != want) {
          std::cerr << "vocab " << vocab << " seed " << seed << " T " << r.temperature << " k " << r.top_k << " p "
                    << r.top_p << " min_p " << r.min_p << ": got " << got.size() << " want " << want.size() << "\n";
        }
        KVFLOW_CHECK(got == want);
      }
    }
  }
}

KVFLOW_TEST(greedy_keeps_the_first_maximum) {
  const KernelTable& kt = scalar_kernels();
  Scratch scratch;
  const std::vector<float> logits = {0.5f, 2.f, -1.f, 2.f, 2.f};
  kept_tokens(kt, DType::kFloat32, logits.data(), 5, {0.f, 0, 1.f, 0.f}, 2.f, scratch);
  KVFLOW_CHECK(scratch.kept.size() == 1 && scratch.kept[0].index == 1);
  KVFLOW_CHECK(argmax(kt, DType::kFloat32, logits.data(), 5, 2.f, scratch) == 1);
  // The first maximum far into a long row, behind values just below it, and at the very end.
  std::vector<float> row(10000, 1.f);
  row[7000] = std::nextafter(3.f, 0.f);
  row[9000] = 3.f;
  row[9999] = 3.f;
  KVFLOW_CHECK(argmax(kt, DType::kFloat32, row.data(), 10000, 3.f, scratch) == 9000);
  row[9000] = 1.f;
  KVFLOW_CHECK(argmax(kt, DType::kFloat32, row.data(), 10000, 3.f, scratch) == 9999);
}

KVFLOW_TEST(take_mass_keeps_the_shortest_prefix_reaching_the_target) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> p(0.f, 1.f);
  for (int n : {1, 10, 65, 500, 3000}) {
    std::vector<Token> tokens(n);
    for (int i = 0; i < n; ++i) tokens[i] = {i, i % 3 ? p(rng) : 0.5f};  // ties across the pivots
    std::vector<Token> sorted = tokens;
    std::sort(sorted.begin(), sorted.end(),
              [](const Token& a, const Token& b) { return a.p > b.p || (a.p == b.p && a.index < b.index); });
    double total = 0;
    for (const Token& t : tokens) total += t.p;
    for (double share : {0.01, 0.3, 0.9, 1.0}) {
      std::vector<Token> shuffled = tokens, kept;
      std::shuffle(shuffled.begin(), shuffled.end(), rng);
      take_mass(shuffled, share * total, kept);
      size_t expected = 0;
      for (double taken = 0; expected < sorted.size() && (taken < share * total || expected == 0); ++expected) {
        taken += sorted[expected].p;
      }
      KVFLOW_CHECK(kept.size() == expected);
      std::vector<int32_t> got, want;
      for (const Token& t : kept) got.push_back(t.index);
      for (size_t i = 0; i < expected; ++i) want.push_back(sorted[i].index);
      std::sort(got.begin(), got.end());
      std::sort(want.begin(), want.end());
      KVFLOW_CHECK(got == want);
    }
  }
}

KVFLOW_TEST(draws_follow_the_kept_probabilities) {
  const std::vector<Token> kept = {{3, 1.f}, {8, 0.5f}, {20, 0.25f}, {21, 0.25f}};
  std::vector<int> counts(22, 0);
  const int draws = 40000;
  for (int i = 0; i < draws; ++i) ++counts[draw(kept, 1234, uint64_t(i))];
  const double expected[] = {0.5, 0.25, 0.125, 0.125};
  for (size_t k = 0; k < kept.size(); ++k) {
    KVFLOW_CHECK(std::abs(counts[kept[k].index] / double(draws) - expected[k]) < 0.01);
  }
  KVFLOW_CHECK(draw(kept, 99, 5) == draw(kept, 99, 5));  // one (seed, offset), one token
}
