// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a
// counter-based generator, so a draw depends only on (key, counter), never on what was drawn
// before or elsewhere. Shared by the CPU and CUDA samplers so both draw the same numbers.
#pragma once

#include <cstdint>

#include "kvflow/numeric.h"

namespace kvflow {

struct Philox4x32 {
  uint32_t v[4];
};

KVFLOW_HOST_DEVICE uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t product = uint64_t(a) * uint64_t(b);
  *hi = uint32_t(product >> 32);
  return uint32_t(product);
}

KVFLOW_HOST_DEVICE Philox4x32 philox4x32_10(uint64_t key, uint64_t counter_lo, uint64_t counter_hi) {
  uint32_t c0 = uint32_t(counter_lo), c1 = uint32_t(counter_lo >> 32);
  uint32_t c2 = uint32_t(counter_hi), c3 = uint32_t(counter_hi >> 32);
  uint32_t k0 = uint32_t(key), k1 = uint32_t(key >> 32);
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo32(0xD2511F53u, c0, &hi0);
    const uint32_t lo1 = mulhilo32(0xCD9E8D57u, c2, &hi1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4x32{{c0, c1, c2, c3}};
}

// A uniform double in [0, 1) with 53 random bits, for the draw of output token `offset` of the
// request seeded `seed`.
KVFLOW_HOST_DEVICE double philox_uniform(uint64_t seed, uint64_t offset) {
  const Philox4x32 r = philox4x32_10(seed, offset, 0);
  const uint64_t bits = (uint64_t(r.v[0]) << 21) ^ (uint64_t(r.v[1]) >> 11);
  return double(bits & ((uint64_t(1) << 53) - 1)) * (1.0 / 9007199254740992.0);
}

}  // namespace kvflow
