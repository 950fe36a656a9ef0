// A barrier for the threads of one parallel region that spins instead of sleeping: between the
// kernels of a decode step the wait is a few microseconds, less than a futex wake-up costs.
// After some 4,000 spins (a hundred microseconds or more, far beyond those waits) it yields at
// every turn, so that more threads than cores (another engine's region, say) still progress.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>

namespace kvflow::cpu {

class SpinBarrier {
 public:
  // Returns once all `team` threads of the region have called wait. While it waits, it asks for
  // the lines of [ahead, ahead + ahead_bytes) to come into L2: what the thread reads next.
  void wait(int64_t team, const char* ahead = nullptr, int64_t ahead_bytes = 0) {
    const uint32_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == team) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);  // publishes the reset with the release
      return;
    }
    const char* const ahead_end = ahead == nullptr ? ahead : ahead + ahead_bytes;
    for (int64_t spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
      if (ahead < ahead_end) {
        for (int line = 0; line < kLinesPerSpin && ahead < ahead_end; ++line, ahead += 64) {
          __builtin_prefetch(ahead, 0, 2);
        }
      } else if (spins < kSpinsBeforeYield) {
        pause();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr int64_t kSpinsBeforeYield = 1 << 12;
  static constexpr int kLinesPerSpin = 4;

  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  alignas(64) std::atomic<int64_t> arrived_{0};
  alignas(64) std::atomic<uint32_t> generation_{0};
};

}  // namespace kvflow::cpu
