// SpinBarrier (kvflow/cpu/spin_barrier.h) under real threads: nobody leaves a round before every
// thread has arrived, rounds follow each other without a reset, and more threads than cores
// (it yields after spinning) still finish.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "check.h"
#include "kvflow/cpu/spin_barrier.h"

using kvflow::cpu::SpinBarrier;

namespace {

// Each of `team` threads, `rounds` times: counts its arrival, waits, then checks that the whole
// team had arrived in this round; a second wait keeps the next round's arrivals out of the check.
void run_rounds(int64_t team, int64_t rounds) {
  SpinBarrier barrier;
  std::atomic<int64_t> arrived{0};
  std::atomic<int64_t> early{0};
  std::vector<char> ahead(1 << 16);
  std::vector<std::thread> threads;
  for (int64_t tid = 0; tid < team; ++tid) {
    threads.emplace_back([&, tid] {
      for (int64_t round = 0; round < rounds; ++round) {
        arrived.fetch_add(1);
        barrier.wait(team, tid % 2 ? ahead.data() : nullptr, int64_t(ahead.size()));
        if (arrived.load() < (round + 1) * team) early.fetch_add(1);
        barrier.wait(team);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  KVFLOW_CHECK(early.load() == 0);
  KVFLOW_CHECK(arrived.load() == team * rounds);
}

}  // namespace

KVFLOW_TEST(spin_barrier_lets_nobody_through_before_the_whole_team) {
  for (int64_t team : {1, 2, 3}) run_rounds(team, 2000);
}

KVFLOW_TEST(spin_barrier_finishes_with_more_threads_than_cores) {
  const int64_t cores = std::max<int64_t>(1, int64_t(std::thread::hardware_concurrency()));
  run_rounds(4 * cores, 50);
}
