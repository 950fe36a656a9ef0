// apply_token_bitmask on the CPU: checks (rows in range before anything is written), then each
// masked row's words (kvflow/token_bitmask.h), spread across threads.
#include <ATen/Parallel.h>

#include <algorithm>

#include "kvflow/token_bitmask.h"
#include "op_checks.h"
#include "ops.h"

namespace kvflow::cpu {
namespace {

constexpr int64_t kWordGrain = 512;  // 16,384 tokens

}  // namespace

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const std::optional<at::Tensor>& rows) {
  check_device_type(logits, "logits", c10::DeviceType::CPU);
  check_token_bitmask_args(logits, bitmask, rows);
  const int64_t mask_rows = bitmask.size(0), num_words = bitmask.size(1), vocab = logits.size(1);
  const int64_t* row_ids = rows.has_value() ? rows->data_ptr<int64_t>() : nullptr;
  for (int64_t m = 0; row_ids != nullptr && m < mask_rows; ++m) {
    TORCH_CHECK(row_ids[m] >= 0 && row_ids[m] < logits.size(0), "apply_token_bitmask: rows[", m, "] = ", row_ids[m],
                " is not a logits row in [0, ", logits.size(0), ")");
  }
  float* base = logits.data_ptr<float>();
  const int32_t* words = bitmask.data_ptr<int32_t>();
  const int64_t used_words = std::min(num_words, (vocab + 31) / 32);
  // Units of work: each row's words, and one more per row for the tokens past its last word.
  const int64_t per_row = used_words + 1;
  at::parallel_for(0, mask_rows * per_row, kWordGrain, [&](int64_t begin, int64_t end) {
    while (begin < end) {
      const int64_t m = begin / per_row, first = begin % per_row;
      const int64_t last = std::min(per_row, first + (end - begin));
      float* row = base + (row_ids == nullptr ? m : row_ids[m]) * logits.stride(0);
      apply_token_bitmask_words(row, vocab, words + m * num_words, first, std::min(last, used_words));
      if (last == per_row) mask_tokens_past_words(row, vocab, num_words);
      begin += last - first;
    }
  });
}

}  // namespace kvflow::cpu
