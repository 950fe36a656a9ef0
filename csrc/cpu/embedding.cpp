// embedding on the CPU: every token id range-checked before any row is written, then rows
// copied (and scaled, where asked), tokens split across threads.
#include <ATen/Parallel.h>

#include <cstring>

#include "kvflow/numeric.h"
#include "op_checks.h"
#include "op_node.h"
#include "ops.h"
#include "token_ids.h"

namespace kvflow::cpu {
namespace {

template <typename T>
void scale_row(T* out, const T* row, int64_t width, float scale) {
  for (int64_t i = 0; i < width; ++i) out[i] = from_float<T>(to_float(row[i]) * scale);
}

// Rows [begin, end) of out: the rows of weight the ids name, times scale (rounded once).
void copy_rows(void* out, const int64_t* ids, const void* weight, int64_t row_bytes, DType dtype, float scale,
               int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    char* dst = static_cast<char*>(out) + t * row_bytes;
    const char* src = static_cast<const char*>(weight) + ids[t] * row_bytes;
    if (scale == 1.f) {
      std::memcpy(dst, src, row_bytes);
    } else if (dtype == DType::kFloat32) {
      scale_row(reinterpret_cast<float*>(dst), reinterpret_cast<const float*>(src), row_bytes / 4, scale);
    } else if (dtype == DType::kFloat16) {
      scale_row(reinterpret_cast<float16*>(dst), reinterpret_cast<const float16*>(src), row_bytes / 2, scale);
    } else {
      scale_row(reinterpret_cast<bfloat16*>(dst), reinterpret_cast<const bfloat16*>(src), row_bytes / 2, scale);
    }
  }
}

class EmbeddingNode final : public OpNode {
 public:
  explicit EmbeddingNode(const NodeArgs& args)
      : out_(args.tensor(0)), token_ids_(args.tensor(1)), weight_(args.tensor(2)), scale_(float(args.real(0))) {
    check_device_type(weight_, "weight", c10::DeviceType::CPU);
    geometry_ = check_embedding_args(out_, token_ids_, weight_);
    dtype_ = kernel_dtype(weight_, "weight");
  }

  bool reads_step() const override { return true; }

  void prepare(StepContext&) override {
    check_token_ids(token_ids_.data_ptr<int64_t>(), geometry_.num_tokens, geometry_.vocab_size);
  }

  int64_t units(int) const override { return geometry_.num_tokens; }

  void run(int, const Turn& turn) override {
    const Range tokens = share_of(geometry_.num_tokens, 1, turn.team, turn.tid);
    copy_rows(out_.data_ptr(), token_ids_.data_ptr<int64_t>(), weight_.data_ptr(), geometry_.row_bytes, dtype_, scale_,
              tokens.begin, tokens.end);
  }

 private:
  at::Tensor out_, token_ids_, weight_;
  float scale_;
  EmbeddingGeometry geometry_{};
  DType dtype_ = DType::kFloat32;
};

}  // namespace

std::unique_ptr<OpNode> make_embedding_node(const NodeArgs& args) { return std::make_unique<EmbeddingNode>(args); }

void embedding(at::Tensor& out, const at::Tensor& token_ids, const at::Tensor& weight, double scale) {
  check_device_type(weight, "weight", c10::DeviceType::CPU);
  const EmbeddingGeometry g = check_embedding_args(out, token_ids, weight);
  const DType dtype = kernel_dtype(weight, "weight");
  const int64_t* ids = token_ids.data_ptr<int64_t>();
  check_token_ids(ids, g.num_tokens, g.vocab_size);
  void* out_ptr = out.data_ptr();
  const void* w = weight.data_ptr();
  at::parallel_for(0, g.num_tokens, std::max<int64_t>(1, 32768 / std::max<int64_t>(g.row_bytes, 1)),
                   [&](int64_t begin, int64_t end) {
                     copy_rows(out_ptr, ids, w, g.row_bytes, dtype, float(scale), begin, end);
                   });
}

}  // namespace kvflow::cpu
