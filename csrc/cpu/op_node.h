// A CPU op as a node of a captured program (executor.h): its arguments bound once, at capture; a
// prepare half run before every replay (reads the step's metadata, checks it, splits the work for
// the region's threads) and a run half over one thread's share. Each op's file defines its node;
// the op itself is the same two halves, run once.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvflow/cpu/product_cells.h"

namespace kvflow::cpu {

struct PagedAttentionPlan;

// What the nodes of one replay share while they prepare: the step's scalars, the thread count, the
// checks already made of the step's metadata (every layer reads the same positions and slots),
// the attention work lists (every layer of a step splits the same requests alike), and scratch.
struct StepContext {
  using CheckKey = std::array<int64_t, 4>;
  using PlanKey = std::array<int64_t, 20>;

  int64_t threads = 1;
  int64_t max_query_len = 0;
  int64_t max_seq_len = 0;
  std::vector<CheckKey> checked;  // a handful a step: a flat list beats a set
  std::vector<std::pair<PlanKey, std::shared_ptr<const PagedAttentionPlan>>> attention_plans;
  at::Tensor workspace;  // float32, grown as the attention nodes need (split-key partials)

  // True the first time a check of this key is asked for in the step: the caller makes it.
  bool first_time(const CheckKey& key) {
    if (std::find(checked.begin(), checked.end(), key) != checked.end()) return false;
    checked.push_back(key);
    return true;
  }

  // The attention plan made this step under this key, or null.
  std::shared_ptr<const PagedAttentionPlan> attention_plan(const PlanKey& key) const {
    for (const auto& [k, plan] : attention_plans) {
      if (k == key) return plan;
    }
    return nullptr;
  }
};

// How a phase shares its work among the region's threads.
// kShared: every thread takes part, and the whole phase is done before anything after it starts.
// Otherwise the phase is row-local over that many units (tokens): thread t takes units
// share_of(units, 1, team, t), and its rows depend only on the same rows of its inputs, so two
// row-local phases over the same units follow each other without a barrier.
constexpr int64_t kShared = -1;

// One thread's turn at a phase: its id, the team, and the replay's round (product_cells.h).
struct Turn {
  int64_t tid;
  int64_t team;
  uint64_t round;
};

class OpNode {
 public:
  virtual ~OpNode() = default;
  // Before the first replay, and again whenever the kernels' instruction set or the thread count
  // has changed since the last: kernel pointers, per-thread state.
  virtual void configure(int64_t threads) { (void)threads; }
  // Whether prepare must run before every replay: the node reads the step's data (positions,
  // slots, lengths, token ids). Nodes that do not are not touched before the region.
  virtual bool reads_step() const { return false; }
  // Before the region, every replay: reads and checks what changes from step to step, splits
  // the work for step.threads. May throw: no node has written anything yet.
  virtual void prepare(StepContext& step) { (void)step; }
  // The most phases a step may have, and how each shares its work (fixed at capture).
  virtual int phases() const { return 1; }
  virtual int64_t units(int phase) const = 0;
  // Whether a phase may have nothing to do in some steps; if so, phase_active (after prepare)
  // says whether it runs in this one.
  virtual bool phase_may_skip(int phase) const {
    (void)phase;
    return false;
  }
  virtual bool phase_active(int phase) const {
    (void)phase;
    return true;
  }
  // One thread's share of a phase, inside the region: must not throw.
  virtual void run(int phase, const Turn& turn) = 0;
  // After the region, every replay (nodes that read the step only): throws for an error found
  // while running (run itself must not throw), such as logits a sampler cannot draw from.
  virtual void finish() {}
  // What thread tid reads first in a phase (asked for while it waits at the barrier before), or null.
  virtual const char* first_read(int phase, int64_t tid) const {
    (void)phase;
    (void)tid;
    return nullptr;
  }
  // Right after the shared phase before a row-local one: asks for the lines thread turn.tid's
  // share of the row-local phase will touch that are ready already (weights, rows written before
  // that shared phase, outputs it overwrites), so that they arrive while the threads finish the
  // shared phase. At batch 1 a row-local op otherwise spends most of its time waiting for
  // them, on the one thread that has the row (docs/benchmarks.md).
  virtual void warm(int phase, const Turn& turn) const {
    (void)phase;
    (void)turn;
  }
  // Whether `phase` asks for lines a phase earlier than warm does: while the shared phase before
  // the one it follows runs (the products before a layer's attention), for lines that come from
  // far (another core, L3, memory) and are ready by then.
  virtual bool warms_early(int phase) const {
    (void)phase;
    return false;
  }
  virtual void warm_early(int phase, const Turn& turn) const {
    (void)phase;
    (void)turn;
  }
  // Whether the first phase is always shared, whatever the step: a barrier always precedes the
  // node, so memory read only by the nodes before it may be reused from it on.
  bool starts_shared() const { return units(0) == kShared; }
};

// Asks for the lines of rows [rows.begin, rows.end) of a buffer, row_bytes of each stride_bytes
// apart, whole rows until kWarmBytes are asked for (a large share is a long phase that streams
// on its own); with `write` for lines the phase overwrites, so that they come in writable.
constexpr int64_t kWarmBytes = 8 << 10;

inline void warm_rows(const void* base, int64_t stride_bytes, int64_t row_bytes, Range rows, bool write) {
  const char* first = static_cast<const char*>(base);
  int64_t budget = kWarmBytes;
  for (int64_t r = rows.begin; r < rows.end && budget > 0; ++r, budget -= row_bytes) {
    const char* row = first + r * stride_bytes;
    for (int64_t line = 0; line < row_bytes; line += 64) {
      if (write) {
        __builtin_prefetch(row + line, 1, 3);
      } else {
        __builtin_prefetch(row + line, 0, 3);
      }
    }
  }
}

// A node's arguments as its op's schema lists them, by kind, each in schema order: tensors
// (nullopt for an absent optional one), ints (bools too), floats.
struct NodeArgs {
  std::string op;
  std::vector<std::optional<at::Tensor>> tensors;
  std::vector<int64_t> ints;
  std::vector<double> floats;

  const at::Tensor& tensor(size_t i) const;  // required: throws naming the op when absent
  const std::optional<at::Tensor>& optional_tensor(size_t i) const;
  int64_t integer(size_t i) const;
  double real(size_t i) const;
};

// A row-local phase over the rows of a tensor [units, ...] (its leading dimensions collapsed
// into rows): thread tid's units, as rows.
struct RowShare {
  int64_t units = 0;
  int64_t rows_per_unit = 1;

  static RowShare of(const at::Tensor& t, int64_t rows) {
    const int64_t units = t.dim() >= 2 ? t.size(0) : 1;
    return {units, units > 0 ? rows / units : 1};
  }

  Range rows(int64_t tid, int64_t team) const {
    const Range share = share_of(units, 1, team, tid);
    return {share.begin * rows_per_unit, share.end * rows_per_unit};
  }
};

// The nodes, one per op that has one (each defined in its op's file).
std::unique_ptr<OpNode> make_embedding_node(const NodeArgs& args);
std::unique_ptr<OpNode> make_rms_norm_node(const NodeArgs& args);
std::unique_ptr<OpNode> make_fused_add_rms_norm_node(const NodeArgs& args);
std::unique_ptr<OpNode> make_rms_norm_add_node(const NodeArgs& args);
std::unique_ptr<OpNode> make_rotary_embedding_node(const NodeArgs& args);
std::unique_ptr<OpNode> make_gated_activation_node(const NodeArgs& args);  // silu/gelu/gelu_tanh_and_mul
std::unique_ptr<OpNode> make_reshape_and_cache_node(const NodeArgs& args);
std::unique_ptr<OpNode> make_paged_attention_node(const NodeArgs& args);
std::unique_ptr<OpNode> make_small_linear_node(const NodeArgs& args);
std::unique_ptr<OpNode> make_packed_linear_node(const NodeArgs& args);  // packed_linear, packed_silu_and_mul
std::unique_ptr<OpNode> make_quantized_linear_node(const NodeArgs& args);
std::unique_ptr<OpNode> make_quantized_embedding_node(const NodeArgs& args);
std::unique_ptr<OpNode> make_scale_logits_node(const NodeArgs& args);
std::unique_ptr<OpNode> make_sample_node(const NodeArgs& args);

}  // namespace kvflow::cpu
