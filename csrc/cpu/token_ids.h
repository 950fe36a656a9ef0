// The CPU embedding lookups' check of the token ids' values (op_checks.h checks only their shape
// and dtype): every id within the table, before any row is written.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>

namespace kvflow::cpu {

inline void check_token_ids(const int64_t* ids, int64_t num_tokens, int64_t vocab_size) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(ids[t] >= 0 && ids[t] < vocab_size, "token_ids[", t, "] = ", ids[t], " is not a token id in [0, ",
                vocab_size, ")");
  }
}

}  // namespace kvflow::cpu
