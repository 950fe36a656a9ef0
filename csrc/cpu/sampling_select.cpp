// The sampler's selections (kvflow/cpu/sampling_select.h).
#include "kvflow/cpu/sampling_select.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvflow/philox.h"

namespace kvflow::cpu {
namespace {

bool before(const Token& a, const Token& b) { return a.p > b.p || (a.p == b.p && a.index < b.index); }

}  // namespace

void top_k_candidates(const KernelTable& kt, DType dtype, const void* row, int64_t vocab, int64_t k, float max,
                      float inv_t, Scratch& s) {
  constexpr int64_t kSpan = 4096;
  std::vector<int32_t>& found = s.indices;
  found.resize(std::max<int64_t>(4 * k, kSpan) + kSpan);
  int64_t count = 0;
  float threshold = -std::numeric_limits<float>::infinity();
  auto by_logit = [&](int32_t a, int32_t b) {
    const float la = logit_at(row, dtype, a), lb = logit_at(row, dtype, b);
    return la > lb || (la == lb && a < b);
  };
  for (int64_t begin = 0; begin < vocab; begin += kSpan) {
    const int64_t end = std::min(vocab, begin + kSpan);
    count += kt.collect_greater[int(dtype)](row, begin, end, threshold, found.data() + count);
    if (count >= 4 * k) {  // keep the k best; later indices must beat the k-th strictly
      std::nth_element(found.begin(), found.begin() + (k - 1), found.begin() + count, by_logit);
      count = k;
      threshold = logit_at(row, dtype, found[k - 1]);
    }
  }
  // -inf logits never pass the first threshold; a row with fewer finite logits than k keeps those.
  std::sort(found.begin(), found.begin() + count, by_logit);
  count = std::min(count, k);
  s.tokens.resize(count);
  for (int64_t i = 0; i < count; ++i) {
    s.tokens[i] = {found[i], std::exp((logit_at(row, dtype, found[i]) - max) * inv_t)};
  }
}

// The lowest index holding the row's maximum (found by checked_max): one typed scan that stops
// at the first match.
float logit_at(const void* row, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(row)[i];
    case DType::kFloat16:
      return to_float(static_cast<const float16*>(row)[i]);
    case DType::kBFloat16:
      return to_float(static_cast<const bfloat16*>(row)[i]);
  }
  return 0.f;
}

void take_mass(std::vector<Token>& tokens, double target, std::vector<Token>& kept) {
  double taken = 0;
  size_t lo = 0, hi = tokens.size();  // the undecided range
  while (hi - lo > 64) {
    const float a = tokens[lo].p, b = tokens[(lo + hi) / 2].p, c = tokens[hi - 1].p;
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));  // median of three
    auto mid = std::partition(tokens.begin() + lo, tokens.begin() + hi, [&](const Token& t) { return t.p > pivot; });
    auto mid2 = std::partition(mid, tokens.begin() + hi, [&](const Token& t) { return t.p == pivot; });
    double above = 0;
    for (auto it = tokens.begin() + lo; it != mid; ++it) above += it->p;
    if (taken + above >= target) {
      hi = mid - tokens.begin();
      continue;
    }
    kept.insert(kept.end(), tokens.begin() + lo, mid);
    taken += above;
    const double equal = double(pivot) * double(mid2 - mid);
    if (taken + equal >= target) {  // ties at the boundary: lower indices first
      std::sort(mid, mid2, before);
      for (auto it = mid; it != mid2 && taken < target; ++it) {
        kept.push_back(*it);
        taken += it->p;
      }
      return;
    }
    kept.insert(kept.end(), mid, mid2);
    taken += equal;
    lo = mid2 - tokens.begin();
  }
  std::sort(tokens.begin() + lo, tokens.begin() + hi, before);
  for (size_t i = lo; i < hi && (taken < target || kept.empty()); ++i) {
    kept.push_back(tokens[i]);
    taken += tokens[i].p;
  }
}

int32_t argmax(const KernelTable& kt, DType dtype, const void* row, int64_t vocab, float max, Scratch& s) {
  // The values above the float just below max are the ones equal to it; the vector scan stops
  // at the first span that holds one.
  constexpr int64_t kSpan = 4096;
  const float below = std::nextafter(max, -std::numeric_limits<float>::infinity());
  s.indices.resize(std::max<int64_t>(s.indices.size(), std::min(vocab, kSpan)));
  for (int64_t begin = 0; begin < vocab; begin += kSpan) {
    const int64_t end = std::min(vocab, begin + kSpan);
    if (kt.collect_greater[int(dtype)](row, begin, end, below, s.indices.data()) > 0) return s.indices[0];
  }
  return 0;  // max is not in the row: the caller broke the contract
}

void kept_tokens(const KernelTable& kt, DType dtype, const void* row, int64_t vocab, const RowParams& r,
                 float max, Scratch& s) {
  s.kept.clear();
  if (r.temperature == 0.f) {
    s.kept.push_back({argmax(kt, dtype, row, vocab, max, s), 1.f});
    return;
  }
  const float inv_t = 1.f / r.temperature;
  const bool top_k = r.top_k > 0 && r.top_k < vocab;
  if (top_k) {
    top_k_candidates(kt, dtype, row, vocab, r.top_k, max, inv_t, s);  // sorted by p desc
    double total = 0;
    for (const Token& t : s.tokens) total += t.p;
    double taken = 0;
    for (const Token& t : s.tokens) {
      if (r.top_p < 1.f && taken >= double(r.top_p) * total) break;
      s.kept.push_back(t);
      taken += t.p;
    }
  } else {
    s.p.resize(vocab);
    const double total = kt.exp_sum[int(dtype)](row, vocab, max, inv_t, s.p.data());
    s.tokens.clear();
    for (int64_t i = 0; i < vocab; ++i) {  // masked (-inf) tokens are never candidates
      if (logit_at(row, dtype, i) > -std::numeric_limits<float>::infinity()) s.tokens.push_back({int32_t(i), s.p[i]});
    }
    if (r.top_p < 1.f) {
      take_mass(s.tokens, double(r.top_p) * total, s.kept);
    } else {
      s.kept.swap(s.tokens);
    }
  }
  if (r.min_p > 0.f) {  // p is relative to the most likely token, whose p is 1
    s.kept.erase(std::remove_if(s.kept.begin(), s.kept.end(), [&](const Token& t) { return t.p < r.min_p; }),
                 s.kept.end());
  }
  std::sort(s.kept.begin(), s.kept.end(), [](const Token& a, const Token& b) { return a.index < b.index; });
}

int32_t draw(const std::vector<Token>& kept, uint64_t seed, uint64_t offset) {
  double total = 0;
  for (const Token& t : kept) total += t.p;
  const double target = philox_uniform(seed, offset) * total;
  double cumulative = 0;
  for (const Token& t : kept) {
    cumulative += t.p;
    if (cumulative > target) return t.index;
  }
  return kept.back().index;
}

}  // namespace kvflow::cpu
