// Sampling on the CPU: every row's parameters and logits checked, then per row the kept set of
// tokens and one Philox draw over them (kvflow/cpu/sampling_select.h). Rows run in parallel;
// sample is also a node of the CPU executor's programs.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvflow/cpu/kernel_table.h"
#include "kvflow/cpu/sampling_select.h"
#include "kvflow/philox.h"
#include "op_checks.h"
#include "op_node.h"
#include "ops.h"

namespace kvflow::cpu {
namespace {

void check_params(const RowParams& r, int64_t row) {
  TORCH_CHECK(r.temperature >= 0.f && std::isfinite(r.temperature), "temperature[", row, "] = ", r.temperature,
              " must be finite and >= 0 (0 = greedy)");
  TORCH_CHECK(r.top_k >= 0, "top_k[", row, "] = ", r.top_k, " must be >= 0 (0 = all tokens)");
  TORCH_CHECK(r.top_p > 0.f && r.top_p <= 1.f, "top_p[", row, "] = ", r.top_p, " must be in (0, 1]");
  TORCH_CHECK(r.min_p >= 0.f && r.min_p <= 1.f, "min_p[", row, "] = ", r.min_p, " must be in [0, 1]");
}

RowParams row_params(const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                     const at::Tensor& min_p, int64_t b) {
  return {temperature.data_ptr<float>()[b], top_k.data_ptr<int32_t>()[b], top_p.data_ptr<float>()[b],
          min_p.data_ptr<float>()[b]};
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
    rows.params[b] = row_params(temperature, top_k, top_p, min_p, b);
    check_params(rows.params[b], b);
  }
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) rows.max[b] = checked_max(kt, dtype, base + b * row_bytes, vocab, b);
  });
  return rows;
}

// The row's token: its kept set, then one draw (a greedy row keeps only its argmax).
int64_t sample_row(const KernelTable& kt, DType dtype, const void* row, int64_t vocab, const RowParams& params,
                   float max, int64_t seed, int64_t offset, Scratch& scratch) {
  kept_tokens(kt, dtype, row, vocab, params, max, scratch);
  return draw(scratch.kept, uint64_t(seed), uint64_t(offset));
}

void check_sample_args(const at::Tensor& out, const at::Tensor& logits, const at::Tensor& seeds,
                       const at::Tensor& offsets) {
  check_row_param(seeds, "seeds", at::kLong, logits);
  check_row_param(offsets, "offsets", at::kLong, logits);
  check_row_param(out, "out", at::kLong, logits);
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous");
}

// sample as a node of a captured program: the parameters are read and checked before the region,
// and each row's logits (written by the nodes before it) checked as it is sampled. A row with a
// NaN or +inf logit, or none finite, leaves its token at -1 and fails the replay after the region,
// with the op's message.
class SampleNode final : public OpNode {
 public:
  explicit SampleNode(const NodeArgs& args)
      : out_(args.tensor(0)), logits_(args.tensor(1)), temperature_(args.tensor(2)), top_k_(args.tensor(3)),
        top_p_(args.tensor(4)), min_p_(args.tensor(5)), seeds_(args.tensor(6)), offsets_(args.tensor(7)) {
    check_device_type(logits_, "logits", c10::DeviceType::CPU);
    geometry_ = check_sampling_args(logits_, temperature_, top_k_, top_p_, min_p_);
    check_sample_args(out_, logits_, seeds_, offsets_);
    params_.resize(geometry_.batch);
    bad_row_.resize(geometry_.batch);
  }

  void configure(int64_t threads) override {
    kernels_ = &active_kernels();
    scratch_.assign(threads, Scratch{});
  }

  bool reads_step() const override { return true; }

  void prepare(StepContext&) override {
    for (int64_t b = 0; b < geometry_.batch; ++b) {
      params_[b] = row_params(temperature_, top_k_, top_p_, min_p_, b);
      check_params(params_[b], b);
    }
  }

  int64_t units(int) const override { return geometry_.batch; }

  void run(int, const Turn& turn) override {
    const KernelTable& kt = *kernels_;
    const char* base = static_cast<const char*>(logits_.data_ptr());
    const int64_t row_bytes = logits_.stride(0) * logits_.element_size();
    int64_t* out = out_.data_ptr<int64_t>();
    const Range rows = share_of(geometry_.batch, 1, turn.team, turn.tid);
    for (int64_t b = rows.begin; b < rows.end; ++b) {
      const char* row = base + b * row_bytes;
      bool non_finite = false;
      const float max = kt.row_max[int(geometry_.dtype)](row, geometry_.vocab, &non_finite);
      bad_row_[b] = non_finite || max == -std::numeric_limits<float>::infinity();
      out[b] = bad_row_[b] ? -1
                           : sample_row(kt, geometry_.dtype, row, geometry_.vocab, params_[b], max,
                                        seeds_.data_ptr<int64_t>()[b], offsets_.data_ptr<int64_t>()[b],
                                        scratch_[turn.tid]);
    }
  }

  void finish() override {
    const char* base = static_cast<const char*>(logits_.data_ptr());
    for (int64_t b = 0; b < geometry_.batch; ++b) {
      if (bad_row_[b]) {
        checked_max(*kernels_, geometry_.dtype, base + b * logits_.stride(0) * logits_.element_size(),
                    geometry_.vocab, b);
      }
    }
  }

 private:
  at::Tensor out_, logits_, temperature_, top_k_, top_p_, min_p_, seeds_, offsets_;
  SamplingGeometry geometry_{};
  const KernelTable* kernels_ = nullptr;
  std::vector<RowParams> params_;
  std::vector<uint8_t> bad_row_;
  std::vector<Scratch> scratch_;
};

}  // namespace

std::unique_ptr<OpNode> make_sample_node(const NodeArgs& args) { return std::make_unique<SampleNode>(args); }

void sample(at::Tensor& out, const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
            const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& seeds, const at::Tensor& offsets) {
  check_device_type(logits, "logits", c10::DeviceType::CPU);
  const SamplingGeometry g = check_sampling_args(logits, temperature, top_k, top_p, min_p);
  check_sample_args(out, logits, seeds, offsets);
  const KernelTable& kt = active_kernels();
  const char* base = static_cast<const char*>(logits.data_ptr());
  const int64_t row_bytes = logits.stride(0) * logits.element_size();
  const CheckedRows rows = check_rows(kt, g.dtype, base, row_bytes, g.batch, g.vocab, temperature, top_k, top_p, min_p);
  int64_t* tokens = out.data_ptr<int64_t>();
  at::parallel_for(0, g.batch, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t b = begin; b < end; ++b) {
      tokens[b] = sample_row(kt, g.dtype, base + b * row_bytes, g.vocab, rows.params[b], rows.max[b],
                             seeds.data_ptr<int64_t>()[b], offsets.data_ptr<int64_t>()[b], scratch);
    }
  });
}

void rejection_sample(at::Tensor& out, at::Tensor& num_emitted, const at::Tensor& logits,
                      const at::Tensor& draft_token_ids, const at::Tensor& cu_rows, const at::Tensor& temperature,
                      const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                      const at::Tensor& seeds, const at::Tensor& offsets) {
  check_device_type(logits, "logits", c10::DeviceType::CPU);
  const SamplingGeometry g = check_rejection_sample_args(out, num_emitted, logits, draft_token_ids, cu_rows,
                                                         temperature, top_k, top_p, min_p, seeds, offsets);
  const int64_t rows = logits.size(0);
  const int64_t* cu = cu_rows.data_ptr<int64_t>();
  const int64_t* drafts = draft_token_ids.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[g.batch] == rows, "cu_rows must run from 0 to ", rows, " (the rows of logits)");
  std::vector<RowParams> params(g.batch);
  for (int64_t b = 0; b < g.batch; ++b) {
    TORCH_CHECK(cu[b + 1] > cu[b], "cu_rows must be increasing: request ", b, " has no row");
    for (int64_t r = cu[b]; r < cu[b + 1] - 1; ++r) {
      TORCH_CHECK(drafts[r] >= 0 && drafts[r] < g.vocab, "draft_token_ids[", r, "] = ", drafts[r],
                  " is not a token id in [0, ", g.vocab, ")");
    }
    params[b] = row_params(temperature, top_k, top_p, min_p, b);
    check_params(params[b], b);
  }
  const KernelTable& kt = active_kernels();
  const char* base = static_cast<const char*>(logits.data_ptr());
  const int64_t row_bytes = logits.stride(0) * logits.element_size();
  std::vector<float> row_max(rows);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row_max[r] = checked_max(kt, g.dtype, base + r * row_bytes, g.vocab, r);
  });
  int64_t* tokens = out.data_ptr<int64_t>();
  int64_t* emitted = num_emitted.data_ptr<int64_t>();
  at::parallel_for(0, g.batch, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t b = begin; b < end; ++b) {
      int64_t r = cu[b];
      for (; r < cu[b + 1]; ++r) {
        tokens[r] = sample_row(kt, g.dtype, base + r * row_bytes, g.vocab, params[b], row_max[r],
                               seeds.data_ptr<int64_t>()[b], offsets.data_ptr<int64_t>()[b] + (r - cu[b]), scratch);
        if (r == cu[b + 1] - 1 || tokens[r] != drafts[r]) break;
      }
      emitted[b] = r - cu[b] + 1;
      std::fill(tokens + r + 1, tokens + cu[b + 1], int64_t(-1));
    }
  });
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
