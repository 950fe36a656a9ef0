// Several decode steps of one program back to back, with no Python between them: each step's
// sampled tokens are the next step's input tokens, and every row moves one position on. The
// host's work between steps (scheduling, filling the inputs, detokenizing) is done once for all
// of them; after a step of streamed weights the interpreter runs from cold caches, so that work
// costs a tenth of a step of a small model (docs/benchmarks.md).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "executor.h"

namespace kvflow::cpu {

// The static input buffers a decode program reads, and the tokens it samples into. Rows past
// `rows` are padding and stay as they are.
struct DecodeStepBuffers {
  at::Tensor token_ids;     // [program rows] int64
  at::Tensor positions;     // [program rows] int64
  at::Tensor slot_mapping;  // [program rows] int64
  at::Tensor seq_lens;      // [program rows] int32
  at::Tensor block_tables;  // [program rows, max_blocks_per_seq] int32: blocks for every step's position
  at::Tensor offsets;       // [program rows] int64: each row's output index, for its sampling stream
  at::Tensor sampled;       // [program rows] int64: what the program's sampler writes
};

// Runs up to `steps` replays of `program`. The buffers hold the first step's inputs; before each
// later step, row i takes the token it sampled and position + 1 (slot from its block table). The
// steps end early once every row has drawn one of stop_token_ids ([n] int64, maybe empty): the
// caller's stop conditions would drop whatever came after. Writes each step's first `rows`
// sampled tokens to tokens_out [steps, rows] (int64) and returns each step run's end, in seconds
// before the last one's. Throws before the first step for buffers of the wrong type or shape and
// for a later position past a row's block table or max_seq_len.
std::vector<double> run_decode_steps(CpuProgram& program, const DecodeStepBuffers& buffers, int64_t rows,
                                     int64_t steps, int64_t block_size, int64_t max_seq_len,
                                     const at::Tensor& stop_token_ids, at::Tensor& tokens_out);

}  // namespace kvflow::cpu
