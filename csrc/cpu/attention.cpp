// paged_attention on the CPU: checks, a host-side validation of the batch metadata, a list of
// work items (request x query tile, every kv head, and key splits when there are too few items
// to keep every thread busy), items handed to threads dynamically, then the merge of key splits.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <atomic>
#include <numeric>
#include <vector>

#include "kvflow/cpu/attention.h"
#include "kvflow/cpu/batch_invariance.h"
#include "kvflow/cpu/kernel_table.h"
#include "op_checks.h"
#include "op_node.h"
#include "ops.h"
#include "prepared_ops.h"

namespace kvflow::cpu {
namespace {

// Rows (query tokens x query heads of one kv head) per tile: enough that one widened K/V chunk
// serves many rows, few enough that the tile's accumulators stay in L1/L2.
constexpr int64_t kRowsPerTile = 32;
// Fewer keys than this per split cost more in merging than they gain in parallelism.
constexpr int64_t kMinKeysPerSplit = 32;
constexpr int64_t kMaxItemsPerGrab = 8;

// paged_attention's argument checks on the CPU: the shared ones, and the block sizes its kernels take.
AttentionGeometry check_cpu_attention_args(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                                           const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                                           int64_t max_query_len, int64_t max_seq_len, int64_t sliding_window,
                                           double logits_soft_cap, const std::optional<at::Tensor>& workspace) {
  check_device_type(query, "query", c10::DeviceType::CPU);
  const AttentionGeometry g =
      check_paged_attention_args(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                                 max_query_len, max_seq_len, sliding_window, logits_soft_cap, workspace);
  TORCH_CHECK(g.block_size % 16 == 0, "key_cache's block_size ", g.block_size,
              " is not supported on the CPU (a multiple of 16 is)");
  return g;
}

void validate_metadata(const AttentionGeometry& g, const int32_t* cu, const int32_t* seq_lens,
                       const int32_t* block_tables, int64_t max_query_len, int64_t max_seq_len) {
  TORCH_CHECK(cu[0] == 0, "cu_seqlens_q[0] must be 0, got ", cu[0]);
  TORCH_CHECK(cu[g.batch] == g.num_tokens, "cu_seqlens_q[", g.batch, "] = ", cu[g.batch],
              " must equal the number of query tokens ", g.num_tokens);
  for (int64_t b = 0; b < g.batch; ++b) {
    const int64_t q_len = cu[b + 1] - cu[b];
    TORCH_CHECK(q_len >= 0, "cu_seqlens_q must be non-decreasing; request ", b, " has ", q_len, " query tokens");
    TORCH_CHECK(q_len <= max_query_len, "request ", b, " has ", q_len, " query tokens, more than max_query_len ",
                max_query_len);
    TORCH_CHECK(seq_lens[b] >= q_len, "seq_lens[", b, "] = ", seq_lens[b], " is shorter than its ", q_len,
                " query tokens");
    TORCH_CHECK(seq_lens[b] <= max_seq_len, "seq_lens[", b, "] = ", seq_lens[b], " exceeds max_seq_len ",
                max_seq_len);
    const int64_t used_blocks = (seq_lens[b] + g.block_size - 1) / g.block_size;
    for (int64_t i = 0; i < used_blocks; ++i) {
      const int32_t block = block_tables[b * g.max_blocks_per_seq + i];
      TORCH_CHECK(block >= 0 && block < g.num_blocks, "block_tables[", b, "][", i, "] = ", block,
                  " is not a block id in [0, ", g.num_blocks, ")");
    }
  }
}

void plan_work(PagedAttentionPlan& plan, const AttentionGeometry& g, const int32_t* cu, const int32_t* seq_lens,
               int64_t threads) {
  const int64_t group = g.num_q_heads / g.num_kv_heads;
  const int64_t q_tile = std::max<int64_t>(1, kRowsPerTile / group);
  const int64_t wanted_items = 4 * threads;
  int64_t tiles = 0;
  for (int64_t b = 0; b < g.batch; ++b) tiles += (cu[b + 1] - cu[b] + q_tile - 1) / q_tile;
  // An item covers every kv head, so that each chunk of the cache is read front to back. With
  // few tiles (small-batch decode) keys are split as well, into as many ranges as make the items
  // divide evenly among the threads; each thread then reads its own contiguous part of every
  // cache block. Measured at batch 1 (9 query / 3 kv heads, 128-256 keys, cache from memory):
  // 13-17 us a layer, against 15-21 with one kv head per item and no split.
  // Batch-invariant mode never splits: a split's merge rounds differently from one pass.
  const int64_t split_factor = tiles >= wanted_items || batch_invariant()
                                   ? 1
                                   : threads / std::gcd(std::max<int64_t>(tiles, 1), threads);

  plan.num_splits.assign(g.batch, 1);
  for (int64_t b = 0; b < g.batch; ++b) {
    plan.num_splits[b] = int32_t(std::clamp<int64_t>(seq_lens[b] / kMinKeysPerSplit, 1, split_factor));
    plan.max_splits = std::max<int64_t>(plan.max_splits, plan.num_splits[b]);
  }
  const bool split_mode = plan.max_splits > 1;
  for (int64_t b = 0; b < g.batch; ++b) {
    const int64_t q_len = cu[b + 1] - cu[b];
    const int64_t splits = plan.num_splits[b];
    // Split boundaries on 16-key chunks, so that no chunk is read by two splits.
    const int64_t keys_per_split = (seq_lens[b] + splits - 1) / splits;
    const int64_t split_step = (keys_per_split + 15) / 16 * 16;
    for (int64_t s = 0; s < splits; ++s) {
      const int64_t key_begin = std::min<int64_t>(s * split_step, seq_lens[b]);
      const int64_t key_end = s + 1 == splits ? seq_lens[b] : std::min<int64_t>((s + 1) * split_step, seq_lens[b]);
      for (int64_t t = 0; t < q_len; t += q_tile) {
        plan.items.push_back({int32_t(b), 0, int32_t(g.num_kv_heads), int32_t(t), int32_t(std::min(q_tile, q_len - t)),
                              int32_t(key_begin), int32_t(key_end), split_mode ? int32_t(s) : -1});
      }
    }
  }
  // Longest first: with dynamic hand-out, the big causal tiles do not end up last.
  auto cost = [&](const AttentionWorkItem& it) {
    const int64_t last = seq_lens[it.request] - (cu[it.request + 1] - cu[it.request]) + it.q_begin + it.q_count;
    return int64_t(it.q_count) * it.kv_count * (std::min<int64_t>(it.key_end, last) - it.key_begin);
  };
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [&](const AttentionWorkItem& x, const AttentionWorkItem& y) { return cost(x) > cost(y); });
  // Several items at a time where there are many: the kernel asks for the next item's first keys
  // while it ends one (measured: batch 64 x 208 keys from memory, 0.45 ms one at a time, 0.41 four
  // at a time), and at least four grabs per thread keep the hand-out balanced.
  plan.items_per_grab = std::clamp<int64_t>(int64_t(plan.items.size()) / (4 * threads), 1, kMaxItemsPerGrab);
}

}  // namespace

PagedAttentionPlan plan_paged_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                        const at::Tensor& value_cache, const at::Tensor& block_tables,
                                        const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, double scale,
                                        int64_t max_query_len, int64_t max_seq_len, int64_t sliding_window,
                                        double logits_soft_cap, const std::optional<at::Tensor>& workspace,
                                        int64_t threads) {
  const AttentionGeometry g =
      check_cpu_attention_args(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                               max_query_len, max_seq_len, sliding_window, logits_soft_cap, workspace);
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  validate_metadata(g, cu, lens, tables, max_query_len, max_seq_len);

  PagedAttentionPlan plan;
  plan.dtype = g.dtype;
  plan.kernel = active_kernels().paged_attention[int(g.dtype)][attention_head_dim_index(g.head_dim)];
  if (g.num_tokens > 0) plan_work(plan, g, cu, lens, threads);
  if (plan.max_splits > 1) {
    const int64_t needed = plan.max_splits * g.num_tokens * g.num_q_heads * (g.head_dim + 2);
    plan.partials = workspace.has_value() && workspace->numel() >= needed
                        ? *workspace
                        : at::empty({needed}, query.options().dtype(at::kFloat));
  }
  PagedAttentionArgs& args = plan.args;
  args.out = out.data_ptr();
  args.query = query.data_ptr();
  args.q_stride = g.q_stride;
  args.key_cache = key_cache.data_ptr();
  args.value_cache = value_cache.data_ptr();
  args.block_tables = tables;
  args.max_blocks_per_seq = g.max_blocks_per_seq;
  args.cu_seqlens_q = cu;
  args.seq_lens = lens;
  args.num_q_heads = g.num_q_heads;
  args.num_kv_heads = g.num_kv_heads;
  args.head_dim = g.head_dim;
  args.block_size = g.block_size;
  args.scale = float(scale);
  args.soft_cap = float(logits_soft_cap);
  args.sliding_window = sliding_window;
  args.partials = plan.partials.defined() ? plan.partials.data_ptr<float>() : nullptr;
  args.num_tokens = g.num_tokens;
  return plan;
}

void run_attention_items(const PagedAttentionPlan& plan, const PagedAttentionArgs& args,
                         std::atomic<int64_t>& next) {
  const int64_t num_items = static_cast<int64_t>(plan.items.size());
  const int64_t grab = plan.items_per_grab;
  for (int64_t i = next.fetch_add(grab); i < num_items; i = next.fetch_add(grab)) {
    plan.kernel(args, plan.items.data(), i, std::min(i + grab, num_items));
  }
}

void merge_attention_tokens(const PagedAttentionPlan& plan, const PagedAttentionArgs& args, int64_t begin,
                            int64_t end) {
  if (plan.max_splits > 1) merge_attention_splits(args, args.head_dim, plan.dtype, plan.num_splits.data(), begin, end);
}

namespace {

// Every layer of a step attends over the same requests: the first node of a kind (same metadata,
// shapes, window) validates the metadata and makes the work list, the others share it with
// their own output, query and caches. The step's max_query_len and max_seq_len replace the
// captured ones.
class PagedAttentionNode final : public OpNode {
 public:
  explicit PagedAttentionNode(const NodeArgs& args)
      : out_(args.tensor(0)),
        query_(args.tensor(1)),
        key_cache_(args.tensor(2)),
        value_cache_(args.tensor(3)),
        block_tables_(args.tensor(4)),
        cu_seqlens_q_(args.tensor(5)),
        seq_lens_(args.tensor(6)),
        scale_(args.real(0)),
        soft_cap_(args.real(1)),
        sliding_window_(args.integer(2)) {
    const AttentionGeometry g =
        check_cpu_attention_args(out_, query_, key_cache_, value_cache_, block_tables_, cu_seqlens_q_, seq_lens_,
                                 args.integer(0), args.integer(1), sliding_window_, soft_cap_, std::nullopt);
    num_tokens_ = g.num_tokens;
    key_ = {reinterpret_cast<int64_t>(block_tables_.data_ptr()), reinterpret_cast<int64_t>(cu_seqlens_q_.data_ptr()),
            reinterpret_cast<int64_t>(seq_lens_.data_ptr()), g.num_tokens, g.batch, g.num_q_heads, g.num_kv_heads,
            g.head_dim, g.block_size, g.num_blocks, g.max_blocks_per_seq, query_.stride(0),
            int64_t(g.dtype), sliding_window_};
    std::memcpy(&key_[14], &scale_, sizeof(double));
    std::memcpy(&key_[15], &soft_cap_, sizeof(double));
  }

  bool reads_step() const override { return true; }

  void prepare(StepContext& step) override {
    StepContext::PlanKey key = key_;
    key[16] = step.max_query_len;
    key[17] = step.max_seq_len;
    key[18] = step.threads;
    plan_ = step.attention_plan(key);
    if (plan_ == nullptr) {
      const std::optional<at::Tensor> workspace =
          step.workspace.defined() ? std::optional<at::Tensor>(step.workspace) : std::nullopt;
      auto plan = std::make_shared<PagedAttentionPlan>(plan_paged_attention(
          out_, query_, key_cache_, value_cache_, block_tables_, cu_seqlens_q_, seq_lens_, scale_,
          step.max_query_len, step.max_seq_len, sliding_window_, soft_cap_, workspace, step.threads));
      if (plan->partials.defined() && !plan->partials.is_same(step.workspace)) step.workspace = plan->partials;
      step.attention_plans.emplace_back(key, plan);
      plan_ = std::move(plan);
    }
    args_ = plan_->args;
    args_.out = out_.data_ptr();
    args_.query = query_.data_ptr();
    args_.key_cache = key_cache_.data_ptr();
    args_.value_cache = value_cache_.data_ptr();
    next_item_.store(0, std::memory_order_relaxed);
  }

  // The items, then the merge of split keys, which a step without splits skips.
  int phases() const override { return 2; }
  int64_t units(int phase) const override { return phase == 0 ? kShared : num_tokens_; }
  bool phase_may_skip(int phase) const override { return phase == 1; }
  bool phase_active(int phase) const override { return phase == 0 || plan_->max_splits > 1; }

  // The merge's output rows, which it overwrites (the split partials are the items just done).
  void warm(int phase, const Turn& turn) const override {
    if (phase != 1 || num_tokens_ == 0) return;
    const int64_t element = out_.element_size();
    warm_rows(out_.data_ptr(), out_.stride(0) * element, out_.numel() / num_tokens_ * element,
              share_of(num_tokens_, 1, turn.team, turn.tid), true);
  }

  // With one item a thread (the key splits of one or a few decoding requests), thread tid's
  // item's K and V, asked for while the products before the layer's attention run: a few tens of
  // KB a thread from L3 or memory, which attention otherwise waits for (docs/benchmarks.md).
  bool warms_early(int phase) const override { return phase == 0; }

  void warm_early(int phase, const Turn& turn) const override {
    if (phase != 0 || !one_item_a_thread(turn)) return;
    // Only the element's size matters to the prefetch: bfloat16 stands for float16 too.
    if (key_cache_.element_size() == 4) {
      warm_item_keys<float>(plan_->items[turn.tid]);
    } else {
      warm_item_keys<bfloat16>(plan_->items[turn.tid]);
    }
  }

  void run(int phase, const Turn& turn) override {
    if (phase == 0) {
      if (one_item_a_thread(turn)) {
        plan_->kernel(args_, plan_->items.data(), turn.tid, turn.tid + 1);  // the item warm_early asked for
        return;
      }
      run_attention_items(*plan_, args_, next_item_);
    } else {
      const Range tokens = share_of(num_tokens_, 1, turn.team, turn.tid);
      if (tokens.begin < tokens.end) merge_attention_tokens(*plan_, args_, tokens.begin, tokens.end);
    }
  }

 private:
  bool one_item_a_thread(const Turn& turn) const { return int64_t(plan_->items.size()) == turn.team; }

  // The item's K and V, every kv head, chunk by chunk as the kernels ask for the next one: its
  // first 192 KB, if it has more.
  template <typename T>
  void warm_item_keys(const AttentionWorkItem& it) const {
    const KeyRange keys = item_keys(args_, it);
    const int32_t* block_table = args_.block_tables + it.request * args_.max_blocks_per_seq;
    int64_t budget = 192 << 10;
    for (int64_t c0 = keys.first_chunk; c0 < keys.hi && budget > 0; c0 += kKeyChunk) {
      const NextChunkPrefetch<T> chunk(args_, block_table, c0, keys.hi, 1);
      chunk.issue(0);
      budget -= 2 * chunk.bytes;
    }
  }

  at::Tensor out_, query_, key_cache_, value_cache_, block_tables_, cu_seqlens_q_, seq_lens_;
  double scale_, soft_cap_;
  int64_t sliding_window_;
  int64_t num_tokens_ = 0;
  StepContext::PlanKey key_{};  // the step's lengths and thread count complete it
  std::shared_ptr<const PagedAttentionPlan> plan_;
  PagedAttentionArgs args_{};
  std::atomic<int64_t> next_item_{0};
};

}  // namespace

std::unique_ptr<OpNode> make_paged_attention_node(const NodeArgs& args) {
  return std::make_unique<PagedAttentionNode>(args);
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                     const at::Tensor& seq_lens, double scale, int64_t max_query_len, int64_t max_seq_len,
                     int64_t sliding_window, double logits_soft_cap, const std::optional<at::Tensor>& workspace) {
  const int64_t threads = at::get_num_threads();
  const PagedAttentionPlan plan =
      plan_paged_attention(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                           max_query_len, max_seq_len, sliding_window, logits_soft_cap, workspace, threads);
  const int64_t num_items = static_cast<int64_t>(plan.items.size());
  if (num_items == 0) return;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, num_items), 1,
                   [&](int64_t, int64_t) { run_attention_items(plan, plan.args, next); });
  if (plan.max_splits > 1) {
    at::parallel_for(0, plan.args.num_tokens, 1,
                     [&](int64_t begin, int64_t end) { merge_attention_tokens(plan, plan.args, begin, end); });
  }
}

}  // namespace kvflow::cpu
