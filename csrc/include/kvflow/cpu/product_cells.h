// How the threads share a product: the output features cut into one part per thread, each part a
// row of cells; a thread takes its own part's cells front to back and then the others' from the
// back. Used by the small_linear op and by the executor's small_linear, packed_linear and
// quantized_linear nodes, which keep theirs from step to step, one round a step.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
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
  // Rounds are numbered modulo this; a part holds at most kMaxCells cells.
  static constexpr uint64_t kRounds = uint64_t(1) << 20;
  static constexpr uint64_t kMaxCells = uint64_t(1) << 22;

  // grain: a part's least number of output features; tile: the kernel's, of which a cell holds a
  // whole number. packed_linear's nodes pass its panels as the "features" (row_bytes a panel's
  // bytes), with their own grain and a tile of one panel.
  ProductCells(const void* weight, int64_t out_features, int64_t row_bytes, int64_t parts, int64_t grain = kGrain,
               int64_t tile = 4)
      : weight_(static_cast<const char*>(weight)),
        out_features_(out_features),
        row_bytes_(row_bytes),
        parts_(parts),
        cells_(parts) {
    cell_ = std::max<int64_t>(tile, kCellBytes / std::max<int64_t>(row_bytes, 1) / tile * tile);
    for (int64_t p = 0; p < parts; ++p) {
      Part& part = cells_[p];
      part.range = share_of(out_features, grain, parts, p);
      part.count = uint64_t((part.range.end - part.range.begin + cell_ - 1) / cell_);
      if (part.count >= kMaxCells) throw std::length_error("ProductCells: too many cells in one part");
      part.state.store(pack(0, 0, part.count), std::memory_order_relaxed);  // round 0: every cell left
    }
  }

  int64_t parts() const { return parts_; }
  const void* weight() const { return weight_; }
  int64_t out_features() const { return out_features_; }

  // The first weights thread `tid` reads (its part's first cells), or null.
  const char* first_read(int64_t tid) const {
    return tid < parts_ ? weight_ + cells_[tid].range.begin * row_bytes_ : nullptr;
  }

  // Runs fn(begin, end) over cells until none is left: first thread `tid`'s own, then others'.
  // Each product over the same weights is a new round (round 0, then 1, 2, ... modulo kRounds):
  // a part last touched in another round has every cell left, so nothing is reset between
  // rounds, and no thread touches a part before the round's product runs.
  template <class Fn>
  void run(int64_t tid, const Fn& fn, uint64_t round = 0) {
    round %= kRounds;
    if (tid < parts_) {
      while (take(cells_[tid], round, /*from_front=*/true, fn)) {
      }
    }
    for (int64_t k = 1; k <= parts_; ++k) {
      Part& victim = cells_[(tid + k) % parts_];
      while (take(victim, round, /*from_front=*/false, fn)) {
      }
    }
  }

 private:
  static constexpr int64_t kCellBytes = 32 << 10;

  struct alignas(64) Part {
    std::atomic<uint64_t> state{0};  // round, then cells [front, back) left: see pack
    uint64_t count = 0;
    Range range{0, 0};
  };

  static uint64_t pack(uint64_t round, uint64_t front, uint64_t back) { return (round << 44) | (front << 22) | back; }

  template <class Fn>
  bool take(Part& part, uint64_t round, bool from_front, const Fn& fn) {
    uint64_t now = part.state.load(std::memory_order_relaxed);
    uint64_t cell;
    do {
      uint64_t front = (now >> 22) & (kMaxCells - 1), back = now & (kMaxCells - 1);
      if ((now >> 44) != round) front = 0, back = part.count;  // another round's leftovers: all left
      if (front >= back) return false;
      cell = from_front ? front : back - 1;
      const uint64_t next = from_front ? pack(round, front + 1, back) : pack(round, front, back - 1);
      if (part.state.compare_exchange_weak(now, next, std::memory_order_relaxed)) break;
    } while (true);
    const int64_t begin = part.range.begin + int64_t(cell) * cell_;
    fn(begin, std::min(part.range.end, begin + cell_));
    return true;
  }

  const char* weight_;
  int64_t out_features_, row_bytes_, parts_, cell_;
  std::vector<Part> cells_;
};

}  // namespace kvflow::cpu
