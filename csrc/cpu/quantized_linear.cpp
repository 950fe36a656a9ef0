// quantized_linear on the CPU. Few rows (decode): the input rows are quantized to int8 per
// 32-block once, then each thread takes a contiguous part of the output features and streams its
// weight rows, in their GGUF blocks, front to back; as a program node, the same two halves are two
// phases, and a thread done with its part takes cells of a slower one's. Many bfloat16 rows
// (prefill, batched decode; for an interleaved weight, from a count per format and instruction
// set): each thread dequantizes one panel of kPackedLinearPanel weight rows at a time into
// packed_linear's layout, in its own scratch, and runs packed_linear's kernel on it for every
// row, so a weight is dequantized once per call, not once per row.
#include <ATen/Parallel.h>

#include <string>
#include <vector>

#include "kvflow/cpu/batch_invariance.h"
#include "kvflow/cpu/gguf_blocks.h"
#include "kvflow/cpu/kernel_table.h"
#include "kvflow/cpu/product_cells.h"
#include "op_checks.h"
#include "op_node.h"
#include "ops.h"

namespace kvflow::cpu {

namespace {

// Output features a thread takes at least: fewer would not pay for the hand-off.
constexpr int64_t kFeaturesPerTask = 64;
// Rows from which bfloat16 input goes through dequantized panels (see docs/benchmarks.md).
constexpr int64_t kPanelRows = 32;

struct QuantizedLinearPlan {
  int format;
  int64_t rows, chunks, row_bytes, out_features;  // chunks: of 32 input features
  int64_t out_stride;                             // elements from one output row to the next
  bool out_is_float32;
  bool panels;       // the many-row path
  bool interleaved;  // the weight in kvflow's interleaved layout (gguf_blocks.h)
  int64_t num_panels() const { return (out_features + kPackedLinearPanel - 1) / kPackedLinearPanel; }
  // Whether the int8 kernels read the input blocks' first-half sums (QuantizedRows::first_half_sum).
  bool half_sums() const { return QuantFormat(format) == QuantFormat::kQ6_K; }
  int64_t panel_elems() const { return chunks * kQuantBlock * kPackedLinearPanel; }
};

// The active instruction set's kernel for an interleaved weight, or null where it has none.
QuantizedLinearFn interleaved_kernel(const QuantizedLinearPlan& g) {
  return g.interleaved ? active_kernels().quantized_linear_interleaved[interleaved_index(QuantFormat(g.format))] : nullptr;
}

// Bytes of GGUF rows a thread gathers from an interleaved weight for the panels, or where the
// instruction set has no kernel for it (multiply_rows), else 0.
int64_t gather_bytes(const QuantizedLinearPlan& g) {
  return g.interleaved && (g.panels || interleaved_kernel(g) == nullptr) ? kPackedLinearPanel * g.row_bytes : 0;
}

QuantizedLinearPlan check_quantized_linear(const at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                                           int64_t ggml_type, const std::optional<at::Tensor>& bias) {
  const int64_t base_type = interleaved_base_type(ggml_type);
  const bool interleaved = base_type >= 0;
  const QuantizedLinearGeometry g = check_quantized_linear_args(out, input, weight, interleaved ? base_type : ggml_type,
                                                                bias, c10::DeviceType::CPU);
  TORCH_CHECK(!interleaved || g.out_features % kInterleavedRows == 0, "quantized_linear: a weight of type ", ggml_type,
              " (rows interleaved in groups of ", kInterleavedRows, ") has a multiple of ", kInterleavedRows,
              " rows, got ", g.out_features);
  // An interleaved weight's int8 kernel beats the dequantized panels up to a row count that
  // depends on the format and the instruction set (KernelTable::interleaved_panel_rows).
  // Batch-invariant mode keeps every row count on the int8 kernel, whose sums are exact.
  const int64_t panel_rows =
      interleaved ? active_kernels().interleaved_panel_rows[interleaved_index(QuantFormat(g.format))] : kPanelRows;
  const bool panels = panel_rows > 0 && !batch_invariant() && g.rows >= panel_rows &&
                      input.scalar_type() == at::kBFloat16 && input.stride(1) == 1;
  return {int(g.format), g.rows, g.in_features / kQuantBlock, g.row_bytes, g.out_features, g.out_stride,
          out.scalar_type() == at::kFloat, panels, interleaved};
}

// The few-row product for output features [begin, end). An interleaved weight without a kernel
// of its own on this instruction set is gathered back into GGUF rows, kPackedLinearPanel at a
// time, for the format's kernel.
void multiply_rows(const QuantizedLinearPlan& g, void* out, const QuantizedRows& x, const uint8_t* weight,
                   const float* bias, int64_t begin, int64_t end, uint8_t* gathered) {
  const KernelTable& kernels = active_kernels();
  if (!g.interleaved) {
    kernels.quantized_linear[g.format](out, g.out_is_float32, x, weight, g.row_bytes, bias, g.rows, g.out_stride,
                                       begin, end);
    return;
  }
  const QuantizedLinearFn interleaved = interleaved_kernel(g);
  if (interleaved != nullptr) {
    interleaved(out, g.out_is_float32, x, weight, g.row_bytes, bias, g.rows, g.out_stride, begin, end);
    return;
  }
  const int64_t element = g.out_is_float32 ? 4 : 2;
  for (int64_t first = begin; first < end; first += kPackedLinearPanel) {
    const int64_t count = std::min<int64_t>(kPackedLinearPanel, end - first);
    gather_interleaved_rows(weight, g.row_bytes, QuantFormat(g.format), first, count, gathered);
    kernels.quantized_linear[g.format](static_cast<char*>(out) + first * element, g.out_is_float32, x, gathered,
                                       g.row_bytes, bias == nullptr ? nullptr : bias + first, g.rows, g.out_stride,
                                       0, count);
  }
}

// Panels [begin, end) of the product, each dequantized into scratch (panel_elems() bfloat16);
// an interleaved weight's panel rows are gathered into GGUF's layout first (gather_bytes()).
void multiply_panels(const QuantizedLinearPlan& g, at::Tensor& out, const at::Tensor& input, const uint8_t* weight,
                     const bfloat16* bias, int64_t begin, int64_t end, bfloat16* scratch, uint8_t* gathered) {
  const KernelTable& kernels = active_kernels();
  const int64_t element = g.out_is_float32 ? 4 : 2;
  for (int64_t p = begin; p < end; ++p) {
    const int64_t first = p * kPackedLinearPanel;
    if (g.interleaved) {
      const int64_t count = std::min<int64_t>(kPackedLinearPanel, g.out_features - first);
      gather_interleaved_rows(weight, g.row_bytes, QuantFormat(g.format), first, count, gathered);
      kernels.dequantize_panel[g.format](gathered, g.row_bytes, count, 0, scratch);
    } else {
      kernels.dequantize_panel[g.format](weight, g.row_bytes, g.out_features, p, scratch);
    }
    kernels.packed_linear(static_cast<char*>(out.data_ptr()) + first * element, g.out_stride, g.out_is_float32,
                          /*silu_and_mul=*/false, reinterpret_cast<const bfloat16*>(input.data_ptr()),
                          input.stride(0), scratch, bias == nullptr ? nullptr : bias + first, g.rows,
                          g.chunks * kQuantBlock, g.out_features - first, 0, 1);
  }
}

std::vector<bfloat16> bfloat16_values(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return {};
  const at::Tensor b = t->to(at::kBFloat16).contiguous();
  const auto* data = reinterpret_cast<const bfloat16*>(b.data_ptr());
  return std::vector<bfloat16>(data, data + b.numel());
}

std::vector<float> float_values(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return {};
  const at::Tensor f = t->to(at::kFloat).contiguous();
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}

// Input rows quantized chunk by chunk (quantize_activation_block), from rows of float32 or
// bfloat16 with any row stride.
struct QuantizedInput {
  std::vector<int8_t> q;
  std::vector<float> scale_sum;
  std::vector<int32_t> code_sum;
  std::vector<int32_t> first_half_sum;  // Q6_K's weights only: each block's first 16 codes summed
  int64_t blocks = 0;

  QuantizedInput(int64_t rows, int64_t blocks, bool half_sums) : blocks(blocks) {
    q.resize(size_t(rows * blocks * kQuantBlock));
    scale_sum.resize(size_t(2 * rows * blocks));
    code_sum.resize(size_t(rows * blocks));
    if (half_sums) first_half_sum.resize(size_t(rows * blocks));
  }

  // Rows [begin, end) of input; `row` is scratch of in_features floats.
  void quantize(const at::Tensor& input, int64_t begin, int64_t end, float* row) {
    const QuantizeActivationsFn* kernels = active_kernels().quantize_activations;
    const int64_t in_features = blocks * kQuantBlock, stride = input.stride(0);
    const bool is_float32 = input.scalar_type() == at::kFloat;
    for (int64_t r = begin; r < end; ++r) {
      int8_t* codes = q.data() + r * blocks * kQuantBlock;
      float* scales = &scale_sum[size_t(2 * r * blocks)];
      int32_t* sums = &code_sum[size_t(r * blocks)];
      if (input.stride(1) == 1) {
        const char* values = static_cast<const char*>(input.data_ptr()) + r * stride * input.element_size();
        kernels[is_float32 ? 0 : 1](values, blocks, codes, scales, sums);
      } else {
        for (int64_t k = 0; k < in_features; ++k) {
          row[k] = is_float32 ? input.data_ptr<float>()[r * stride + k * input.stride(1)]
                              : to_float(reinterpret_cast<const bfloat16*>(input.data_ptr())[r * stride + k * input.stride(1)]);
        }
        kernels[0](row, blocks, codes, scales, sums);
      }
      if (!first_half_sum.empty()) sum_first_halves(codes, &first_half_sum[size_t(r * blocks)]);
    }
  }

  QuantizedRows rows() const {
    return {q.data(), scale_sum.data(), code_sum.data(), blocks,
            first_half_sum.empty() ? nullptr : first_half_sum.data()};
  }

  void sum_first_halves(const int8_t* codes, int32_t* sums) const {
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t sum = 0;
      for (int j = 0; j < kQuantBlock / 2; ++j) sum += codes[b * kQuantBlock + j];
      sums[b] = sum;
    }
  }

  // Rows [rows.begin, rows.end) of the codes and scales, which quantize overwrites.
  void warm(Range rows) const {
    warm_rows(q.data(), blocks * kQuantBlock, blocks * kQuantBlock, rows, true);
    warm_rows(scale_sum.data(), 2 * blocks * int64_t(sizeof(float)), 2 * blocks * int64_t(sizeof(float)), rows, true);
    warm_rows(code_sum.data(), blocks * int64_t(sizeof(int32_t)), blocks * int64_t(sizeof(int32_t)), rows, true);
    if (!first_half_sum.empty()) {
      warm_rows(first_half_sum.data(), blocks * int64_t(sizeof(int32_t)), blocks * int64_t(sizeof(int32_t)), rows, true);
    }
  }
};

// Phase 0 quantizes the input rows, each thread its own as the row-local node before it left
// them (so no barrier comes between); phase 1 multiplies, the output cut into one part per thread
// and handed out in cells (ProductCells): a thread done with its part takes cells from the back
// of a slower one's. A cell is whole groups of an interleaved weight, whole panels on the
// many-row path.
class QuantizedLinearNode final : public OpNode {
 public:
  explicit QuantizedLinearNode(const NodeArgs& args)
      : out_(args.tensor(0)), input_(args.tensor(1)), weight_(args.tensor(2)),
        geometry_(check_quantized_linear(out_, input_, weight_, args.integer(0), args.optional_tensor(3))),
        quantized_(geometry_.panels ? 0 : geometry_.rows, geometry_.chunks, geometry_.half_sums()) {
    // The bias in the dtype its path reads: bfloat16 for the panels' kernel, float32 (the model's
    // tensor itself where it is float32 already, read at every replay) for the int8 path.
    if (geometry_.panels) {
      bias_bfloat16_ = bfloat16_values(args.optional_tensor(3));
    } else if (args.optional_tensor(3).has_value()) {
      bias_ = args.optional_tensor(3)->to(at::kFloat).contiguous();
    }
  }

  void configure(int64_t threads) override {
    const QuantizedLinearPlan& g = geometry_;
    if (g.panels) {
      panel_scratch_.assign(size_t(threads), std::vector<bfloat16>(size_t(g.panel_elems())));
    } else {
      rows_scratch_.assign(size_t(threads), std::vector<float>(size_t(g.chunks * kQuantBlock)));
    }
    gathered_.assign(size_t(threads), std::vector<uint8_t>(size_t(gather_bytes(g))));
    if (cells_ == nullptr || cells_->parts() != threads) {
      const int64_t cell_units = g.panels ? g.num_panels() : g.out_features / unit_features();
      const int64_t unit_rows = g.panels ? kPackedLinearPanel : unit_features();
      cells_ = std::make_unique<ProductCells>(weight_.data_ptr(), cell_units, unit_rows * g.row_bytes, threads,
                                              g.panels ? 1 : kFeaturesPerTask / unit_features(), /*tile=*/1);
    }
  }

  int phases() const override { return 2; }
  int64_t units(int phase) const override { return phase == 0 ? geometry_.rows : kShared; }

  // Phase 0's quantized rows, which it overwrites (the input is the row-local result before it).
  void warm(int phase, const Turn& turn) const override {
    const QuantizedLinearPlan& g = geometry_;
    if (phase != 0 || g.panels || g.rows == 0 || g.out_features == 0) return;
    quantized_.warm(share_of(g.rows, 1, turn.team, turn.tid));
  }

  void run(int phase, const Turn& turn) override {
    const QuantizedLinearPlan& g = geometry_;
    if (g.rows == 0 || g.out_features == 0) return;
    if (phase == 0) {
      if (g.panels) return;
      const Range rows = share_of(g.rows, 1, turn.team, turn.tid);
      quantized_.quantize(input_, rows.begin, rows.end, rows_scratch_[size_t(turn.tid)].data());
      return;
    }
    const auto* weight = weight_.data_ptr<uint8_t>();
    uint8_t* gathered = gathered_[size_t(turn.tid)].data();
    if (g.panels) {
      bfloat16* scratch = panel_scratch_[size_t(turn.tid)].data();
      const bfloat16* bias = bias_bfloat16_.empty() ? nullptr : bias_bfloat16_.data();
      cells_->run(
          turn.tid,
          [&](int64_t begin, int64_t end) {
            multiply_panels(g, out_, input_, weight, bias, begin, end, scratch, gathered);
          },
          turn.round);
      return;
    }
    const int64_t unit = unit_features();
    const float* bias = bias_.defined() ? bias_.data_ptr<float>() : nullptr;
    cells_->run(
        turn.tid,
        [&](int64_t begin, int64_t end) {
          multiply_rows(g, out_.data_ptr(), quantized_.rows(), weight, bias, begin * unit, end * unit, gathered);
        },
        turn.round);
  }

  const char* first_read(int phase, int64_t tid) const override {
    return phase == 1 && cells_ != nullptr ? cells_->first_read(tid) : nullptr;
  }

 private:
  // Output features per unit of the cells on the few-row path: a group of an interleaved weight.
  int64_t unit_features() const { return geometry_.interleaved ? kInterleavedRows : 1; }

  at::Tensor out_, input_, weight_;
  QuantizedLinearPlan geometry_;
  at::Tensor bias_;  // the int8 path's, float32, or undefined
  std::vector<bfloat16> bias_bfloat16_;  // the many-row path's, or empty
  QuantizedInput quantized_;
  std::vector<std::vector<float>> rows_scratch_;
  std::vector<std::vector<bfloat16>> panel_scratch_;
  std::vector<std::vector<uint8_t>> gathered_;  // each thread's GGUF rows of an interleaved weight
  std::unique_ptr<ProductCells> cells_;
};

}  // namespace

std::unique_ptr<OpNode> make_quantized_linear_node(const NodeArgs& args) {
  return std::make_unique<QuantizedLinearNode>(args);
}

void quantized_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight, int64_t ggml_type,
                      const std::optional<at::Tensor>& bias) {
  const QuantizedLinearPlan g = check_quantized_linear(out, input, weight, ggml_type, bias);
  if (g.rows == 0 || g.out_features == 0) return;
  if (g.panels) {
    const std::vector<bfloat16> bias_values = bfloat16_values(bias);
    const bfloat16* b = bias_values.empty() ? nullptr : bias_values.data();
    at::parallel_for(0, g.num_panels(), 1, [&](int64_t begin, int64_t end) {
      std::vector<bfloat16> scratch(size_t(g.panel_elems()));
      std::vector<uint8_t> gathered(size_t(gather_bytes(g)));
      multiply_panels(g, out, input, weight.data_ptr<uint8_t>(), b, begin, end, scratch.data(), gathered.data());
    });
    return;
  }
  const std::vector<float> bias_values = float_values(bias);
  QuantizedInput x(g.rows, g.chunks, g.half_sums());
  at::parallel_for(0, g.rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(size_t(g.chunks * kQuantBlock));
    x.quantize(input, begin, end, row.data());
  });
  const QuantizedRows quantized = x.rows();
  void* out_ptr = out.data_ptr();
  const auto* w = weight.data_ptr<uint8_t>();
  const float* b = bias_values.empty() ? nullptr : bias_values.data();
  const int64_t unit = g.interleaved ? kInterleavedRows : 1;  // output features, whole groups when interleaved
  at::parallel_for(0, g.out_features / unit, kFeaturesPerTask / unit, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> gathered(size_t(gather_bytes(g)));
    multiply_rows(g, out_ptr, quantized, w, b, begin * unit, end * unit, gathered.data());
  });
}

}  // namespace kvflow::cpu
