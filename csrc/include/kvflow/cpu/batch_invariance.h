// Batch-invariant mode (vLLM's VLLM_BATCH_INVARIANT, SGLang's deterministic inference): while it
// is on, the CPU kernels compute every row's result in one order, whatever the number of rows
// beside it. Products keep one accumulator per dot product (four-feature tiles, any row count),
// quantized products never switch to dequantized panels, and attention never splits a
// request's keys across threads. One row's logits are then bit-equal at any batch size. A
// process-wide switch, read when a kernel runs (and when a quantized product is planned).
#pragma once

#include <atomic>

namespace kvflow::cpu {

inline std::atomic<bool>& batch_invariant_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}

inline bool batch_invariant() { return batch_invariant_flag().load(std::memory_order_relaxed); }

inline void set_batch_invariant(bool on) { batch_invariant_flag().store(on, std::memory_order_relaxed); }

}  // namespace kvflow::cpu
