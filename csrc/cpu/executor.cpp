// CpuProgram: prepare every node, then one parallel region over the schedule of their phases.
#include "executor.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kvflow/cpu/kernel_table.h"
#include "kvflow/cpu/spin_barrier.h"

namespace kvflow::cpu {
namespace {

// What a thread asks for while it waits at a barrier: the first cell of its next product.
constexpr int64_t kAheadBytes = 32 << 10;

std::atomic<int64_t> region_steps{0}, region_wall_ns{0}, region_thread_ns{0}, region_wait_ns{0}, prepare_ns{0};

// Op timing: one slot per (op, phase), the same across programs; each thread adds its replay's
// times once, after its walk.
struct OpTimeSlot {
  std::string op;
  int phase;
  int64_t runs = 0, run_ns = 0, wait_ns = 0;
};
std::atomic<bool> op_timing{false};
std::mutex op_times_mutex;
std::vector<OpTimeSlot> op_time_slots;
std::map<std::pair<std::string, int>, int64_t> op_time_index;

int64_t op_time_slot(const std::string& op, int phase) {
  std::lock_guard<std::mutex> lock(op_times_mutex);
  const auto [found, added] = op_time_index.try_emplace({op, phase}, int64_t(op_time_slots.size()));
  if (added) op_time_slots.push_back({op, phase});
  return found->second;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

using NodeFactory = std::unique_ptr<OpNode> (*)(const NodeArgs&);

const std::unordered_map<std::string, NodeFactory>& node_factories() {
  static const std::unordered_map<std::string, NodeFactory> factories{
      {"embedding", &make_embedding_node},
      {"rms_norm", &make_rms_norm_node},
      {"fused_add_rms_norm", &make_fused_add_rms_norm_node},
      {"rms_norm_add", &make_rms_norm_add_node},
      {"rotary_embedding", &make_rotary_embedding_node},
      {"silu_and_mul", &make_gated_activation_node},
      {"gelu_and_mul", &make_gated_activation_node},
      {"gelu_tanh_and_mul", &make_gated_activation_node},
      {"reshape_and_cache", &make_reshape_and_cache_node},
      {"paged_attention", &make_paged_attention_node},
      {"small_linear", &make_small_linear_node},
      {"packed_linear", &make_packed_linear_node},
      {"packed_silu_and_mul", &make_packed_linear_node},
      {"quantized_linear", &make_quantized_linear_node},
      {"quantized_embedding", &make_quantized_embedding_node},
      {"scale_logits", &make_scale_logits_node},
      {"sample", &make_sample_node},
  };
  return factories;
}

}  // namespace

const at::Tensor& NodeArgs::tensor(size_t i) const {
  TORCH_CHECK(i < tensors.size() && tensors[i].has_value(), op, ": tensor argument ", i, " is missing");
  return *tensors[i];
}

const std::optional<at::Tensor>& NodeArgs::optional_tensor(size_t i) const {
  TORCH_CHECK(i < tensors.size(), op, ": tensor argument ", i, " is missing");
  return tensors[i];
}

int64_t NodeArgs::integer(size_t i) const {
  TORCH_CHECK(i < ints.size(), op, ": int argument ", i, " is missing");
  return ints[i];
}

double NodeArgs::real(size_t i) const {
  TORCH_CHECK(i < floats.size(), op, ": float argument ", i, " is missing");
  return floats[i];
}

void CpuProgram::add(NodeArgs args) {
  const auto& factories = node_factories();
  const auto found = factories.find(args.op);
  TORCH_CHECK(found != factories.end(), "the CPU executor has no node for the op kvflow::", args.op);
  nodes_.push_back(found->second(args));
  ops_.push_back(args.op);
}

bool CpuProgram::starts_shared(size_t i) const {
  TORCH_CHECK(i < nodes_.size(), "node ", i, " of a program of ", nodes_.size());
  return nodes_[i]->starts_shared();
}

void CpuProgram::configure(const void* kernels, int64_t threads) {
  step_nodes_.clear();
  schedule_.clear();
  for (size_t i = 0; i < nodes_.size(); ++i) {
    OpNode* node = nodes_[i].get();
    node->configure(threads);
    if (node->reads_step()) step_nodes_.push_back(node);
    for (int phase = 0; phase < node->phases(); ++phase) {
      schedule_.push_back({node, phase, node->units(phase), node->phase_may_skip(phase), op_time_slot(ops_[i], phase), {}});
    }
  }
  // A phase that warms early does so as the shared phase before the one it follows starts.
  for (size_t i = 0; i < schedule_.size(); ++i) {
    if (!schedule_[i].node->warms_early(schedule_[i].phase)) continue;
    size_t j = i;
    while (j > 0 && schedule_[j - 1].units != kShared) --j;  // back past the row-local phases before it
    if (j == 0) continue;
    schedule_[j - 1].warmed_early.push_back(i);
  }
  configured_kernels_ = kernels;
  configured_threads_ = threads;
}

void CpuProgram::run(int64_t max_query_len, int64_t max_seq_len) {
  const int64_t start = now_ns();
  const int64_t threads = at::in_parallel_region() ? 1 : std::max<int64_t>(1, at::get_num_threads());
  const void* kernels = &active_kernels();
  if (kernels != configured_kernels_ || threads != configured_threads_) configure(kernels, threads);
  StepContext step;
  step.threads = threads;
  step.max_query_len = max_query_len;
  step.max_seq_len = max_seq_len;
  step.workspace = workspace_;
  for (OpNode* node : step_nodes_) node->prepare(step);
  workspace_ = step.workspace;
  const uint64_t round = uint64_t(++replays_);

  // Every thread walks the same schedule and makes the same decisions: a barrier before a phase
  // unless it and the phase before it are row-local over the same units.
  const bool timed = op_timing.load(std::memory_order_relaxed);
  // After shared phase i: the row-local phases up to the next shared one warm their lines.
  auto warm_row_local_after = [&](size_t i, const Turn& turn) {
    for (size_t j = i + 1; j < schedule_.size() && schedule_[j].units != kShared; ++j) {
      const Entry& next = schedule_[j];
      if (!next.may_skip || next.node->phase_active(next.phase)) next.node->warm(next.phase, turn);
    }
  };
  auto walk = [&](int64_t tid, int64_t team, SpinBarrier* barrier, int64_t& waited) {
    const Turn turn{tid, team, round};
    int64_t previous = kShared;
    bool first = true;
    std::vector<std::array<int64_t, 3>> times(timed ? schedule_.size() : 0);  // (ran, run ns, wait ns)
    for (size_t i = 0; i < schedule_.size(); ++i) {
      const Entry& entry = schedule_[i];
      if (entry.may_skip && !entry.node->phase_active(entry.phase)) continue;
      const bool follows_same_rows = previous != kShared && entry.units == previous;
      if (barrier != nullptr && !first && !follows_same_rows) {
        const int64_t wait_start = now_ns();
        barrier->wait(team, entry.node->first_read(entry.phase, tid), kAheadBytes);
        const int64_t wait = now_ns() - wait_start;
        waited += wait;
        if (timed) times[i][2] = wait;
      }
      const int64_t run_start = timed ? now_ns() : 0;
      for (size_t k : entry.warmed_early) {
        const Entry& later = schedule_[k];
        if (!later.may_skip || later.node->phase_active(later.phase)) later.node->warm_early(later.phase, turn);
      }
      entry.node->run(entry.phase, turn);
      if (entry.units == kShared) warm_row_local_after(i, turn);
      if (timed) times[i] = {1, now_ns() - run_start, times[i][2]};
      previous = entry.units;
      first = false;
    }
    if (timed) {
      std::lock_guard<std::mutex> lock(op_times_mutex);
      for (size_t i = 0; i < schedule_.size(); ++i) {
        OpTimeSlot& slot = op_time_slots[size_t(schedule_[i].timing_slot)];
        if (tid == 0) slot.runs += times[i][0];
        slot.run_ns += times[i][1];
        slot.wait_ns += times[i][2];
      }
    }
  };
#ifdef _OPENMP
  if (threads > 1) {
    SpinBarrier barrier;
    const int64_t region_start = now_ns();
    prepare_ns.fetch_add(region_start - start, std::memory_order_relaxed);
#pragma omp parallel num_threads(threads)
    {
      const int64_t thread_start = now_ns();
      int64_t waited = 0;
      walk(omp_get_thread_num(), omp_get_num_threads(), &barrier, waited);
      region_wait_ns.fetch_add(waited, std::memory_order_relaxed);
      region_thread_ns.fetch_add(now_ns() - thread_start, std::memory_order_relaxed);
    }
    region_wall_ns.fetch_add(now_ns() - region_start, std::memory_order_relaxed);
    region_steps.fetch_add(1, std::memory_order_relaxed);
  } else
#endif
  {
    int64_t unused = 0;
    walk(0, 1, nullptr, unused);
  }
  for (OpNode* node : step_nodes_) node->finish();
}

void set_executor_op_timing(bool on) { op_timing.store(on, std::memory_order_relaxed); }

std::vector<OpTime> executor_op_times() {
  std::lock_guard<std::mutex> lock(op_times_mutex);
  std::vector<OpTime> times;
  for (const OpTimeSlot& slot : op_time_slots) {
    if (slot.runs > 0) times.push_back({slot.op, slot.phase, slot.runs, slot.run_ns * 1e-9, slot.wait_ns * 1e-9});
  }
  return times;
}

RegionStats executor_region_stats() {
  return {region_steps.load(std::memory_order_relaxed), region_wall_ns.load(std::memory_order_relaxed) * 1e-9,
          region_thread_ns.load(std::memory_order_relaxed) * 1e-9, region_wait_ns.load(std::memory_order_relaxed) * 1e-9,
          prepare_ns.load(std::memory_order_relaxed) * 1e-9};
}

}  // namespace kvflow::cpu
