// The sampler's selections on the CPU, torch-free: which tokens a row may draw (greedy; else
// top-k, top-p, min-p) and the draw itself. The vectorised passes over the vocabulary (max, exp,
// threshold scans) come from the kernel table; the selections touch only candidates: top-k by a
// rising threshold, top-p by partitioning on probability mass (a quickselect), so the vocabulary
// is never sorted. The twin of kvflow/sampling.cuh; cpu/sampling.cpp checks the rows and runs them.
#pragma once

#include <cstdint>
#include <vector>

#include "kvflow/cpu/kernel_table.h"
#include "kvflow/numeric.h"

namespace kvflow::cpu {

struct RowParams {
  float temperature;  // 0: greedy
  int64_t top_k;      // 0: all tokens
  float top_p;        // 1: all
  float min_p;        // 0: off
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

float logit_at(const void* row, DType dtype, int64_t i);

// The top k tokens by logit (ties: lower index first), sorted that way, into s.tokens with p =
// exp((logit - max) * inv_t): a scan keeps every index above a threshold that rises to the k-th
// best value seen so far. -inf logits are never candidates, so a row with fewer finite logits
// than k gives those.
void top_k_candidates(const KernelTable& kt, DType dtype, const void* row, int64_t vocab, int64_t k, float max,
                      float inv_t, Scratch& s);

// Keeps, of tokens (any order), the shortest prefix of the (p desc, index asc) order whose mass
// reaches target (at least one token): partitions around pivots instead of sorting. Appends it to
// kept.
void take_mass(std::vector<Token>& tokens, double target, std::vector<Token>& kept);

// The lowest index holding the row's maximum `max` (a value the row holds).
int32_t argmax(const KernelTable& kt, DType dtype, const void* row, int64_t vocab, float max, Scratch& s);

// The tokens a row may draw into s.kept, with their unnormalised probabilities, in increasing
// index order. max: the row's largest logit (finite; the row holds no NaN or +inf).
void kept_tokens(const KernelTable& kt, DType dtype, const void* row, int64_t vocab, const RowParams& r,
                 float max, Scratch& s);

// One token of kept, drawn with probability proportional to p by Philox keyed by (seed, offset).
int32_t draw(const std::vector<Token>& kept, uint64_t seed, uint64_t offset);

}  // namespace kvflow::cpu
