// ProductCells (kvflow/cpu/product_cells.h), the hand-out of a few-row product's output features: under
// real threads every feature is computed exactly once, in cells that start on the kernel's
// 4-feature tiles of each part, owners first; and a part whose thread never runs is done by the
// others.
#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "check.h"
#include "kvflow/cpu/product_cells.h"

using kvflow::cpu::ProductCells;
using kvflow::cpu::Range;
using kvflow::cpu::share_of;

namespace {

struct Taken {
  int64_t begin, end, thread;
};

// Runs the cells with `running` threads (ids 0..running-1) of a product cut for `parts`.
std::vector<Taken> run_threads(ProductCells& cells, int64_t running, uint64_t round = 0) {
  std::mutex lock;
  std::vector<Taken> taken;
  std::vector<std::thread> threads;
  for (int64_t tid = 0; tid < running; ++tid) {
    threads.emplace_back([&, tid] {
      cells.run(
          tid,
          [&](int64_t begin, int64_t end) {
            std::lock_guard<std::mutex> guard(lock);
            taken.push_back({begin, end, tid});
          },
          round);
    });
  }
  for (std::thread& t : threads) t.join();
  return taken;
}

void check_each_feature_once(const std::vector<Taken>& taken, int64_t out_features) {
  std::vector<int> count(out_features, 0);
  for (const Taken& t : taken) {
    KVFLOW_CHECK(0 <= t.begin && t.begin < t.end && t.end <= out_features);
    for (int64_t o = t.begin; o < t.end; ++o) ++count[o];
  }
  for (int64_t o = 0; o < out_features; ++o) KVFLOW_CHECK(count[o] == 1);
}

}  // namespace

KVFLOW_TEST(product_cells_cover_every_feature_once) {
  // SmolLM2's four products and LM head (bf16 rows), odd sizes, and more threads than parts.
  const int64_t shapes[][2] = {{960, 1152}, {576, 1152}, {3072, 1152}, {576, 3072}, {49152, 1152}, {641, 384},
                               {5, 64}, {130, 100000}};
  for (const auto& shape : shapes) {
    for (int64_t parts : {1, 2, 3, 8}) {
      for (int repeat = 0; repeat < 5; ++repeat) {
        ProductCells cells(nullptr, shape[0], shape[1], parts);
        const std::vector<Taken> taken = run_threads(cells, parts);
        check_each_feature_once(taken, shape[0]);
        for (const Taken& t : taken) {
          // Cells start on the kernel's tiles: a multiple of 4 features into their part.
          for (int64_t p = 0; p < parts; ++p) {
            const Range part = share_of(shape[0], ProductCells::kGrain, parts, p);
            if (part.begin <= t.begin && t.begin < part.end) {
              KVFLOW_CHECK((t.begin - part.begin) % 4 == 0);
              KVFLOW_CHECK(t.end <= part.end);
            }
          }
        }
      }
    }
  }
}

KVFLOW_TEST(product_cells_owner_streams_its_part_front_to_back) {
  // One thread alone: its own part in order first, then the other parts' cells from the back.
  ProductCells cells(nullptr, 3072, 1152, 2);
  const std::vector<Taken> taken = run_threads(cells, 1);
  check_each_feature_once(taken, 3072);
  const Range own = share_of(3072, ProductCells::kGrain, 2, 0);
  size_t i = 0;
  for (int64_t expect = own.begin; i < taken.size() && taken[i].begin < own.end; ++i) {
    KVFLOW_CHECK(taken[i].begin == expect);
    expect = taken[i].end;
  }
  for (size_t j = i + 1; j < taken.size(); ++j) KVFLOW_CHECK(taken[j].end == taken[j - 1].begin);
}

KVFLOW_TEST(product_cells_finish_parts_of_threads_that_never_run) {
  // Four parts, two threads running: the missing threads' parts are taken from the back.
  ProductCells cells(nullptr, 3072, 1152, 4);
  check_each_feature_once(run_threads(cells, 2), 3072);
}

KVFLOW_TEST(product_cells_serve_round_after_round_without_a_reset) {
  // The executor runs one round a replay on the same cells: each round covers every feature once,
  // whatever the threads left of the round before, across the wrap of the round counter too.
  ProductCells cells(nullptr, 3072, 1152, 2);
  for (uint64_t round : {uint64_t(1), uint64_t(2), uint64_t(3), ProductCells::kRounds - 1, ProductCells::kRounds,
                         ProductCells::kRounds + 1}) {
    check_each_feature_once(run_threads(cells, round % 2 ? 2 : 1, round), 3072);
  }
  KVFLOW_CHECK(run_threads(cells, 2, ProductCells::kRounds + 1).empty());  // the same round again: nothing left
}
