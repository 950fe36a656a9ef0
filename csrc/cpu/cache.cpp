// reshape_and_cache and copy_blocks on the CPU: plain copies of whole token rows and whole
// blocks. Slot and block indices are read and range-checked before anything is written, so a
// bad index leaves the cache untouched.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "op_checks.h"
#include "op_node.h"
#include "ops.h"
#include "prepared_ops.h"

namespace kvflow::cpu {
namespace {

void check_slots(const int64_t* slots, int64_t num_tokens, int64_t num_slots) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t], " is outside [-1, ",
                num_slots, ") (num_blocks * block_size; -1 skips the token)");
  }
  // Tokens are copied in parallel: two writing one slot would leave it a mix of both.
  std::vector<int64_t> used(slots, slots + num_tokens);
  std::sort(used.begin(), used.end());
  const auto repeat = std::adjacent_find(std::lower_bound(used.begin(), used.end(), int64_t(0)), used.end());
  TORCH_CHECK(repeat == used.end(), "slot_mapping holds slot ", repeat == used.end() ? 0 : *repeat,
              " more than once");
}

// The slots are checked once a step for all the nodes that read them with one cache size.
class CacheWriteNode final : public OpNode {
 public:
  explicit CacheWriteNode(const NodeArgs& args)
      : key_(args.tensor(0)),
        value_(args.tensor(1)),
        key_cache_(args.tensor(2)),
        value_cache_(args.tensor(3)),
        slot_mapping_(args.tensor(4)),
        plan_(plan_reshape_and_cache(key_, value_, key_cache_, value_cache_, slot_mapping_, false)) {
    num_slots_ = key_cache_.size(0) * key_cache_.size(1);
  }

  bool reads_step() const override { return true; }

  void prepare(StepContext& step) override {
    if (step.first_time({kCheckSlots, reinterpret_cast<int64_t>(plan_.slots), plan_.num_tokens, num_slots_})) {
      check_slots(plan_.slots, plan_.num_tokens, num_slots_);
    }
  }

  int64_t units(int) const override { return plan_.num_tokens; }

  // The cache rows of its tokens' slots, which it overwrites (key and value are the product just
  // made).
  void warm(int, const Turn& turn) const override {
    const Range tokens = share_of(plan_.num_tokens, 1, turn.team, turn.tid);
    for (int64_t t = tokens.begin; t < tokens.end && t < tokens.begin + kWarmTokens; ++t) {
      const int64_t slot = plan_.slots[t];
      if (slot < 0 || slot >= num_slots_) continue;
      warm_rows(key_cache_.data_ptr(), plan_.row_bytes, plan_.row_bytes, {slot, slot + 1}, true);
      warm_rows(value_cache_.data_ptr(), plan_.row_bytes, plan_.row_bytes, {slot, slot + 1}, true);
    }
  }

  void run(int, const Turn& turn) override {
    const Range tokens = share_of(plan_.num_tokens, 1, turn.team, turn.tid);
    write_cache_tokens(plan_, key_cache_.data_ptr(), value_cache_.data_ptr(), tokens.begin, tokens.end);
  }

 private:
  static constexpr int64_t kCheckSlots = 2;
  static constexpr int64_t kWarmTokens = 8;
  at::Tensor key_, value_, key_cache_, value_cache_, slot_mapping_;
  CacheWritePlan plan_;
  int64_t num_slots_ = 0;
};

}  // namespace

std::unique_ptr<OpNode> make_reshape_and_cache_node(const NodeArgs& args) {
  return std::make_unique<CacheWriteNode>(args);
}

CacheWritePlan plan_reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                                      const at::Tensor& value_cache, const at::Tensor& slot_mapping,
                                      bool check_slot_values) {
  check_device_type(key, "key", c10::DeviceType::CPU);
  const CacheGeometry g = check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  if (check_slot_values) check_slots(slots, g.num_tokens, g.num_slots);
  const int64_t elem = key.element_size();
  return CacheWritePlan{static_cast<const char*>(key.data_ptr()), static_cast<const char*>(value.data_ptr()),
                        g.key_stride * elem, g.value_stride * elem, slots, g.num_tokens, g.token_elems * elem};
}

void write_cache_tokens(const CacheWritePlan& plan, void* key_cache, void* value_cache, int64_t begin, int64_t end) {
  char* kc = static_cast<char*>(key_cache);
  char* vc = static_cast<char*>(value_cache);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t slot = plan.slots[t];
    if (slot < 0) continue;
    std::memcpy(kc + slot * plan.row_bytes, plan.key + t * plan.key_stride_bytes, plan.row_bytes);
    std::memcpy(vc + slot * plan.row_bytes, plan.value + t * plan.value_stride_bytes, plan.row_bytes);
  }
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                       const at::Tensor& slot_mapping) {
  const CacheWritePlan plan = plan_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
  void* kc = key_cache.data_ptr();
  void* vc = value_cache.data_ptr();
  at::parallel_for(0, plan.num_tokens, std::max<int64_t>(1, 32768 / std::max<int64_t>(plan.row_bytes, 1)),
                   [&](int64_t begin, int64_t end) { write_cache_tokens(plan, kc, vc, begin, end); });
}

void copy_blocks(const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches,
                 const at::Tensor& block_mapping) {
  const CopyBlocksGeometry g = check_copy_blocks_args(key_caches, value_caches, block_mapping);
  if (key_caches.empty() || g.num_pairs == 0) return;
  check_device_type(key_caches[0], "key_caches", c10::DeviceType::CPU);
  const int64_t* pairs = block_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < 2 * g.num_pairs; ++i) {
    TORCH_CHECK(pairs[i] >= 0 && pairs[i] < g.num_blocks, "block_mapping[", i / 2, "][", i % 2, "] = ", pairs[i],
                " is not a block id in [0, ", g.num_blocks, ")");
  }
  // The copies run in parallel, so each destination must be written once and read by no pair.
  std::vector<char> role(g.num_blocks, 0);  // 1: some pair's source, 2: some pair's destination
  for (int64_t p = 0; p < g.num_pairs; ++p) role[pairs[2 * p]] |= 1;
  for (int64_t p = 0; p < g.num_pairs; ++p) {
    const int64_t dst = pairs[2 * p + 1];
    TORCH_CHECK(role[dst] == 0, "block_mapping[", p, "]: destination block ", dst,
                " is also a source or another pair's destination");
    role[dst] = 2;
  }
  const int64_t block_bytes = g.block_elems * key_caches[0].element_size();
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  // One task per (layer, key/value, pair); copies into distinct dst blocks are independent.
  at::parallel_for(0, num_layers * 2 * g.num_pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t pair = task % g.num_pairs;
      const int64_t cache_index = task / g.num_pairs;
      const at::Tensor& cache = cache_index % 2 == 0 ? key_caches[cache_index / 2] : value_caches[cache_index / 2];
      char* base = static_cast<char*>(cache.data_ptr());
      std::memcpy(base + pairs[2 * pair + 1] * block_bytes, base + pairs[2 * pair] * block_bytes, block_bytes);
    }
  });
}

}  // namespace kvflow::cpu
