// The last step of split-KV attention on the CPU: each split of a request saw a disjoint range
// of keys and left (running max m, sum l, unnormalised accumulator acc) per (token, head);
// rescaling every split to the common max gives the softmax over all keys.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvflow/cpu/kernel_table.h"

namespace kvflow::cpu {
namespace {

template <typename T>
void merge(const PagedAttentionArgs& a, int64_t head_dim, const int32_t* num_splits, int64_t token_begin,
           int64_t token_end) {
  const int64_t row = head_dim + 2;
  std::vector<float> acc(head_dim);
  int64_t request = 0;
  for (int64_t token = token_begin; token < token_end; ++token) {
    while (a.cu_seqlens_q[request + 1] <= token) ++request;
    for (int64_t head = 0; head < a.num_q_heads; ++head) {
      auto partial = [&](int64_t split) {
        return a.partials + ((split * a.num_tokens + token) * a.num_q_heads + head) * row;
      };
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < num_splits[request]; ++s) m = std::max(m, partial(s)[0]);
      float l = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = 0; s < num_splits[request]; ++s) {
        const float* p = partial(s);
        if (p[1] == 0.f) continue;  // this split saw no key of this query
        const float w = std::exp(p[0] - m);
        l += p[1] * w;
        for (int64_t d = 0; d < head_dim; ++d) acc[d] += p[2 + d] * w;
      }
      T* out = static_cast<T*>(a.out) + (token * a.num_q_heads + head) * head_dim;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      for (int64_t d = 0; d < head_dim; ++d) out[d] = from_float<T>(acc[d] * inv);
    }
  }
}

}  // namespace

void merge_attention_splits(const PagedAttentionArgs& args, int64_t head_dim, DType dtype, const int32_t* num_splits,
                            int64_t token_begin, int64_t token_end) {
  switch (dtype) {
    case DType::kFloat32:
      return merge<float>(args, head_dim, num_splits, token_begin, token_end);
    case DType::kFloat16:
      return merge<float16>(args, head_dim, num_splits, token_begin, token_end);
    case DType::kBFloat16:
      return merge<bfloat16>(args, head_dim, num_splits, token_begin, token_end);
  }
}

}  // namespace kvflow::cpu
