// How the threads share a few-row product (small_linear): the output features cut into one part
// per thread, each part a row of cells; a thread takes its own part's cells front to back and
// then the others' from the back. Used by the small_linear op and by the executor's small_linear
// nodes, which keep theirs from step to step (reset between steps).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace kvflow::cpu {

struct Range {
  int64_t begin, end;
};

// Thread `tid` of `team`'s part of [0, n), cut as at::parallel_for cuts it with this grain.
inline Range share_of(int64_t n, int64_t grain, int64_t team, int64_t tid) {
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(team, (n + grain - 1) / grain));
  const int64_t chunk = (n + workers - 1) / workers;
  const int64_t begin = std::min(n, tid * chunk);
  return {begin, std::min(n, begin + chunk)};
}

// One product's output features, cut into one part per thread (as at::parallel_for cuts them
// with a grain of kGrain), each part a row of cells of about 32 KB of weights. A part's owner
// takes its cells front to back, one sequential stream; a thread done with its own part takes
// cells from the back of the others'. At batch 1 the two threads here stream at different
// speeds, by up to a tenth from product to product: with a fixed cut the faster one waited 8%
// of a decode step at the barriers. Cells are whole tiles of the kernel (4 features) from a
// part's start. Any thread may run any part, so the work is done even where fewer threads
// than parts run at once.
class ProductCells {
 public:
  // A part holds at least this many output features: a small product gets fewer non-empty parts.
  static constexpr int64_t kGrain = 64;

  ProductCells(const void* weight, int64_t out_features, int64_t row_bytes, int64_t parts)
      : weight_(static_cast<const char*>(weight)),
        out_features_(out_features),
        row_bytes_(row_bytes),
        parts_(parts),
        cells_(parts) {
    cell_ = std::max<int64_t>(4, kCellBytes / std::max<int64_t>(row_bytes, 1) / 4 * 4);
    for (int64_t p = 0; p < parts; ++p) cells_[p].range = share_of(out_features, kGrain, parts, p);
    reset();
  }

  int64_t parts() const { return parts_; }

  // Every cell left again, for the next product over the same weights (no thread may be running).
  void reset() {
    for (Part& part : cells_) {
      const uint64_t count = uint64_t((part.range.end - part.range.begin + cell_ - 1) / cell_);
      part.front_back.store(count, std::memory_order_relaxed);  // front 0, back count
    }
  }

  const void* weight() const { return weight_; }
  int64_t out_features() const { return out_features_; }

  // The first weights thread `tid` reads (its part's first cells), or null.
  const char* first_read(int64_t tid) const {
    return tid < parts_ ? weight_ + cells_[tid].range.begin * row_bytes_ : nullptr;
  }

  // Runs fn(begin, end) over cells until none is left: first thread `tid`'s own, then others'.
  template <class Fn>
  void run(int64_t tid, const Fn& fn) {
    if (tid < parts_) {
      while (take(cells_[tid], /*from_front=*/true, fn)) {
      }
    }
    for (int64_t k = 1; k <= parts_; ++k) {
      Part& victim = cells_[(tid + k) % parts_];
      while (take(victim, /*from_front=*/false, fn)) {
      }
    }
  }

 private:
  static constexpr int64_t kCellBytes = 32 << 10;

  struct alignas(64) Part {
    std::atomic<uint64_t> front_back{0};  // cells [front, back) are left: front in the high half
    Range range{0, 0};
  };

  template <class Fn>
  bool take(Part& part, bool from_front, const Fn& fn) {
    uint64_t now = part.front_back.load(std::memory_order_relaxed);
    uint64_t cell;
    do {
      const uint64_t front = now >> 32, back = now & 0xffffffffu;
      if (front >= back) return false;
      cell = from_front ? front : back - 1;
      const uint64_t next = from_front ? ((front + 1) << 32) | back : (front << 32) | (back - 1);
      if (part.front_back.compare_exchange_weak(now, next, std::memory_order_relaxed)) break;
    } while (true);
    const int64_t begin = part.range.begin + int64_t(cell) * cell_;
    fn(begin, std::min(part.range.end, begin + cell_));
    return true;
  }

  const char* weight_;
  int64_t out_features_, row_bytes_, parts_, cell_ = 4;
  std::vector<Part> cells_;
};

}  // namespace kvflow::cpu
