#include "decode_steps.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>

namespace kvflow::cpu {
namespace {

void check_column(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t rows) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 1 && t.size(0) == rows && t.is_contiguous(),
              "run_decode_steps: ", name, " must be a contiguous CPU ", dtype, " tensor of ", rows,
              " rows (the program's), got ", t.scalar_type(), " ", t.sizes());
}

}  // namespace

std::vector<double> run_decode_steps(CpuProgram& program, const DecodeStepBuffers& b, int64_t rows, int64_t steps,
                                     int64_t block_size, int64_t max_seq_len, const at::Tensor& stop_token_ids,
                                     at::Tensor& tokens_out) {
  const int64_t program_rows = b.token_ids.size(0);
  check_column(b.token_ids, "token_ids", at::kLong, program_rows);
  check_column(b.positions, "positions", at::kLong, program_rows);
  check_column(b.slot_mapping, "slot_mapping", at::kLong, program_rows);
  check_column(b.seq_lens, "seq_lens", at::kInt, program_rows);
  check_column(b.offsets, "offsets", at::kLong, program_rows);
  check_column(b.sampled, "sampled", at::kLong, program_rows);
  TORCH_CHECK(b.block_tables.device().is_cpu() && b.block_tables.scalar_type() == at::kInt && b.block_tables.dim() == 2 &&
                  b.block_tables.size(0) == program_rows && b.block_tables.is_contiguous(),
              "run_decode_steps: block_tables must be a contiguous CPU int32 tensor [", program_rows,
              ", max_blocks_per_seq], got ", b.block_tables.scalar_type(), " ", b.block_tables.sizes());
  TORCH_CHECK(1 <= rows && rows <= program_rows, "run_decode_steps: rows must be in [1, ", program_rows, "], got ", rows);
  TORCH_CHECK(steps >= 1, "run_decode_steps: steps must be at least 1, got ", steps);
  TORCH_CHECK(block_size >= 1, "run_decode_steps: block_size must be at least 1, got ", block_size);
  TORCH_CHECK(tokens_out.device().is_cpu() && tokens_out.scalar_type() == at::kLong && tokens_out.dim() == 2 &&
                  tokens_out.size(0) == steps && tokens_out.size(1) == rows && tokens_out.is_contiguous(),
              "run_decode_steps: tokens_out must be a contiguous CPU int64 tensor [", steps, ", ", rows, "], got ",
              tokens_out.scalar_type(), " ", tokens_out.sizes());

  int64_t* ids = b.token_ids.data_ptr<int64_t>();
  int64_t* positions = b.positions.data_ptr<int64_t>();
  int64_t* slots = b.slot_mapping.data_ptr<int64_t>();
  int32_t* seq_lens = b.seq_lens.data_ptr<int32_t>();
  int64_t* offsets = b.offsets.data_ptr<int64_t>();
  const int64_t* sampled = b.sampled.data_ptr<int64_t>();
  const int32_t* tables = b.block_tables.data_ptr<int32_t>();
  const int64_t max_blocks = b.block_tables.size(1);
  int64_t longest = 1;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t last = positions[i] + steps - 1;
    TORCH_CHECK(positions[i] >= 0 && last < max_seq_len, "run_decode_steps: row ", i, " would reach position ", last,
                "; the context holds ", max_seq_len);
    TORCH_CHECK(last / block_size < max_blocks, "run_decode_steps: row ", i, " would reach position ", last,
                ", past its block table of ", max_blocks, " blocks");
    for (int64_t block = positions[i] / block_size; block <= last / block_size; ++block) {
      TORCH_CHECK(tables[i * max_blocks + block] >= 0, "run_decode_steps: row ", i, " has no block ", block,
                  " for its positions up to ", last);
    }
    longest = std::max(longest, int64_t(seq_lens[i]));
  }

  check_column(stop_token_ids, "stop_token_ids", at::kLong, stop_token_ids.size(0));
  const int64_t* stops = stop_token_ids.data_ptr<int64_t>();
  const int64_t* stops_end = stops + stop_token_ids.size(0);
  std::vector<bool> stopped(size_t(rows), false);
  int64_t running = rows;

  int64_t* out = tokens_out.data_ptr<int64_t>();
  std::vector<std::chrono::steady_clock::time_point> ends;
  for (int64_t step = 0; step < steps && running > 0; ++step) {
    if (step > 0) {
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t position = ++positions[i];
        ids[i] = sampled[i];
        slots[i] = int64_t(tables[i * max_blocks + position / block_size]) * block_size + position % block_size;
        seq_lens[i] = int32_t(position + 1);
        ++offsets[i];
      }
      ++longest;
    }
    program.run(1, longest);
    std::copy(sampled, sampled + rows, out + step * rows);
    ends.push_back(std::chrono::steady_clock::now());
    for (int64_t i = 0; i < rows; ++i) {
      if (!stopped[size_t(i)] && std::find(stops, stops_end, sampled[i]) != stops_end) {
        stopped[size_t(i)] = true;
        --running;
      }
    }
  }
  std::vector<double> before_last;
  for (const auto& end : ends) before_last.push_back(std::chrono::duration<double>(ends.back() - end).count());
  return before_last;
}

}  // namespace kvflow::cpu
