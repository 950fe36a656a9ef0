// A grammar's token bitmask applied to one row of float32 logits (structured output): bit b of
// word w allows token 32 w + b; every other token's logit becomes -inf, the tokens past the
// mask's last word included (a grammar never allows a token it does not know). Torch-free; the
// CUDA kernel (token_bitmask.cuh) does the same per element.
#pragma once

#include <cstdint>
#include <limits>

namespace kvflow {

// Words [word_begin, word_end) of a row's mask, on logits [vocab]: tokens 32 word_begin up to
// min(vocab, 32 word_end). A word of all ones (most of an unconstrained stretch) costs one compare.
inline void apply_token_bitmask_words(float* logits, int64_t vocab, const int32_t* words, int64_t word_begin,
                                      int64_t word_end) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t w = word_begin; w < word_end && 32 * w < vocab; ++w) {
    const uint32_t bits = uint32_t(words[w]);
    if (bits == 0xFFFFFFFFu) continue;
    const int64_t first = 32 * w;
    const int64_t n = vocab - first < 32 ? vocab - first : 32;
    for (int64_t b = 0; b < n; ++b) {
      if (!((bits >> b) & 1u)) logits[first + b] = minus_inf;
    }
  }
}

// The tokens at and past 32 * num_words, which no word of the mask covers.
inline void mask_tokens_past_words(float* logits, int64_t vocab, int64_t num_words) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t t = 32 * num_words; t < vocab; ++t) logits[t] = minus_inf;
}

}  // namespace kvflow
