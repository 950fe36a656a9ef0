// The CPU step executor: a program of op nodes (op_node.h), captured once per step shape class
// from the model's own op calls, replayed inside one parallel region. The threads start once
// per step and meet at a spin barrier between dependent nodes, each running its share of each
// node: cells of a product's output features, attention items, rows of the row-local ops. Every
// output comes from the same kernel over the same inputs as the op called on its own, so the
// result is bit for bit the op-by-op one. It knows ops, never a model.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "op_node.h"

namespace kvflow::cpu {

class CpuProgram {
 public:
  // Appends the node of one op call (arguments in schema order, by kind). Throws, naming the op,
  // for an op without a node or arguments its node refuses; the program is then unusable.
  void add(NodeArgs args);

  size_t size() const { return nodes_.size(); }
  // Whether a barrier always precedes node i (see OpNode::starts_shared).
  bool starts_shared(size_t i) const;

  // One replay: every node that reads the step prepares (reads and checks this step's metadata;
  // throws before any node writes), then all run in one parallel region of
  // at::get_num_threads() threads.
  void run(int64_t max_query_len, int64_t max_seq_len);

  int64_t replays() const { return replays_; }

 private:
  // One phase of one node in the region.
  struct Entry {
    OpNode* node;
    int phase;
    int64_t units;
    bool may_skip;
    int64_t timing_slot;  // the (op, phase) it counts under while op timing is on
    std::vector<size_t> warmed_early;  // later entries whose lines this shared phase asks for as it starts
  };

  void configure(const void* kernels, int64_t threads);

  std::vector<std::unique_ptr<OpNode>> nodes_;
  std::vector<std::string> ops_;  // each node's op
  // Set by configure: the kernels and thread count the nodes are configured for, the nodes that
  // read the step, and every phase in order.
  const void* configured_kernels_ = nullptr;
  int64_t configured_threads_ = 0;
  std::vector<OpNode*> step_nodes_;
  std::vector<Entry> schedule_;
  at::Tensor workspace_;
  int64_t replays_ = 0;
};

// What the replays cost so far, summed over every replay with two or more threads since the
// process started: how many, their wall time, the time their threads spent waiting at the
// barriers between nodes (thread-seconds, summed over the threads), and the time before the
// region (every node's prepare, the schedule). Waits are a few percent of
// the threads' time when they have the cores to themselves; far more when another process
// takes one of them.
struct RegionStats {
  int64_t steps;
  double wall_seconds;
  double thread_seconds;
  double wait_thread_seconds;
  double prepare_seconds;
};
RegionStats executor_region_stats();

// Where replays spend their threads' time, by op: off until switched on (two clock reads a
// phase and thread); summed over every replay since, of any thread count. A phase's wait is the
// time its threads spent at the barrier before it, for the phases before it to end.
struct OpTime {
  std::string op;
  int phase;
  int64_t runs;                // replays that ran the phase (skipped ones do not count)
  double run_thread_seconds;   // summed over the threads
  double wait_thread_seconds;  // at the barrier before it, summed over the threads
};
void set_executor_op_timing(bool on);
std::vector<OpTime> executor_op_times();

}  // namespace kvflow::cpu
