// Paged attention on the CPU, written once over a vector type V and an element type T, for a
// compile-time head_dim HD. Included by kernels.h inside its unnamed namespace.
//
// One work item is a tile of a request's queries times the query heads of one or more kv heads
// (the "rows"), over a range of keys. Keys are taken 16 at a time (block sizes are multiples of 16,
// so 16 keys never straddle two blocks): the chunk's K and V rows of this kv head are widened to
// float32 once and then serve every row of the tile, so each cache byte is read once per kv head.
// Scores come out 16 at a time through V::transpose_sum, and each row keeps an online softmax
// (running max m, running sum l, accumulator acc) in float32.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvflow/cpu/kernel_table.h"
#include "kvflow/numeric.h"

namespace kvflow::cpu {
namespace {

constexpr int kKeyChunk = 16;

// Scores of one query row against 16 keys: sc[j] = q . k[j], q already scaled.
template <class V, int HD>
inline void chunk_scores(const float* q, const float* k, float* sc) {
  constexpr int W = V::kWidth;
  constexpr int NV = HD / W;
  typename V::Reg qv[NV];
  for (int v = 0; v < NV; ++v) qv[v] = V::load(q + v * W);
  for (int jb = 0; jb < kKeyChunk; jb += W) {
    typename V::Reg sums[W];
    for (int j = 0; j < W; ++j) {
      const float* kj = k + (jb + j) * HD;
      typename V::Reg s = V::mul(qv[0], V::load(kj));
      for (int v = 1; v < NV; ++v) s = V::fmadd(qv[v], V::load(kj + v * W), s);
      sums[j] = s;
    }
    V::store(sc + jb, V::transpose_sum(sums));
  }
}

// sc = cap * tanh(sc / cap), with tanh(x) = 2 / (1 + exp(-2x)) - 1.
template <class V>
inline void soft_cap_scores(float* sc, float cap) {
  constexpr int W = V::kWidth;
  for (int jb = 0; jb < kKeyChunk; jb += W) {
    const auto x = V::load(sc + jb);
    const auto e = V::exp(V::mul(x, V::set1(-2.f / cap)));
    const auto tanh_x = V::fmadd(V::set1(2.f), V::reciprocal(V::add(V::set1(1.f), e)), V::set1(-1.f));
    V::store(sc + jb, V::mul(tanh_x, V::set1(cap)));
  }
}

// Rows [K or V] of one kv head for keys [c0, c0 + n) of a block, widened to float32 into
// dst [16, HD]; rows past n are zeroed so that they can never contribute a NaN.
template <class V, typename T, int HD>
inline void widen_chunk(const T* src, int64_t row_stride, int n, float* dst) {
  constexpr int W = V::kWidth;
  for (int j = 0; j < n; ++j) {
    for (int v = 0; v < HD / W; ++v) V::store(dst + j * HD + v * W, V::load(src + j * row_stride + v * W));
  }
  std::fill(dst + n * HD, dst + kKeyChunk * HD, 0.f);
}

// The next chunk's K and V rows (every kv head: one contiguous span per cache), asked for a slice
// per row of the current chunk, so that the requests trickle out while it computes. Blocks sit in
// random order, so the hardware prefetchers cannot see the next one coming; a burst of requests
// at the start of a chunk overflows the miss queues and is mostly dropped.
template <typename T>
struct NextChunkPrefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t bytes = 0;
  int64_t step = 0;

  NextChunkPrefetch() = default;  // asks for nothing
  NextChunkPrefetch(const PagedAttentionArgs& a, const int32_t* block_table, int64_t next_c0, int64_t key_hi,
                    int64_t rows) {
    if (next_c0 >= key_hi || rows == 0) return;
    const int64_t slot = int64_t(block_table[next_c0 / a.block_size]) * a.block_size + next_c0 % a.block_size;
    const int64_t row_bytes = a.num_kv_heads * a.head_dim * int64_t(sizeof(T));
    k = static_cast<const char*>(a.key_cache) + slot * row_bytes;
    v = static_cast<const char*>(a.value_cache) + slot * row_bytes;
    bytes = std::min<int64_t>(kKeyChunk, key_hi - next_c0) * row_bytes;
    step = (bytes / 64 + rows - 1) / rows * 64;
  }

  void issue(int64_t row) const {
    const int64_t end = std::min(bytes, (row + 1) * step);
    for (int64_t byte = row * step; byte < end; byte += 64) {
      __builtin_prefetch(k + byte, 0, 2);
      __builtin_prefetch(v + byte, 0, 2);
    }
  }
};

// The keys an item's rows may see: from the 16-key chunk holding the first, to hi (exclusive).
struct KeyRange {
  int64_t first_chunk;
  int64_t hi;
};

inline KeyRange item_keys(const PagedAttentionArgs& a, const AttentionWorkItem& it) {
  const int64_t q_len = a.cu_seqlens_q[it.request + 1] - a.cu_seqlens_q[it.request];
  const int64_t first_pos = a.seq_lens[it.request] - q_len + it.q_begin;
  int64_t lo = it.key_begin;
  if (a.sliding_window > 0) lo = std::max<int64_t>(lo, first_pos - a.sliding_window + 1);
  return {lo / kKeyChunk * kKeyChunk, std::min<int64_t>(it.key_end, first_pos + it.q_count)};
}

// How many chunks ahead both attention kernels ask for keys and values: the next one (two cost
// one-request decode more time in the AVX-512 BF16 kernel and batched decode none,
// docs/benchmarks.md).
constexpr int64_t kPrefetchChunksAhead = 1;

// The prefetch for the chunk `ahead` chunks after c0 (of item item_index, whose keys end at
// key_hi): in the same item or, near its end, in the next item of [begin, end), whose first
// chunks are then not a cold start.
template <typename T>
NextChunkPrefetch<T> prefetch_ahead(const PagedAttentionArgs& a, const AttentionWorkItem* items, int64_t item_index,
                                    int64_t end, int64_t c0, int64_t key_hi, int64_t rows, int64_t ahead) {
  const AttentionWorkItem& it = items[item_index];
  const int64_t target = c0 + ahead * kKeyChunk;
  if (target < key_hi || item_index + 1 >= end) {
    return NextChunkPrefetch<T>(a, a.block_tables + it.request * a.max_blocks_per_seq, target, key_hi, rows);
  }
  const AttentionWorkItem& next = items[item_index + 1];
  const KeyRange next_keys = item_keys(a, next);
  const int64_t chunks_past_end = (target - (key_hi - 1) / kKeyChunk * kKeyChunk) / kKeyChunk - 1;
  return NextChunkPrefetch<T>(a, a.block_tables + next.request * a.max_blocks_per_seq,
                              next_keys.first_chunk + chunks_past_end * kKeyChunk, next_keys.hi, rows);
}

// The most rows (query tokens x query heads) any of items [begin, end) holds: the scratch size.
inline int64_t max_item_rows(const AttentionWorkItem* items, int64_t begin, int64_t end, int64_t group) {
  int64_t max_rows = 0;
  for (int64_t i = begin; i < end; ++i) {
    max_rows = std::max<int64_t>(max_rows, int64_t(items[i].q_count) * items[i].kv_count * group);
  }
  return max_rows;
}

// The end of one row: out = acc / l when the item saw all of the row's keys, else the partial
// (m, l, acc) of its split for merge_attention_splits.
template <class V, typename T, int HD>
inline void finish_row(const PagedAttentionArgs& a, const AttentionWorkItem& it, int64_t token, int64_t head,
                       const float* acc_row, float m, float l) {
  constexpr int W = V::kWidth;
  if (it.split < 0) {
    T* out = static_cast<T*>(a.out) + (token * a.num_q_heads + head) * HD;
    const auto inv = V::set1(l > 0.f ? 1.f / l : 0.f);
    for (int v = 0; v < HD / W; ++v) V::store(out + v * W, V::mul(V::load(acc_row + v * W), inv));
  } else {
    float* partial = a.partials + ((int64_t(it.split) * a.num_tokens + token) * a.num_q_heads + head) * (HD + 2);
    partial[0] = m;
    partial[1] = l;
    std::copy(acc_row, acc_row + HD, partial + 2);
  }
}

// Whether V reads 2W bfloat16 values as their even- and odd-indexed halves (load_pair_halves).
template <class V, class = void>
struct HasPairHalves : std::false_type {};
template <class V>
struct HasPairHalves<V, std::void_t<decltype(V::load_pair_halves(std::declval<const bfloat16*>(),
                                                                 std::declval<typename V::Reg&>(),
                                                                 std::declval<typename V::Reg&>()))>>
    : std::true_type {};

// bfloat16 caches on a V with load_pair_halves widen each 2W values of a K or V row into their
// even- and odd-indexed halves (a shift and a mask): the split order, in which the query and the
// accumulator of a row are kept too, undone once when the row is written. Where few rows share a
// kv head (decode), K and V are read in place so; where many do, a chunk's rows are widened into
// float32 scratch once per kv head, which pays off when enough rows read them. The two give the
// same bits, in the same order of operations, so a row's result never depends on how many rows
// share its item (batch-invariant mode).
template <class V, typename T, int HD>
constexpr bool kSplitPairs = std::is_same_v<T, bfloat16> && HasPairHalves<V>::value && HD % (2 * V::kWidth) == 0;
constexpr int64_t kMaxInPlaceRows = 8;  // rows of one kv head
constexpr int64_t kSharedKvRows = 4;    // rows of one kv head that share each K and V row read in place

// widen_chunk for the split order.
template <class V, int HD>
inline void widen_chunk_split(const bfloat16* src, int64_t row_stride, int n, float* dst) {
  constexpr int W = V::kWidth;
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < HD; i += 2 * W) {
      typename V::Reg even, odd;
      V::load_pair_halves(src + j * row_stride + i, even, odd);
      V::store(dst + j * HD + i, even);
      V::store(dst + j * HD + i + W, odd);
    }
  }
  std::fill(dst + n * HD, dst + kKeyChunk * HD, 0.f);
}

// Scores of one query row (split order, already scaled) against 16 keys read in place:
// sc[j] = q . k[j], key j's row at k + j * row_stride.
template <class V, int HD>
inline void chunk_scores_split(const float* q, const bfloat16* k, int64_t row_stride, float* sc) {
  constexpr int W = V::kWidth;
  for (int jb = 0; jb < kKeyChunk; jb += W) {
    typename V::Reg sums[W];
    for (int j = 0; j < W; ++j) {
      const bfloat16* kj = k + (jb + j) * row_stride;
      typename V::Reg even, odd;
      V::load_pair_halves(kj, even, odd);
      typename V::Reg s = V::fmadd(V::load(q + W), odd, V::mul(V::load(q), even));
      for (int i = 2 * W; i < HD; i += 2 * W) {
        V::load_pair_halves(kj + i, even, odd);
        s = V::fmadd(V::load(q + i), even, s);
        s = V::fmadd(V::load(q + i + W), odd, s);
      }
      sums[j] = s;
    }
    V::store(sc + jb, V::transpose_sum(sums));
  }
}

// chunk_scores_split for kRows rows of one kv head at once (q: kRows rows of HD floats; sc: kRows
// rows of 16 scores). Each K row's halves are loaded once for all of the rows; each row's sums
// take the operations of chunk_scores_split in its order, so the bits are the same.
template <class V, int HD, int kRows>
inline void chunk_scores_split_rows(const float* q, const bfloat16* k, int64_t row_stride, float* sc) {
  constexpr int W = V::kWidth;
  for (int jb = 0; jb < kKeyChunk; jb += W) {
    typename V::Reg sums[kRows][W];
    for (int j = 0; j < W; ++j) {
      const bfloat16* kj = k + (jb + j) * row_stride;
      typename V::Reg even, odd, s[kRows];
      V::load_pair_halves(kj, even, odd);
      for (int r = 0; r < kRows; ++r) {
        s[r] = V::fmadd(V::load(q + r * HD + W), odd, V::mul(V::load(q + r * HD), even));
      }
      for (int i = 2 * W; i < HD; i += 2 * W) {
        V::load_pair_halves(kj + i, even, odd);
        for (int r = 0; r < kRows; ++r) {
          s[r] = V::fmadd(V::load(q + r * HD + i), even, s[r]);
          s[r] = V::fmadd(V::load(q + r * HD + i + W), odd, s[r]);
        }
      }
      for (int r = 0; r < kRows; ++r) sums[r][j] = s[r];
    }
    for (int r = 0; r < kRows; ++r) V::store(sc + r * kKeyChunk + jb, V::transpose_sum(sums[r]));
  }
}

// The accumulators (split order) of kRows rows of one kv head through one chunk read in place:
// acc = acc * correction + the sum over keys [j_lo, j_hi) of p[j] v[j], row by row (p: kRows rows
// of 16). Each V row's halves are loaded once for all of the rows; each row's operations are
// those of the one-row loop, in its order.
template <class V, int HD, int kRows>
inline void accumulate_split_rows(const float* p, const float* correction, const bfloat16* v, int64_t row_stride,
                                  int j_lo, int j_hi, float* acc) {
  constexpr int W = V::kWidth;
  for (int i = 0; i < HD; i += 2 * W) {
    typename V::Reg even_acc[kRows], odd_acc[kRows];
    for (int r = 0; r < kRows; ++r) {
      const auto c = V::set1(correction[r]);
      even_acc[r] = V::mul(V::load(acc + r * HD + i), c);
      odd_acc[r] = V::mul(V::load(acc + r * HD + i + W), c);
    }
    for (int j = j_lo; j < j_hi; ++j) {
      typename V::Reg even, odd;
      V::load_pair_halves(v + j * row_stride + i, even, odd);
      for (int r = 0; r < kRows; ++r) {
        const auto pj = V::set1(p[r * kKeyChunk + j]);
        even_acc[r] = V::fmadd(pj, even, even_acc[r]);
        odd_acc[r] = V::fmadd(pj, odd, odd_acc[r]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      V::store(acc + r * HD + i, even_acc[r]);
      V::store(acc + r * HD + i + W, odd_acc[r]);
    }
  }
}

// A row of HD floats from split order (each 2W values: the W even-indexed, then the W odd-indexed)
// into natural order.
template <int W, int HD>
inline void unsplit_pairs(const float* split, float* natural) {
  for (int i = 0; i < HD; i += 2 * W) {
    for (int l = 0; l < W; ++l) {
      natural[i + 2 * l] = split[i + l];
      natural[i + 2 * l + 1] = split[i + W + l];
    }
  }
}

template <class V, typename T, int HD>
void paged_attention(const PagedAttentionArgs& a, const AttentionWorkItem* items, int64_t begin, int64_t end) {
  constexpr int W = V::kWidth;
  constexpr int NV = HD / W;
  static_assert(HD % W == 0 && kKeyChunk % W == 0, "head_dim and the key chunk must be multiples of the width");
  const int64_t group = a.num_q_heads / a.num_kv_heads;
  const int64_t kv_row_stride = a.num_kv_heads * HD;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  const int64_t max_rows = max_item_rows(items, begin, end, group);
  std::vector<float> q_rows(max_rows * HD), acc_rows(max_rows * HD), m_rows(max_rows), l_rows(max_rows);
  std::vector<float> k_chunk(kKeyChunk * HD), v_chunk(kKeyChunk * HD);
  alignas(64) float sc[kKeyChunk];
  alignas(64) float p[kKeyChunk];
  alignas(64) float natural[HD];

  for (int64_t item_index = begin; item_index < end; ++item_index) {
    const AttentionWorkItem& it = items[item_index];
    const int64_t first_token = a.cu_seqlens_q[it.request];
    const int64_t q_len = a.cu_seqlens_q[it.request + 1] - first_token;
    const int64_t context_start = a.seq_lens[it.request] - q_len;  // position of query 0
    // Rows are (kv head k, query token t, query head m of k's group), in that order.
    const int64_t rows_per_kv_head = it.q_count * group;
    const int64_t rows = it.kv_count * rows_per_kv_head;
    const int32_t* block_table = a.block_tables + it.request * a.max_blocks_per_seq;
    const bool in_place = kSplitPairs<V, T, HD> && rows_per_kv_head <= kMaxInPlaceRows;

    for (int64_t r = 0; r < rows; ++r) {
      const int64_t token = first_token + it.q_begin + (r % rows_per_kv_head) / group;
      const int64_t head = it.kv_head * group + r / rows_per_kv_head * group + r % group;
      const T* q = static_cast<const T*>(a.query) + token * a.q_stride + head * HD;
      float* q_row = &q_rows[r * HD];
      if constexpr (kSplitPairs<V, T, HD>) {
        for (int i = 0; i < HD; i += 2 * W) {
          typename V::Reg even, odd;
          V::load_pair_halves(q + i, even, odd);
          V::store(q_row + i, V::mul(even, V::set1(a.scale)));
          V::store(q_row + i + W, V::mul(odd, V::set1(a.scale)));
        }
      } else {
        for (int v = 0; v < NV; ++v) V::store(q_row + v * W, V::mul(V::load(q + v * W), V::set1(a.scale)));
      }
      std::fill(&acc_rows[r * HD], &acc_rows[r * HD] + HD, 0.f);
      m_rows[r] = neg_inf;
      l_rows[r] = 0.f;
    }

    // Keys any row of the tile may see.
    const int64_t first_pos = context_start + it.q_begin;
    const KeyRange keys = item_keys(a, it);
    const int64_t key_hi = keys.hi;

    // Row r through one chunk's scores (keys [j_lo, j_hi) of its 16 count): probs = exp(scores - m),
    // the running max and sum updated; returns the factor that rescales the row's accumulator.
    auto softmax_chunk = [&](int64_t r, float* scores, float* probs, int j_lo, int j_hi) {
      if (a.soft_cap > 0.f) soft_cap_scores<V>(scores, a.soft_cap);
      const bool whole_chunk = j_lo == 0 && j_hi == kKeyChunk;
      if (!whole_chunk) {
        for (int j = 0; j < kKeyChunk; ++j) {
          if (j < j_lo || j >= j_hi) scores[j] = neg_inf;
        }
      }
      typename V::Reg chunk_max = V::load(scores);
      for (int jb = W; jb < kKeyChunk; jb += W) chunk_max = V::max(chunk_max, V::load(scores + jb));
      const float m_new = std::max(m_rows[r], V::reduce_max(chunk_max));
      // 0 on the first chunk; 1 whenever the max holds, which is most chunks after the first few.
      const float correction = m_new == m_rows[r] ? 1.f : std::exp(m_rows[r] - m_new);
      for (int jb = 0; jb < kKeyChunk; jb += W) {
        V::store(probs + jb, V::exp(V::sub(V::load(scores + jb), V::set1(m_new))));
      }
      if (!whole_chunk) {
        for (int j = 0; j < kKeyChunk; ++j) {
          if (j < j_lo || j >= j_hi) probs[j] = 0.f;
        }
      }
      typename V::Reg chunk_sum = V::load(probs);
      for (int jb = W; jb < kKeyChunk; jb += W) chunk_sum = V::add(chunk_sum, V::load(probs + jb));
      l_rows[r] = l_rows[r] * correction + V::reduce_add(chunk_sum);
      m_rows[r] = m_new;
      return correction;
    };

    for (int64_t c0 = keys.first_chunk; c0 < key_hi; c0 += kKeyChunk) {
      // The next chunk of this item or, at its last, the first of the next item.
      const NextChunkPrefetch<T> prefetch =
          prefetch_ahead<T>(a, items, item_index, end, c0, key_hi, rows, kPrefetchChunksAhead);
      const int n = int(std::min<int64_t>(kKeyChunk, key_hi - c0));
      const int64_t block = block_table[c0 / a.block_size];
      const int64_t first_slot = block * a.block_size + c0 % a.block_size;
      const T* k_rows = nullptr;
      const T* v_rows = nullptr;
      for (int64_t r = 0; r < rows; ++r) {
        prefetch.issue(r);
        if (r % rows_per_kv_head == 0) {  // first row of the next kv head
          const int64_t offset = first_slot * kv_row_stride + (it.kv_head + r / rows_per_kv_head) * HD;
          k_rows = static_cast<const T*>(a.key_cache) + offset;
          v_rows = static_cast<const T*>(a.value_cache) + offset;
          if constexpr (kSplitPairs<V, T, HD>) {
            if (!in_place) {
              widen_chunk_split<V, HD>(k_rows, kv_row_stride, n, k_chunk.data());
              widen_chunk_split<V, HD>(v_rows, kv_row_stride, n, v_chunk.data());
            }
          } else {
            widen_chunk<V, T, HD>(k_rows, kv_row_stride, n, k_chunk.data());
            widen_chunk<V, T, HD>(v_rows, kv_row_stride, n, v_chunk.data());
          }
        }
        const int64_t pos = first_pos + (r % rows_per_kv_head) / group;
        int64_t lo = std::max<int64_t>(it.key_begin, c0);
        if (a.sliding_window > 0) lo = std::max<int64_t>(lo, pos - a.sliding_window + 1);
        const int64_t hi = std::min<int64_t>({it.key_end, pos + 1, c0 + n});
        const int j_lo = int(lo - c0), j_hi = int(hi - c0);
        // One query token (decode): the kv head's rows see the same keys, and read each K and V
        // row in place once for up to kSharedKvRows of them.
        if constexpr (kSplitPairs<V, T, HD>) {
          if (in_place && it.q_count == 1 && r % rows_per_kv_head == 0) {
            for (int64_t t = r + 1; t < r + rows_per_kv_head; ++t) prefetch.issue(t);
            auto rows_chunk = [&]<int kRows>(int64_t t) {
              alignas(64) float sc_rows[kRows * kKeyChunk], p_rows[kRows * kKeyChunk], corrections[kRows];
              chunk_scores_split_rows<V, HD, kRows>(&q_rows[t * HD], k_rows, kv_row_stride, sc_rows);
              for (int i = 0; i < kRows; ++i) {
                corrections[i] = softmax_chunk(t + i, sc_rows + i * kKeyChunk, p_rows + i * kKeyChunk, j_lo, j_hi);
              }
              accumulate_split_rows<V, HD, kRows>(p_rows, corrections, v_rows, kv_row_stride, j_lo, j_hi,
                                                  &acc_rows[t * HD]);
            };
            for (int64_t t = r; lo < hi && t < r + rows_per_kv_head; t += kSharedKvRows) {
              switch (std::min<int64_t>(kSharedKvRows, r + rows_per_kv_head - t)) {
                case 1: rows_chunk.template operator()<1>(t); break;
                case 2: rows_chunk.template operator()<2>(t); break;
                case 3: rows_chunk.template operator()<3>(t); break;
                default: rows_chunk.template operator()<4>(t); break;
              }
            }
            r += rows_per_kv_head - 1;
            continue;
          }
        }
        if (lo >= hi) continue;

        // Read in place, the keys past the chunk's n rows are read too (the block holds them, whatever
        // their contents); masked to -inf here and to 0 below, they never count.
        if (in_place) {
          if constexpr (kSplitPairs<V, T, HD>) chunk_scores_split<V, HD>(&q_rows[r * HD], k_rows, kv_row_stride, sc);
        } else {
          chunk_scores<V, HD>(&q_rows[r * HD], k_chunk.data(), sc);
        }
        const float correction = softmax_chunk(r, sc, p, j_lo, j_hi);

        float* acc_row = &acc_rows[r * HD];
        typename V::Reg acc[NV];
        const auto vcorr = V::set1(correction);
        for (int v = 0; v < NV; ++v) acc[v] = V::mul(V::load(acc_row + v * W), vcorr);
        if (in_place) {
          if constexpr (kSplitPairs<V, T, HD>) {
            for (int j = j_lo; j < j_hi; ++j) {
              const auto pj = V::set1(p[j]);
              const T* vj = v_rows + j * kv_row_stride;
              for (int v = 0; v < NV; v += 2) {
                typename V::Reg even, odd;
                V::load_pair_halves(vj + v * W, even, odd);
                acc[v] = V::fmadd(pj, even, acc[v]);
                acc[v + 1] = V::fmadd(pj, odd, acc[v + 1]);
              }
            }
          }
        } else {
          for (int j = j_lo; j < j_hi; ++j) {
            const auto pj = V::set1(p[j]);
            const float* vj = &v_chunk[j * HD];
            for (int v = 0; v < NV; ++v) acc[v] = V::fmadd(pj, V::load(vj + v * W), acc[v]);
          }
        }
        for (int v = 0; v < NV; ++v) V::store(acc_row + v * W, acc[v]);
      }
    }

    for (int64_t r = 0; r < rows; ++r) {
      const int64_t token = first_token + it.q_begin + (r % rows_per_kv_head) / group;
      const int64_t head = it.kv_head * group + r / rows_per_kv_head * group + r % group;
      const float* acc_row = &acc_rows[r * HD];
      if constexpr (kSplitPairs<V, T, HD>) {
        unsplit_pairs<W, HD>(acc_row, natural);
        acc_row = natural;
      }
      finish_row<V, T, HD>(a, it, token, head, acc_row, m_rows[r], l_rows[r]);
    }
  }
}

}  // namespace
}  // namespace kvflow::cpu
