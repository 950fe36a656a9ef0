// Paged attention for bfloat16 caches on CPUs with AVX-512 BF16: both products run on
// vdpbf16ps (16 lanes x a pair of bf16 products, accumulated in float32), so K and V are never
// widened and no horizontal sums are needed. Include only in isa_avx512_bf16.cpp.
//
// Per 16-key chunk and kv head:
//   - K is transposed into Kt[p] = (k_j[2p], k_j[2p + 1]) for the 16 keys j, so that one query
//     row's 16 scores are sum_p dpbf16(Kt[p], broadcast(q[2p], q[2p + 1])): keys along lanes.
//   - V rows of keys (2i, 2i + 1) are interleaved element-wise, so that the accumulator update
//     is dpbf16(V_pair, broadcast(p[2i], p[2i + 1])) with the probabilities rounded to bf16,
//     as FlashAttention does for its P.V product. Interleaving within 128-bit lanes leaves the
//     accumulator's dims in a fixed scrambled order, undone once when the row is written.
//   - Rows (query tokens x query heads of the kv head) go through in blocks of up to 4, so that
//     each Kt and V register read from the stack serves 4 rows' products, not one.
// The online softmax itself (max, exp, sum, rescale) stays in float32, as in attention.h.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kvflow/cpu/attention.h"
#include "kvflow/cpu/kernel_table.h"
#include "kvflow/cpu/vec_avx512_bf16.h"
#include "kvflow/numeric.h"

namespace kvflow::cpu {
namespace {

inline __m512 dot_bf16(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// In place: r[i] lane c  <-  r[c] lane i, for 32-bit lanes of 16 registers.
inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i u[16];  // u[4i + k], 128-bit lane L: column 4L + k of rows 4i .. 4i + 3
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i a = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44);
    const __m512i b = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xee);
    const __m512i c = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44);
    const __m512i d = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xee);
    r[k] = _mm512_shuffle_i32x4(a, c, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(a, c, 0xdd);
    r[8 + k] = _mm512_shuffle_i32x4(b, d, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(b, d, 0xdd);
  }
}

inline int32_t load_pair(const bfloat16* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// How many chunks of a key split the kernel reads first, K and V of every kv head, before it
// computes over them. A split is all of its layer's attention that a thread has (a few requests
// decoding), it comes from memory, and plain loads keep more of it in flight than the chunk-ahead
// prefetch: a split of 96 keys took 14% less time (docs/benchmarks.md). Eight chunks, 96 KB of K
// and V for 3 kv heads of 64 dims, fit in any L2.
constexpr int64_t kSplitChunksReadFirst = 8;

// Keys [first_chunk, end) of every kv head, K and V, read into the cache: a word of each line
// of each chunk's two spans (those a NextChunkPrefetch of the chunk would ask for).
inline void read_keys(const PagedAttentionArgs& a, const int32_t* block_table, int64_t first_chunk, int64_t end) {
  uint64_t sink = 0;
  for (int64_t c0 = first_chunk; c0 < end; c0 += kKeyChunk) {
    const NextChunkPrefetch<bfloat16> chunk(a, block_table, c0, end, 1);
    for (int64_t byte = 0; byte < chunk.bytes; byte += 64) {
      uint64_t k_word, v_word;
      std::memcpy(&k_word, chunk.k + byte, sizeof(k_word));
      std::memcpy(&v_word, chunk.v + byte, sizeof(v_word));
      sink += k_word ^ v_word;
    }
  }
  asm volatile("" : : "r"(sink));  // the loads must happen: nothing else reads what they return
}

template <int HD>
void paged_attention_avx512_bf16(const PagedAttentionArgs& a, const AttentionWorkItem* items, int64_t begin,
                                 int64_t end) {
  constexpr int kBlocks = HD / 32;  // 32 bf16 per register
  constexpr int kPairs = HD / 2;    // K^T registers per chunk
  static_assert(HD % 32 == 0, "head_dim must be a multiple of 32");
  const int64_t group = a.num_q_heads / a.num_kv_heads;
  const int64_t kv_row_stride = a.num_kv_heads * HD;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  const int64_t max_rows = max_item_rows(items, begin, end, group);
  // Each row's softmax sum is kept per lane (16 partial sums, added once at the row's end).
  std::vector<float> acc_rows(max_rows * HD), m_rows(max_rows), l_lanes(max_rows * 16);
  std::vector<const bfloat16*> row_query(max_rows);  // each row's query vector
  std::vector<int64_t> row_pos(max_rows);             // and its token's position
  __m512i k_t[kPairs];                // [HD / 2] registers of 16 keys' pairs
  __m512i v_pairs[8 * kBlocks * 2];  // [8 key pairs][kBlocks][lo, hi]
  constexpr int kRowBlock = 4;                                   // rows sharing each K^T and V register read
  constexpr int kDimGroup = (2 * kBlocks) % 4 == 0 ? 4 : 2;      // P.V accumulators a row at a time
  const __m512i unscramble_lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i unscramble_hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);

  // K^T and the interleaved V of one kv head for the chunk's n keys starting at first_slot.
  // Rows past n are zeros: stale cache memory there may hold NaNs, and 0 * NaN is NaN.
  auto pack_chunk = [&](int64_t first_slot, int64_t kv_head, int n) {
    const bfloat16* k_rows = static_cast<const bfloat16*>(a.key_cache) + first_slot * kv_row_stride + kv_head * HD;
    const bfloat16* v_rows = static_cast<const bfloat16*>(a.value_cache) + first_slot * kv_row_stride + kv_head * HD;
    // A masked load rather than a branch per row: rows past n load nothing and read as zeros.
    auto row_block = [&](const bfloat16* base, int j, int b) {
      return _mm512_maskz_loadu_epi16(__mmask32(0u - uint32_t(j < n)), base + j * kv_row_stride + b * 32);
    };
    for (int g = 0; g < kPairs / 16; ++g) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) r[j] = row_block(k_rows, j, g);
      transpose_16x16(r);
      for (int c = 0; c < 16; ++c) k_t[g * 16 + c] = r[c];
    }
    for (int i = 0; i < 8; ++i) {
      for (int b = 0; b < kBlocks; ++b) {
        const __m512i v0 = row_block(v_rows, 2 * i, b), v1 = row_block(v_rows, 2 * i + 1, b);
        v_pairs[(i * kBlocks + b) * 2] = _mm512_unpacklo_epi16(v0, v1);
        v_pairs[(i * kBlocks + b) * 2 + 1] = _mm512_unpackhi_epi16(v0, v1);
      }
    }
  };

  for (int64_t item_index = begin; item_index < end; ++item_index) {
    const AttentionWorkItem& it = items[item_index];
    const int64_t first_token = a.cu_seqlens_q[it.request];
    const int64_t q_len = a.cu_seqlens_q[it.request + 1] - first_token;
    const int64_t first_pos = a.seq_lens[it.request] - q_len + it.q_begin;
    // Rows are (kv head k, query token t, query head m of k's group), in that order.
    const int64_t rows_per_kv_head = it.q_count * group;
    const int64_t rows = it.kv_count * rows_per_kv_head;
    const int32_t* block_table = a.block_tables + it.request * a.max_blocks_per_seq;
    auto row_token = [&](int64_t r) { return first_token + it.q_begin + (r % rows_per_kv_head) / group; };
    auto row_head = [&](int64_t r) { return it.kv_head * group + r / rows_per_kv_head * group + r % group; };
    for (int64_t r = 0; r < rows; ++r) {
      row_query[r] = static_cast<const bfloat16*>(a.query) + row_token(r) * a.q_stride + row_head(r) * HD;
      row_pos[r] = first_pos + (r % rows_per_kv_head) / group;
    }
    std::fill(acc_rows.begin(), acc_rows.begin() + rows * HD, 0.f);
    std::fill(m_rows.begin(), m_rows.begin() + rows, neg_inf);
    std::fill(l_lanes.begin(), l_lanes.begin() + rows * 16, 0.f);

    const KeyRange keys = item_keys(a, it);
    const int64_t key_hi = keys.hi;

    // Rows r0 .. r0 + R of one kv head against its packed chunk of n keys from c0. Each K^T and
    // V register read serves the R rows; each row's own steps (two chains of Q.K products, its
    // softmax, one chain per 16 dims of P.V over all 8 key pairs) are the same whatever R is, so
    // that a row's result does not depend on the rows beside it (batch-invariant mode). A row
    // with no key in the chunk takes p = 0 and keeps its max and sum.
    auto attend_rows = [&]<int R>(int64_t r0, int64_t c0, int n) {
      const bfloat16* q[R];
      __mmask16 valid[R];
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        const int64_t r = r0 + i;
        q[i] = row_query[r];
        const int64_t pos = row_pos[r];
        int64_t lo = std::max<int64_t>(it.key_begin, c0);
        if (a.sliding_window > 0) lo = std::max<int64_t>(lo, pos - a.sliding_window + 1);
        const int64_t hi = std::min<int64_t>({it.key_end, pos + 1, c0 + n});
        valid[i] = lo < hi ? __mmask16(((1u << (hi - c0)) - 1u) & ~((1u << (lo - c0)) - 1u)) : __mmask16(0);
      }
      __m512 even[R], odd[R];
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) even[i] = odd[i] = _mm512_setzero_ps();
#pragma GCC unroll 64
      for (int p = 0; p < kPairs; p += 2) {
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) even[i] = dot_bf16(even[i], k_t[p], _mm512_set1_epi32(load_pair(q[i] + 2 * p)));
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) {
          odd[i] = dot_bf16(odd[i], k_t[p + 1], _mm512_set1_epi32(load_pair(q[i] + 2 * p + 2)));
        }
      }
      alignas(64) int32_t p_pairs[R][8];
      float correction[R];
      for (int i = 0; i < R; ++i) {
        const int64_t r = r0 + i;
        correction[i] = 1.f;
        if (valid[i] == 0) {
          std::fill(p_pairs[i], p_pairs[i] + 8, 0);
          continue;
        }
        __m512 s = _mm512_mul_ps(_mm512_add_ps(even[i], odd[i]), _mm512_set1_ps(a.scale));
        if (a.soft_cap > 0.f) {
          const __m512 e = VecAvx512::exp(_mm512_mul_ps(s, _mm512_set1_ps(-2.f / a.soft_cap)));
          const __m512 t = _mm512_fmadd_ps(_mm512_set1_ps(2.f), VecAvx512::reciprocal(_mm512_add_ps(_mm512_set1_ps(1.f), e)),
                                           _mm512_set1_ps(-1.f));
          s = _mm512_mul_ps(t, _mm512_set1_ps(a.soft_cap));
        }
        s = _mm512_mask_mov_ps(_mm512_set1_ps(neg_inf), valid[i], s);
        const float m_new = std::max(m_rows[r], VecAvx512::reduce_max(s));
        // 1 whenever the max holds, which is most chunks after the first few.
        if (m_new != m_rows[r]) correction[i] = std::exp(m_rows[r] - m_new);
        const __m512 p = _mm512_maskz_mov_ps(valid[i], VecAvx512::exp(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
        float* l = &l_lanes[r * 16];
        _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), _mm512_set1_ps(correction[i]), p));
        m_rows[r] = m_new;
        _mm256_store_si256(reinterpret_cast<__m256i*>(p_pairs[i]), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p)));
      }
      for (int b0 = 0; b0 < 2 * kBlocks; b0 += kDimGroup) {
        __m512 acc[R][kDimGroup];
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) {
          const __m512 vcorr = _mm512_set1_ps(correction[i]);
#pragma GCC unroll 4
          for (int b = 0; b < kDimGroup; ++b) {
            acc[i][b] = _mm512_mul_ps(_mm512_loadu_ps(&acc_rows[(r0 + i) * HD + 16 * (b0 + b)]), vcorr);
          }
        }
#pragma GCC unroll 8
        for (int pair = 0; pair < 8; ++pair) {
          __m512i pp[R];
#pragma GCC unroll 4
          for (int i = 0; i < R; ++i) pp[i] = _mm512_set1_epi32(p_pairs[i][pair]);
#pragma GCC unroll 4
          for (int b = 0; b < kDimGroup; ++b) {
            const __m512i v = v_pairs[pair * 2 * kBlocks + b0 + b];
#pragma GCC unroll 4
            for (int i = 0; i < R; ++i) acc[i][b] = dot_bf16(acc[i][b], v, pp[i]);
          }
        }
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
          for (int b = 0; b < kDimGroup; ++b) _mm512_storeu_ps(&acc_rows[(r0 + i) * HD + 16 * (b0 + b)], acc[i][b]);
        }
      }
    };

    // A split's first chunks are read before anything else, and prefetches start past them.
    const int64_t read_end = it.split >= 0
                                 ? std::min<int64_t>(key_hi, keys.first_chunk + kSplitChunksReadFirst * kKeyChunk)
                                 : keys.first_chunk;
    if (read_end > keys.first_chunk) read_keys(a, block_table, keys.first_chunk, read_end);
    for (int64_t c0 = keys.first_chunk; c0 < key_hi; c0 += 16) {
      // The next chunk, in this item or, at its last, the first of the next one (items are handed
      // out several at a time, see paged_attention, so that the next one's first chunk is not a
      // cold start); and at the first chunk of an item not read first, that chunk's rows of every
      // kv head at once, rather than one kv head's as each is packed.
      const NextChunkPrefetch<bfloat16> prefetch =
          c0 + kPrefetchChunksAhead * kKeyChunk < read_end
              ? NextChunkPrefetch<bfloat16>()
              : prefetch_ahead<bfloat16>(a, items, item_index, end, c0, key_hi, rows, kPrefetchChunksAhead);
      if (c0 == keys.first_chunk && read_end == c0) {
        NextChunkPrefetch<bfloat16>(a, block_table, c0, key_hi, 1).issue(0);
      }
      const int n = int(std::min<int64_t>(16, key_hi - c0));
      const int64_t first_slot = int64_t(block_table[c0 / a.block_size]) * a.block_size + c0 % a.block_size;
      for (int64_t head_rows = 0; head_rows < rows; head_rows += rows_per_kv_head) {
        pack_chunk(first_slot, it.kv_head + head_rows / rows_per_kv_head, n);
        for (int64_t r0 = head_rows; r0 < head_rows + rows_per_kv_head; r0 += kRowBlock) {
          const int64_t count = std::min<int64_t>(kRowBlock, head_rows + rows_per_kv_head - r0);
          for (int64_t r = r0; r < r0 + count; ++r) prefetch.issue(r);
          switch (count) {
            case 1: attend_rows.template operator()<1>(r0, c0, n); break;
            case 2: attend_rows.template operator()<2>(r0, c0, n); break;
            case 3: attend_rows.template operator()<3>(r0, c0, n); break;
            default: attend_rows.template operator()<kRowBlock>(r0, c0, n); break;
          }
        }
      }
    }

    for (int64_t r = 0; r < rows; ++r) {
      const int64_t token = row_token(r);
      const int64_t head = row_head(r);
      float* acc_row = &acc_rows[r * HD];
      // acc holds, per 32 dims, [lo | hi] in interleaved order; restore dims 0..31.
      for (int b = 0; b < kBlocks; ++b) {
        const __m512 lo = _mm512_loadu_ps(acc_row + 32 * b), hi = _mm512_loadu_ps(acc_row + 32 * b + 16);
        _mm512_storeu_ps(acc_row + 32 * b, _mm512_permutex2var_ps(lo, unscramble_lo, hi));
        _mm512_storeu_ps(acc_row + 32 * b + 16, _mm512_permutex2var_ps(lo, unscramble_hi, hi));
      }
      const float l = VecAvx512::reduce_add(_mm512_loadu_ps(&l_lanes[r * 16]));
      finish_row<VecAvx512Bf16, bfloat16, HD>(a, it, token, head, acc_row, m_rows[r], l);
    }
  }
}

}  // namespace
}  // namespace kvflow::cpu
