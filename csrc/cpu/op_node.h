// A CPU op as a node of a captured program (executor.h): its arguments bound once, at capture; a
// prepare half run before every replay (reads the step's metadata, checks it, splits the work for
// the region's threads) and a run half over one thread's share. Each op's file defines its node;
// the op itself is the same two halves, run once.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "kvflow/cpu/product_cells.h"

namespace kvflow::cpu {

struct PagedAttentionPlan;

// What the nodes of one replay share while they prepare: the step's scalars, the thread count, the
// checks already made of the step's metadata (every layer reads the same positions and slots),
// the attention work lists (every layer of a step splits the same requests alike), and scratch.
struct StepContext {
  int64_t threads = 1;
  int64_t max_query_len = 0;
  int64_t max_seq_len = 0;
  std::set<std::vector<int64_t>> checked;
  std::map<std::vector<int64_t>, std::shared_ptr<const PagedAttentionPlan>> attention_plans;
  at::Tensor workspace;  // float32, grown as the attention nodes need (split-key partials)

  // True the first time a check of this key is asked for in the step: the caller makes it.
  bool first_time(std::vector<int64_t> key) { return checked.insert(std::move(key)).second; }
};

// How a phase shares its work among the region's threads.
// kShared: every thread takes part, and the whole phase is done before anything after it starts.
// Otherwise the phase is row-local over that many units (tokens): thread t takes units
// share_of(units, 1, team, t), and its rows depend only on the same rows of its inputs, so two
// row-local phases over the same units follow each other without a barrier.
constexpr int64_t kShared = -1;

class OpNode {
 public:
  virtual ~OpNode() = default;
  // Before the region, every replay: reads and checks what changes from step to step, splits
  // the work for step.threads. May throw: no node has written anything yet.
  virtual void prepare(StepContext& step) { (void)step; }
  // How many phases this step (after prepare), and how each shares its work.
  virtual int phases() const { return 1; }
  virtual int64_t units(int phase) const = 0;
  // Thread tid's share of a phase, inside the region: must not throw.
  virtual void run(int phase, int64_t tid, int64_t team) = 0;
  // What thread tid reads first in a phase (asked for while it waits at the barrier before), or null.
  virtual const char* first_read(int phase, int64_t tid) const {
    (void)phase;
    (void)tid;
    return nullptr;
  }
  // Whether the first phase is always shared, whatever the step: a barrier always precedes the
  // node, so memory read only by the nodes before it may be reused from it on.
  bool starts_shared() const { return units(0) == kShared; }
};

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
std::unique_ptr<OpNode> make_rotary_embedding_node(const NodeArgs& args);
std::unique_ptr<OpNode> make_gated_activation_node(const NodeArgs& args);  // silu/gelu/gelu_tanh_and_mul
std::unique_ptr<OpNode> make_reshape_and_cache_node(const NodeArgs& args);
std::unique_ptr<OpNode> make_paged_attention_node(const NodeArgs& args);
std::unique_ptr<OpNode> make_small_linear_node(const NodeArgs& args);
std::unique_ptr<OpNode> make_packed_linear_node(const NodeArgs& args);  // packed_linear, packed_silu_and_mul

}  // namespace kvflow::cpu
