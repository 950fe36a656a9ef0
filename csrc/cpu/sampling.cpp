// Sampling on the CPU: per row, the kept set of tokens (greedy; else top-k, top-p, min-p), then
// one Philox draw over the kept tokens in index order. Rows run in parallel. The vectorised
// passes over the vocabulary (max, exp, threshold scans) come from the kernel table; the
// selections here touch only candidates: top-k by a rising threshold, top-p by partitioning on
// probability mass (a quickselect), so the vocabulary is never sorted.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvflow/cpu/kernel_table.h"
#include "kvflow/philox.h"
#include "op_checks.h"
#include "ops.h"

namespace kvflow::cpu {
namespace {

struct RowParams {
  float temperature;
  int64_t top_k;
  float top_p;
  float min_p;
};

struct Token {
  int32_t index;
  float p;  // exp((logit - max) / T): 1 for the most likely token
};

// Scratch reused across the rows a thread handles.
struct Scratch {
  std::vector<float> p;            // [vocab]
  std::vector<int32_t> indices;    // [vocab]
  std::vector<Token> tokens;       // candidates
  std::vector<Token> kept;
};

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

bool before(const Token& a, const Token& b) { return a.p > b.p || (a.p == b.p && a.index < b.index); }

// The top_k indices by logit (ties: lower index first), sorted that way: a scan keeps every
// index above a threshold that rises to the k-th best value seen so far.
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

// Keeps, of tokens (any order), the shortest prefix of the (p desc, index asc) order whose mass
// reaches target: partitions around pivots instead of sorting. Appends it to kept.
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

void check_params(const RowParams& r, int64_t row) {
  TORCH_CHECK(r.temperature >= 0.f && std::isfinite(r.temperature), "temperature[", row, "] = ", r.temperature,
              " must be finite and >= 0 (0 = greedy)");
  TORCH_CHECK(r.top_k >= 0, "top_k[", row, "] = ", r.top_k, " must be >= 0 (0 = all tokens)");
  TORCH_CHECK(r.top_p > 0.f && r.top_p <= 1.f, "top_p[", row, "] = ", r.top_p, " must be in (0, 1]");
  TORCH_CHECK(r.min_p >= 0.f && r.min_p <= 1.f, "min_p[", row, "] = ", r.min_p, " must be in [0, 1]");
}

// The row's max logit, after checking there is no NaN or +inf (-inf marks a masked token).
float checked_max(const KernelTable& kt, DType dtype, const void* row, int64_t vocab, int64_t row_index) {
  bool non_finite = false;
  const float max = kt.row_max[int(dtype)](row, vocab, &non_finite);
  if (non_finite) {
    for (int64_t i = 0; i < vocab; ++i) {
      const float v = logit_at(row, dtype, i);
      TORCH_CHECK(!std::isnan(v) && v != std::numeric_limits<float>::infinity(), "logits[", row_index, ", ", i,
                  "] is ", v, ": logits must be finite or -inf");
    }
  }
  TORCH_CHECK(max > -std::numeric_limits<float>::infinity(), "logits row ", row_index,
              " has no finite logit: nothing to sample");
  return max;
}

// The lowest index holding the row's maximum (found by checked_max): one typed scan that stops
// at the first match.
template <typename T>
int32_t first_index_of(const T* row, int64_t vocab, float value) {
  for (int64_t i = 0; i < vocab; ++i) {
    if (to_float(row[i]) == value) return int32_t(i);
  }
  return 0;
}

int32_t argmax(const void* row, DType dtype, int64_t vocab, float max) {
  switch (dtype) {
    case DType::kFloat32:
      return first_index_of(static_cast<const float*>(row), vocab, max);
    case DType::kFloat16:
      return first_index_of(static_cast<const float16*>(row), vocab, max);
    case DType::kBFloat16:
      return first_index_of(static_cast<const bfloat16*>(row), vocab, max);
  }
  return 0;
}

// The tokens a row may draw, with their unnormalised probabilities, in increasing index order.
void kept_tokens(const KernelTable& kt, DType dtype, const void* row, int64_t vocab, const RowParams& r,
                 float max, Scratch& s) {
  s.kept.clear();
  if (r.temperature == 0.f) {
    s.kept.push_back({argmax(row, dtype, vocab, max), 1.f});
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

// Every row's parameters and max logit, checked before any row is sampled or written, so that
// a bad row leaves every output and every row of logits untouched.
struct CheckedRows {
  std::vector<RowParams> params;
  std::vector<float> max;
};

CheckedRows check_rows(const KernelTable& kt, DType dtype, const char* base, int64_t row_bytes, int64_t batch,
                       int64_t vocab, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& min_p) {
  CheckedRows rows{std::vector<RowParams>(batch), std::vector<float>(batch)};
  for (int64_t b = 0; b < batch; ++b) {
    rows.params[b] = {temperature.data_ptr<float>()[b], top_k.data_ptr<int32_t>()[b], top_p.data_ptr<float>()[b],
                      min_p.data_ptr<float>()[b]};
    check_params(rows.params[b], b);
  }
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) rows.max[b] = checked_max(kt, dtype, base + b * row_bytes, vocab, b);
  });
  return rows;
}

}  // namespace

at::Tensor sample(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                  const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& seeds,
                  const at::Tensor& offsets) {
  check_device_type(logits, "logits", c10::DeviceType::CPU);
  const SamplingGeometry g = check_sampling_args(logits, temperature, top_k, top_p, min_p);
  check_row_param(seeds, "seeds", at::kLong, logits);
  check_row_param(offsets, "offsets", at::kLong, logits);
  const KernelTable& kt = active_kernels();
  const char* base = static_cast<const char*>(logits.data_ptr());
  const int64_t row_bytes = logits.stride(0) * logits.element_size();
  const CheckedRows rows = check_rows(kt, g.dtype, base, row_bytes, g.batch, g.vocab, temperature, top_k, top_p, min_p);
  at::Tensor tokens = at::empty({g.batch}, logits.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, g.batch, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t b = begin; b < end; ++b) {
      kept_tokens(kt, g.dtype, base + b * row_bytes, g.vocab, rows.params[b], rows.max[b], scratch);
      out[b] = draw(scratch.kept, uint64_t(seeds.data_ptr<int64_t>()[b]), uint64_t(offsets.data_ptr<int64_t>()[b]));
    }
  });
  return tokens;
}

void apply_sampling_filters(at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                            const at::Tensor& top_p, const at::Tensor& min_p) {
  check_device_type(logits, "logits", c10::DeviceType::CPU);
  const SamplingGeometry g = check_sampling_args(logits, temperature, top_k, top_p, min_p);
  TORCH_CHECK(g.dtype == DType::kFloat32, "apply_sampling_filters needs float32 logits, got ", logits.scalar_type());
  const KernelTable& kt = active_kernels();
  float* base = logits.data_ptr<float>();
  const CheckedRows rows = check_rows(kt, g.dtype, reinterpret_cast<const char*>(base),
                                      logits.stride(0) * int64_t(sizeof(float)), g.batch, g.vocab, temperature, top_k,
                                      top_p, min_p);
  at::parallel_for(0, g.batch, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    std::vector<float> values;
    for (int64_t b = begin; b < end; ++b) {
      const RowParams& r = rows.params[b];
      float* row = base + b * logits.stride(0);
      kept_tokens(kt, g.dtype, row, g.vocab, r, rows.max[b], scratch);
      const float scale = r.temperature == 0.f ? 1.f : 1.f / r.temperature;
      values.resize(scratch.kept.size());
      for (size_t i = 0; i < values.size(); ++i) values[i] = row[scratch.kept[i].index] * scale;
      std::fill(row, row + g.vocab, -std::numeric_limits<float>::infinity());
      for (size_t i = 0; i < values.size(); ++i) row[scratch.kept[i].index] = values[i];
    }
  });
}

void apply_penalties(at::Tensor& logits, const at::Tensor& prompt_token_ids, const at::Tensor& prompt_offsets,
                     const at::Tensor& output_token_ids, const at::Tensor& output_offsets,
                     const at::Tensor& repetition_penalty, const at::Tensor& frequency_penalty,
                     const at::Tensor& presence_penalty) {
  check_device_type(logits, "logits", c10::DeviceType::CPU);
  check_penalty_args(logits, prompt_token_ids, prompt_offsets, output_token_ids, output_offsets, repetition_penalty,
                     frequency_penalty, presence_penalty);
  const int64_t batch = logits.size(0), vocab = logits.size(1);
  // Values, which only this host path can read: offsets, token ids, penalties.
  for (const auto& [offsets, ids, name] : {std::tuple{&prompt_offsets, &prompt_token_ids, "prompt_offsets"},
                                           std::tuple{&output_offsets, &output_token_ids, "output_offsets"}}) {
    const int64_t* o = offsets->data_ptr<int64_t>();
    TORCH_CHECK(o[0] == 0 && o[batch] == ids->size(0), name, " must run from 0 to ", ids->size(0));
    for (int64_t b = 0; b < batch; ++b) TORCH_CHECK(o[b] <= o[b + 1], name, " must be non-decreasing");
  }
  for (const auto& [t, name] : {std::pair{&prompt_token_ids, "prompt_token_ids"},
                                std::pair{&output_token_ids, "output_token_ids"}}) {
    const int64_t* ids = t->data_ptr<int64_t>();
    for (int64_t i = 0; i < t->size(0); ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < vocab, name, "[", i, "] = ", ids[i], " is not a token id in [0, ", vocab,
                  ")");
    }
  }
  for (int64_t b = 0; b < batch; ++b) {
    const float rp = repetition_penalty.data_ptr<float>()[b];
    TORCH_CHECK(rp > 0.f && std::isfinite(rp), "repetition_penalty[", b, "] = ", rp, " must be > 0 (1 = off)");
  }
  const int64_t* prompt = prompt_token_ids.data_ptr<int64_t>();
  const int64_t* output = output_token_ids.data_ptr<int64_t>();
  const int64_t* po = prompt_offsets.data_ptr<int64_t>();
  const int64_t* oo = output_offsets.data_ptr<int64_t>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> count(vocab, 0);  // per row: occurrences in the output, zeroed after the row
    std::vector<uint8_t> seen(vocab, 0);    // per row: already repetition-penalised
    for (int64_t b = begin; b < end; ++b) {
      float* row = logits.data_ptr<float>() + b * logits.stride(0);
      const float rp = repetition_penalty.data_ptr<float>()[b];
      const float fp = frequency_penalty.data_ptr<float>()[b];
      const float pp = presence_penalty.data_ptr<float>()[b];
      for (int64_t i = oo[b]; i < oo[b + 1]; ++i) ++count[output[i]];
      auto repeat = [&](int64_t t) {
        if (seen[t]) return;
        seen[t] = 1;
        if (rp != 1.f) row[t] = row[t] > 0.f ? row[t] / rp : row[t] * rp;
      };
      for (int64_t i = po[b]; i < po[b + 1]; ++i) repeat(prompt[i]);
      for (int64_t i = oo[b]; i < oo[b + 1]; ++i) repeat(output[i]);
      for (int64_t i = oo[b]; i < oo[b + 1]; ++i) {
        const int64_t t = output[i];
        if (count[t] > 0) row[t] -= fp * float(count[t]) + pp;
        count[t] = 0;
      }
      for (int64_t i = po[b]; i < po[b + 1]; ++i) seen[prompt[i]] = 0;
      for (int64_t i = oo[b]; i < oo[b + 1]; ++i) seen[output[i]] = 0;
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> compute_logprobs(const at::Tensor& logits, const at::Tensor& token_ids,
                                                                int64_t num_top) {
  check_device_type(logits, "logits", c10::DeviceType::CPU);
  const DType dtype = check_logprobs_args(logits, token_ids, num_top);
  const int64_t batch = logits.size(0), vocab = logits.size(1);
  const int64_t* ids = token_ids.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(ids[b] >= 0 && ids[b] < vocab, "token_ids[", b, "] = ", ids[b], " is not a token id in [0, ", vocab,
                ")");
  }
  auto options = logits.options().dtype(at::kFloat);
  at::Tensor chosen = at::empty({batch}, options);
  at::Tensor top_ids = at::empty({batch, num_top}, options.dtype(at::kLong));
  at::Tensor top_logprobs = at::empty({batch, num_top}, options);
  const KernelTable& kt = active_kernels();
  const char* base = static_cast<const char*>(logits.data_ptr());
  const int64_t row_bytes = logits.stride(0) * logits.element_size();
  std::vector<float> row_max(batch);
  for (int64_t b = 0; b < batch; ++b) row_max[b] = checked_max(kt, dtype, base + b * row_bytes, vocab, b);
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    for (int64_t b = begin; b < end; ++b) {
      const void* row = base + b * row_bytes;
      const float max = row_max[b];
      s.p.resize(vocab);
      const float log_z = max + float(std::log(kt.exp_sum[int(dtype)](row, vocab, max, 1.f, s.p.data())));
      chosen.data_ptr<float>()[b] = logit_at(row, dtype, ids[b]) - log_z;
      if (num_top == 0) continue;
      top_k_candidates(kt, dtype, row, vocab, num_top, max, 1.f, s);
      // Fewer finite logits than num_top: the rest are -inf tokens, lowest index first.
      for (int64_t i = 0; int64_t(s.tokens.size()) < num_top; ++i) {
        if (logit_at(row, dtype, i) == -std::numeric_limits<float>::infinity()) s.tokens.push_back({int32_t(i), 0.f});
      }
      for (int64_t i = 0; i < num_top; ++i) {
        top_ids.data_ptr<int64_t>()[b * num_top + i] = s.tokens[i].index;
        top_logprobs.data_ptr<float>()[b * num_top + i] = logit_at(row, dtype, s.tokens[i].index) - log_z;
      }
    }
  });
  return {chosen, top_ids, top_logprobs};
}

}  // namespace kvflow::cpu
