// quantized_embedding on the CPU: the embedding lookup on a table kept in GGUF blocks, or in
// kvflow's interleaved layout of them (an LM head's weight tied to the table: gguf_blocks.h).
// Every token id is range-checked before any row is written; each row is then dequantized chunk
// by chunk (and scaled, where asked) into out's dtype, tokens split across threads.
#include <ATen/Parallel.h>

#include <vector>

#include "kvflow/cpu/gguf_blocks.h"
#include "op_checks.h"
#include "op_node.h"
#include "ops.h"
#include "token_ids.h"

namespace kvflow::cpu {
namespace {

QuantizedEmbeddingGeometry check_quantized_embedding(const at::Tensor& out, const at::Tensor& token_ids,
                                                     const at::Tensor& weight, int64_t ggml_type) {
  const int64_t base_type = interleaved_base_type(ggml_type);
  QuantizedEmbeddingGeometry g = check_quantized_embedding_args(out, token_ids, weight,
                                                                base_type >= 0 ? base_type : ggml_type,
                                                                c10::DeviceType::CPU);
  g.interleaved = base_type >= 0;
  TORCH_CHECK(!g.interleaved || g.vocab_size % kInterleavedRows == 0, "quantized_embedding: a table of type ",
              ggml_type, " (rows interleaved in groups of ", kInterleavedRows, ") has a multiple of ",
              kInterleavedRows, " rows, got ", g.vocab_size);
  return g;
}

template <typename T>
void dequantize_rows(T* out, const int64_t* ids, const uint8_t* weight, const QuantizedEmbeddingGeometry& g,
                     float scale, int64_t begin, int64_t end) {
  const int64_t block_bytes = quant_block_bytes(g.format), chunks = quant_block_chunks(g.format);
  float values[kQuantBlock];
  std::vector<uint8_t> gathered(g.interleaved ? size_t(g.row_bytes) : 0);
  for (int64_t t = begin; t < end; ++t) {
    const uint8_t* row = weight + ids[t] * g.row_bytes;
    if (g.interleaved) {
      gather_interleaved_rows(weight, g.row_bytes, g.format, ids[t], 1, gathered.data());
      row = gathered.data();
    }
    T* dst = out + t * g.hidden;
    for (int64_t b = 0; b < g.hidden / kQuantBlock; ++b) {
      dequantize_chunk(g.format, row + b / chunks * block_bytes, int(b % chunks), values);
      for (int64_t j = 0; j < kQuantBlock; ++j) dst[b * kQuantBlock + j] = from_float<T>(values[j] * scale);
    }
  }
}

void embed_tokens(const at::Tensor& out, const int64_t* ids, const at::Tensor& weight,
                  const QuantizedEmbeddingGeometry& g, float scale, int64_t begin, int64_t end) {
  const uint8_t* w = weight.data_ptr<uint8_t>();
  switch (g.out_dtype) {
    case DType::kFloat32:
      return dequantize_rows(out.data_ptr<float>(), ids, w, g, scale, begin, end);
    case DType::kFloat16:
      return dequantize_rows(reinterpret_cast<float16*>(out.data_ptr()), ids, w, g, scale, begin, end);
    case DType::kBFloat16:
      return dequantize_rows(reinterpret_cast<bfloat16*>(out.data_ptr()), ids, w, g, scale, begin, end);
  }
}

class QuantizedEmbeddingNode final : public OpNode {
 public:
  explicit QuantizedEmbeddingNode(const NodeArgs& args)
      : out_(args.tensor(0)), token_ids_(args.tensor(1)), weight_(args.tensor(2)),
        geometry_(check_quantized_embedding(out_, token_ids_, weight_, args.integer(0))), scale_(float(args.real(0))) {}

  bool reads_step() const override { return true; }

  void prepare(StepContext&) override {
    check_token_ids(token_ids_.data_ptr<int64_t>(), geometry_.num_tokens, geometry_.vocab_size);
  }

  int64_t units(int) const override { return geometry_.num_tokens; }

  void run(int, const Turn& turn) override {
    const Range tokens = share_of(geometry_.num_tokens, 1, turn.team, turn.tid);
    embed_tokens(out_, token_ids_.data_ptr<int64_t>(), weight_, geometry_, scale_, tokens.begin, tokens.end);
  }

 private:
  at::Tensor out_, token_ids_, weight_;
  QuantizedEmbeddingGeometry geometry_;
  float scale_;
};

}  // namespace

std::unique_ptr<OpNode> make_quantized_embedding_node(const NodeArgs& args) {
  return std::make_unique<QuantizedEmbeddingNode>(args);
}

void quantized_embedding(at::Tensor& out, const at::Tensor& token_ids, const at::Tensor& weight, int64_t ggml_type,
                         double scale) {
  const QuantizedEmbeddingGeometry g = check_quantized_embedding(out, token_ids, weight, ggml_type);
  const int64_t* ids = token_ids.data_ptr<int64_t>();
  check_token_ids(ids, g.num_tokens, g.vocab_size);
  at::parallel_for(0, g.num_tokens, std::max<int64_t>(1, 4096 / std::max<int64_t>(g.hidden, 1)),
                   [&](int64_t begin, int64_t end) { embed_tokens(out, ids, weight, g, float(scale), begin, end); });
}

}  // namespace kvflow::cpu
