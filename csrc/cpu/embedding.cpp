// embedding on the CPU: every token id range-checked before any row is written, then rows
// copied, tokens split across threads.
#include <ATen/Parallel.h>

#include <cstring>

#include "op_checks.h"
#include "op_node.h"
#include "ops.h"

namespace kvflow::cpu {
namespace {

void check_token_ids(const int64_t* ids, int64_t num_tokens, int64_t vocab_size) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(ids[t] >= 0 && ids[t] < vocab_size, "token_ids[", t, "] = ", ids[t], " is not a token id in [0, ",
                vocab_size, ")");
  }
}

void copy_rows(void* out, const int64_t* ids, const void* weight, int64_t row_bytes, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    std::memcpy(static_cast<char*>(out) + t * row_bytes, static_cast<const char*>(weight) + ids[t] * row_bytes,
                row_bytes);
  }
}

class EmbeddingNode final : public OpNode {
 public:
  explicit EmbeddingNode(const NodeArgs& args)
      : out_(args.tensor(0)), token_ids_(args.tensor(1)), weight_(args.tensor(2)) {
    check_device_type(weight_, "weight", c10::DeviceType::CPU);
    geometry_ = check_embedding_args(out_, token_ids_, weight_);
  }

  bool reads_step() const override { return true; }

  void prepare(StepContext&) override {
    check_token_ids(token_ids_.data_ptr<int64_t>(), geometry_.num_tokens, geometry_.vocab_size);
  }

  int64_t units(int) const override { return geometry_.num_tokens; }

  void run(int, const Turn& turn) override {
    const Range tokens = share_of(geometry_.num_tokens, 1, turn.team, turn.tid);
    copy_rows(out_.data_ptr(), token_ids_.data_ptr<int64_t>(), weight_.data_ptr(), geometry_.row_bytes, tokens.begin,
              tokens.end);
  }

 private:
  at::Tensor out_, token_ids_, weight_;
  EmbeddingGeometry geometry_{};
};

}  // namespace

std::unique_ptr<OpNode> make_embedding_node(const NodeArgs& args) { return std::make_unique<EmbeddingNode>(args); }

void embedding(at::Tensor& out, const at::Tensor& token_ids, const at::Tensor& weight) {
  check_device_type(weight, "weight", c10::DeviceType::CPU);
  const EmbeddingGeometry g = check_embedding_args(out, token_ids, weight);
  const int64_t* ids = token_ids.data_ptr<int64_t>();
  check_token_ids(ids, g.num_tokens, g.vocab_size);
  void* out_ptr = out.data_ptr();
  const void* w = weight.data_ptr();
  at::parallel_for(0, g.num_tokens, std::max<int64_t>(1, 32768 / std::max<int64_t>(g.row_bytes, 1)),
                   [&](int64_t begin, int64_t end) { copy_rows(out_ptr, ids, w, g.row_bytes, begin, end); });
}

}  // namespace kvflow::cpu
