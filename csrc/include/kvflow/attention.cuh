// Paged attention on the GPU: causal attention of a batch of requests' new query tokens over
// their paged KV cache, with GQA, an optional sliding window and an optional logit soft cap.
// Torch-free: raw pointers, sizes, a stream, an error code.
//
// The unit of work is a "row": one (query token, query head) pair. The rows of one request and
// one kv head are numbered r = t * group + g (token t of the request, head g of the kv head's
// group of num_q_heads / num_kv_heads query heads), so a CTA that owns a tile of consecutive
// rows reads each K/V row once for every query head sharing it (GQA), decode and prefill alike.
// A CTA is (row tile, kv head, key split): grid (num_tiles, num_kv_heads, num_splits).
//
// Two kernels share that grid and the split/merge machinery:
//   - rows kernel (CUDA cores, any dtype): 8 rows per CTA. Used for decode (max_query_len == 1),
//     for float32, and as the fallback when a pointer or stride is not 16-byte aligned (then
//     K/V move element by element). Keys come 64 at a time: phase 1 scores them (4 lanes per
//     key, 16-byte K loads) into shared memory, phase 2 updates each row's online softmax,
//     phase 3 accumulates P.V (4 dims per lane, each warp owning a quarter of head_dim, so no
//     cross-warp reduction is ever needed).
//   - tensor-core kernel (float16 / bfloat16, max_query_len > 1): FlashAttention-2 style, 64
//     rows per CTA (16 per warp), K/V tiles of 64 keys (32 for head_dim 256) gathered from the
//     block table with cp.async, S = Q.K^T and O += P.V with mma.sync m16n8k16 (float32
//     accumulators, P rounded to the input dtype for the second product, as FlashAttention does),
//     the next K tile loading while P.V runs.
//
// Map from CTA to rows without reading device memory on the host: either directly (request =
// blockIdx.x / tiles_per_request) when max_query_len bounds the tiles tightly (decode, one big
// prefill), or, for mixed batches, by a binary search over cu_seqlens_q: request b owns the CTA
// slots [first_slot(b), first_slot(b + 1)) with first_slot(b) = ceil(cu[b] * group / rows) + b,
// which always holds its ceil(q_len * group / rows) tiles; spare slots exit at once. The grid is
// then ceil(num_tokens * group / rows) + batch CTAs per kv head and split.
//
// Split-KV (flash-decoding): when the grid has fewer CTAs than the device wants (a few per SM),
// each request's keys are cut into num_splits ranges of keys_per_split (a multiple of 64), each
// CTA writes the unnormalised partial (running max m, sum l, accumulator acc) of its rows, and
// merge_splits_kernel combines them into out. A split that sees no key of a row writes l = 0,
// which the merge skips. Scores are kept in base-2 units (logit * log2 e) so that exp2f does the
// exponentials; the partial maxima are in those units too.
//
// Workspace: [num_splits, num_tokens, num_q_heads, head_dim + 2] float32 (m, l, acc[head_dim]),
// PagedAttentionPlan::workspace_floats of it, 0 without splits. It never exceeds
// paged_attention_max_workspace_floats(head_dim, num_sms); a caller that captures CUDA graphs
// passes at least that much (8-byte aligned) and the op allocates nothing.
//
// Contract (not checked on the device; the CPU path validates it): cu_seqlens_q is
// non-decreasing from 0 to num_tokens; q_len <= max_query_len and q_len <= seq_len <= max_seq_len
// for every request; every block_tables entry of a used block is a valid block id. Breaking it
// leaves rows unwritten or reads outside the cache. A captured CUDA graph keeps the plan (grid,
// splits) of the capture call, so its replays must stay within that call's max_query_len,
// max_seq_len, num_tokens and batch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvflow/cuda_utils.cuh"
#include "kvflow/numeric.h"

namespace kvflow::cuda_kernels {

// Rows kernel: 8 rows per CTA of 4 warps, keys 64 at a time.
constexpr int kRowsPerCta = 8;
constexpr int kRowsThreads = 128;
constexpr int kRowsWarps = kRowsThreads / 32;
constexpr int kKeyChunk = 64;
constexpr int kScoreLanes = 4;  // lanes that share one key's dot products in phase 1
constexpr int kRowsMinCtasPerSm = 4;  // caps registers at 128: 16 warps per SM to hide DRAM latency
// Tensor-core kernel: 64 rows per CTA of 4 warps, 16 rows per warp (the mma's M).
constexpr int kMmaRows = 64;
constexpr int kMmaThreads = 128;
constexpr int kMmaMinCtasPerSm = 2;  // up to 255 registers: O, S and fragments stay unspilled
// Split-KV: split keys until a kernel has this many CTAs per SM, never below kMinKeysPerSplit
// keys per split.
constexpr int kRowsTargetCtasPerSm = 4;
constexpr int kMmaTargetCtasPerSm = 2;
constexpr int kMinKeysPerSplit = 256;
constexpr int kSplitAlign = 64;
constexpr int kMergeThreads = 128;  // one warp per (token, head)
constexpr float kLog2e = 1.4426950408889634f;

struct PagedAttentionParams {
  void* out;                    // [num_tokens, num_q_heads, head_dim], contiguous
  const void* query;            // [num_tokens, num_q_heads, head_dim], token stride q_stride, heads packed
  int64_t q_stride;             // in elements
  const void* key_cache;        // [num_blocks, block_size, num_kv_heads, head_dim], contiguous
  const void* value_cache;      // [num_blocks, block_size, num_kv_heads, head_dim], contiguous
  const int32_t* block_tables;  // [batch, max_blocks_per_seq]
  int64_t max_blocks_per_seq;
  const int32_t* cu_seqlens_q;  // [batch + 1]
  const int32_t* seq_lens;      // [batch], context length including the new tokens
  float* workspace;             // [num_splits, num_tokens, num_q_heads, head_dim + 2] when num_splits > 1
  int num_tokens;
  int batch;
  int num_q_heads;
  int num_kv_heads;
  int block_shift;     // log2(block_size); block_size is a power of two
  float scale;         // logits = scale * q.k
  float soft_cap;      // logits = soft_cap * tanh(logits / soft_cap) when > 0
  int sliding_window;  // > 0: a query at pos sees keys (pos - sliding_window, pos]
};

struct PagedAttentionPlan {
  bool tensor_cores;          // the mma kernel, else the rows kernel
  bool packed;                // K/V rows and out move in 16-byte packs (rows kernel)
  int tiles_per_request;      // > 0: direct CTA -> request map; 0: binary search over cu_seqlens_q
  int64_t num_tiles;          // grid.x
  int num_splits;             // grid.z
  int keys_per_split;
  int64_t workspace_floats;   // 0 when num_splits == 1
};

// ---------------------------------------------------------------------------------------------
// Host side: the plan, from host integers only.

// Upper bound of PagedAttentionPlan::workspace_floats over every call on a device with num_sms
// SMs. Splitting happens only while a kernel has fewer than target = k*TargetCtasPerSm * num_sms
// CTAs,
// and each CTA covers rows_per_cta rows at most, so num_splits * num_tokens * num_q_heads <
// 2 * target * rows_per_cta.
inline int64_t paged_attention_max_workspace_floats(int64_t head_dim, int64_t num_sms) {
  const int64_t rows_kernel = int64_t(kRowsTargetCtasPerSm) * kRowsPerCta;
  const int64_t mma_kernel = int64_t(kMmaTargetCtasPerSm) * kMmaRows;
  return 2 * (rows_kernel > mma_kernel ? rows_kernel : mma_kernel) * num_sms * (head_dim + 2);
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Picks the kernel, the CTA -> row-tile map and the key splits. tensor_cores_allowed: the dtype
// is 16-bit and query, caches and out are 16-byte aligned.
inline PagedAttentionPlan make_paged_attention_plan(const PagedAttentionParams& p, int64_t head_dim,
                                                    int64_t max_query_len, int64_t max_seq_len,
                                                    bool tensor_cores_allowed, bool packed, int64_t num_sms) {
  PagedAttentionPlan plan{};
  plan.tensor_cores = tensor_cores_allowed && max_query_len > 1;
  plan.packed = packed;
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  const int64_t rows = plan.tensor_cores ? kMmaRows : kRowsPerCta;  // per CTA
  const int64_t q_bound = max_query_len < p.num_tokens ? max_query_len : p.num_tokens;
  const int64_t tiles_per_request = ceil_div(q_bound * group, rows);
  const int64_t search_tiles = ceil_div(int64_t(p.num_tokens) * group, rows) + p.batch;
  const bool direct = int64_t(p.batch) * tiles_per_request <= search_tiles;
  plan.tiles_per_request = direct ? int(tiles_per_request) : 0;
  const int64_t tiles = direct ? int64_t(p.batch) * tiles_per_request : search_tiles;
  plan.num_tiles = tiles;

  const int64_t ctas = tiles * p.num_kv_heads > 0 ? tiles * p.num_kv_heads : 1;
  const int64_t target = (plan.tensor_cores ? kMmaTargetCtasPerSm : kRowsTargetCtasPerSm) * num_sms;
  int64_t splits = 1;
  if (ctas < target && max_seq_len >= 2 * kMinKeysPerSplit) {
    splits = ceil_div(target, ctas);
    if (splits > max_seq_len / kMinKeysPerSplit) splits = max_seq_len / kMinKeysPerSplit;
  }
  if (splits > 1) {
    const int64_t keys = ceil_div(ceil_div(max_seq_len, splits), kSplitAlign) * kSplitAlign;
    plan.keys_per_split = int(keys);
    plan.num_splits = int(ceil_div(max_seq_len, keys));
  } else {
    plan.keys_per_split = INT32_MAX;  // one split holds every key
    plan.num_splits = 1;
  }
  plan.workspace_floats =
      plan.num_splits > 1 ? int64_t(plan.num_splits) * p.num_tokens * p.num_q_heads * (head_dim + 2) : 0;
  return plan;
}

// make_paged_attention_plan for the current device. Fails with cudaErrorInvalidValue when a
// size does not fit the kernels' 32-bit indexing or the grid.
inline cudaError_t plan_paged_attention(const PagedAttentionParams& p, int64_t head_dim, DType dtype,
                                        int64_t max_query_len, int64_t max_seq_len, PagedAttentionPlan* plan) {
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0 || p.batch <= 0) return cudaErrorInvalidValue;
  if (max_seq_len > INT32_MAX || int64_t(p.num_tokens) * p.num_q_heads > INT32_MAX / 2) return cudaErrorInvalidValue;
  if (p.num_kv_heads > 65535) return cudaErrorInvalidValue;
  int device = 0;
  int num_sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const int64_t elem_bytes = dtype == DType::kFloat32 ? 4 : 2;
  const bool caches_packed = pack_aligned(p.key_cache, head_dim, head_dim, elem_bytes) &&
                             pack_aligned(p.value_cache, head_dim, head_dim, elem_bytes);
  const bool out_packed = pack_aligned(p.out, head_dim, head_dim, elem_bytes);
  const bool query_packed = pack_aligned(p.query, p.q_stride, head_dim, elem_bytes);
  const bool packed = caches_packed && out_packed;
  *plan = make_paged_attention_plan(p, head_dim, max_query_len, max_seq_len,
                                    dtype != DType::kFloat32 && packed && query_packed, packed, num_sms);
  if (plan->num_tiles > INT32_MAX || plan->num_splits > 65535) return cudaErrorInvalidValue;
  return cudaSuccess;
}

// ---------------------------------------------------------------------------------------------
// Device helpers shared by both kernels.

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// The cache slot (block * block_size + offset) holding position `key` of a request.
__device__ __forceinline__ int64_t cache_slot(const int32_t* block_table,  // [max_blocks_per_seq]
                                              int key, int block_shift) {
  const int64_t block = block_table[key >> block_shift];
  return (block << block_shift) + (key & ((1 << block_shift) - 1));
}

// A raw score (scale already applied) -> the logit in base-2 units.
__device__ __forceinline__ float log2_logit(float x, float soft_cap) {
  if (soft_cap > 0.f) x = soft_cap * tanhf(x / soft_cap);
  return x * kLog2e;
}

// A range of key positions [lo, hi), empty when lo >= hi.
struct KeyRange {
  int lo;
  int hi;
};

// The keys of split blockIdx.z.
__device__ __forceinline__ KeyRange split_keys(int keys_per_split) {
  const int lo = int(blockIdx.z) * keys_per_split;
  return {lo, keys_per_split > INT32_MAX - lo ? INT32_MAX : lo + keys_per_split};
}

// The keys of `split` a query at position pos sees: causal, and within the sliding window.
__device__ __forceinline__ KeyRange visible_keys(int pos, int sliding_window, KeyRange split) {
  int lo = split.lo;
  if (sliding_window > 0 && pos - sliding_window + 1 > lo) lo = pos - sliding_window + 1;
  return {lo, pos + 1 < split.hi ? pos + 1 : split.hi};
}

// The rows [row_begin, row_end) of one request (and one kv head) that this CTA owns.
struct RowTile {
  int first_token;    // cu_seqlens_q[request]
  int context_start;  // position of the request's first query token
  int row_begin;
  int row_end;
  const int32_t* block_table;  // [max_blocks_per_seq]
};

// Maps blockIdx.x to a row tile (see the header comment). Returns false for a spare slot.
// Within a request the latest tiles (most keys) come first, so the longest CTAs start early.
template <int kRows>
__device__ __forceinline__ bool find_row_tile(const PagedAttentionParams& p, int group, int tiles_per_request,
                                              RowTile& tile) {
  const int cta = int(blockIdx.x);
  int request;
  int slot;
  if (tiles_per_request > 0) {
    request = cta / tiles_per_request;
    slot = cta - request * tiles_per_request;
  } else {
    auto first_slot = [&](int b) {
      return int((int64_t(p.cu_seqlens_q[b]) * group + kRows - 1) / kRows) + b;
    };
    int lo = 0;
    int hi = p.batch - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (first_slot(mid) <= cta) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    request = lo;
    slot = cta - first_slot(lo);
  }
  const int first_token = p.cu_seqlens_q[request];
  const int q_len = p.cu_seqlens_q[request + 1] - first_token;
  const int64_t rows = int64_t(q_len) * group;
  const int64_t tile_index = (rows + kRows - 1) / kRows - 1 - slot;
  if (tile_index < 0) return false;
  tile.first_token = first_token;
  tile.context_start = p.seq_lens[request] - q_len;
  tile.row_begin = int(tile_index * kRows);
  tile.row_end = int(rows < tile_index * kRows + kRows ? rows : tile_index * kRows + kRows);
  tile.block_table = p.block_tables + int64_t(request) * p.max_blocks_per_seq;
  return true;
}

// The keys any row of the tile sees in split blockIdx.z (positions grow with the row).
__device__ __forceinline__ KeyRange tile_keys(const PagedAttentionParams& p, const RowTile& tile, int group,
                                              int keys_per_split) {
  const KeyRange split = split_keys(keys_per_split);
  const int first_pos = tile.context_start + tile.row_begin / group;
  const int last_pos = tile.context_start + (tile.row_end - 1) / group;
  return {visible_keys(first_pos, p.sliding_window, split).lo, visible_keys(last_pos, p.sliding_window, split).hi};
}

// The keys row `row` of the tile sees in split blockIdx.z.
__device__ __forceinline__ KeyRange row_keys(const PagedAttentionParams& p, const RowTile& tile, int group, int row,
                                             int keys_per_split) {
  return visible_keys(tile.context_start + row / group, p.sliding_window, split_keys(keys_per_split));
}

// Where a row's result goes: out[token, head] directly, or its partial in split blockIdx.z.
__device__ __forceinline__ int64_t row_index(const PagedAttentionParams& p, const RowTile& tile, int group,
                                             int row) {
  const int token = tile.first_token + row / group;
  const int head = int(blockIdx.y) * group + row % group;
  return int64_t(token) * p.num_q_heads + head;
}

__device__ __forceinline__ float* partial_row(const PagedAttentionParams& p, int64_t index, int head_dim) {
  return p.workspace + (int64_t(blockIdx.z) * p.num_tokens * p.num_q_heads + index) * (head_dim + 2);
}

// kN consecutive elements, moved with one kN * sizeof(T)-byte load or store (Pack<T> is the
// 16-byte case).
template <typename T, int kN>
struct alignas(kN * sizeof(T)) Vec {
  T v[kN];
};

// src[0, kN) as float32: one vector load when packed (src aligned to the vector), else kN loads.
template <typename T, int kN>
__device__ __forceinline__ void load_floats(const T* src, bool packed, float (&dst)[kN]) {
  if (packed) {
    const Vec<T, kN> vec = *reinterpret_cast<const Vec<T, kN>*>(src);
#pragma unroll
    for (int e = 0; e < kN; ++e) dst[e] = load_float(vec.v[e]);
  } else {
#pragma unroll
    for (int e = 0; e < kN; ++e) dst[e] = load_float(src[e]);
  }
}

// dst[0, kN) = src * scale, rounded to T.
template <typename T, int kN>
__device__ __forceinline__ void store_floats(T* dst, bool packed, const float (&src)[kN], float scale) {
  if (packed) {
    Vec<T, kN> vec;
#pragma unroll
    for (int e = 0; e < kN; ++e) vec.v[e] = store_float<T>(src[e] * scale);
    *reinterpret_cast<Vec<T, kN>*>(dst) = vec;
  } else {
#pragma unroll
    for (int e = 0; e < kN; ++e) dst[e] = store_float<T>(src[e] * scale);
  }
}

// ---------------------------------------------------------------------------------------------
// Rows kernel (CUDA cores).

template <typename T, int HD>
__global__ void __launch_bounds__(kRowsThreads, kRowsMinCtasPerSm)
    paged_attention_rows_kernel(const PagedAttentionParams p, int tiles_per_request, int keys_per_split,
                                bool packed) {
  constexpr int N = Pack<T>::kSize;                          // phase 1: elements per 16-byte K load
  constexpr int kPacks = HD / N;                             // packs per K row
  // Head dim 80 in 16 bits is 10 packs: the last pass over them leaves two of a key's lanes idle.
  constexpr int kPacksPerScoreLane = (kPacks + kScoreLanes - 1) / kScoreLanes;
  constexpr int kScoreKeysPerPass = kRowsWarps * 32 / kScoreLanes;
  constexpr int kScorePasses = kKeyChunk / kScoreKeysPerPass;
  // Phase 3: a lane owns kV dims of every row (kRowsPerCta * kV accumulators in registers, the
  // same for every dtype), a warp HD / kRowsWarps dims, kValueLanes lanes per V row slice and
  // kValueKeys slices (keys) per warp step. Where kValueLanes does not divide 32 (head_dim 80:
  // 5 lanes, 96: 6), the warp's last 32 % kValueLanes lanes idle in phase 3.
  constexpr int kV = 4;
  constexpr int kValueLanes = HD / kV / kRowsWarps;
  constexpr int kValueKeys = 32 / kValueLanes;               // keys per warp step
  constexpr int kValueSteps = (kKeyChunk + kValueKeys - 1) / kValueKeys;
  static_assert(HD % (kV * kRowsWarps) == 0 && kPacks * N == HD, "head_dim must split over the warps' lanes");
  static_assert(kValueLanes <= 32, "a warp must cover whole slices of V rows");
  static_assert(kKeyChunk % kScoreKeysPerPass == 0 && kKeyChunk == 64, "phase 2 reads two scores per lane");

  __shared__ __align__(16) float q_s[kRowsPerCta][HD];  // scaled query rows
  __shared__ float score_s[kRowsPerCta][kKeyChunk];     // logits, then probabilities
  __shared__ float m_s[kRowsPerCta];                    // running max (base-2 units)
  __shared__ float l_s[kRowsPerCta];                    // running sum
  __shared__ float corr_s[kRowsPerCta];                 // this chunk's rescale of acc
  __shared__ int lo_s[kRowsPerCta];                     // visible keys of each row: [lo, hi)
  __shared__ int hi_s[kRowsPerCta];

  const int group = p.num_q_heads / p.num_kv_heads;
  RowTile tile;
  if (!find_row_tile<kRowsPerCta>(p, group, tiles_per_request, tile)) return;
  const int n_rows = tile.row_end - tile.row_begin;
  const int tid = int(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int64_t kv_stride = int64_t(p.num_kv_heads) * HD;  // between consecutive cache slots
  const T* k_base = static_cast<const T*>(p.key_cache) + int64_t(blockIdx.y) * HD;
  const T* v_base = static_cast<const T*>(p.value_cache) + int64_t(blockIdx.y) * HD;

  if (tid < n_rows) {
    const KeyRange keys = row_keys(p, tile, group, tile.row_begin + tid, keys_per_split);
    lo_s[tid] = keys.lo;
    hi_s[tid] = keys.hi;
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.f;
  }
  for (int i = tid; i < n_rows * HD; i += kRowsThreads) {
    const int r = i / HD;
    const int d = i - r * HD;
    const int row = tile.row_begin + r;
    const int token = tile.first_token + row / group;
    const int head = int(blockIdx.y) * group + row % group;
    const T* q = static_cast<const T*>(p.query) + int64_t(token) * p.q_stride + int64_t(head) * HD;
    q_s[r][d] = load_float(q[d]) * p.scale;
  }
  __syncthreads();

  // Phase 3 layout: this lane accumulates dims [value_dim, value_dim + kV) of every row over
  // the chunk keys j = step * kValueKeys + value_key.
  const int value_dim = (warp * kValueLanes + lane % kValueLanes) * kV;
  const int value_key = lane / kValueLanes;
  float acc[kRowsPerCta][kV];
#pragma unroll
  for (int r = 0; r < kRowsPerCta; ++r) {
#pragma unroll
    for (int e = 0; e < kV; ++e) acc[r][e] = 0.f;
  }

  const KeyRange keys = tile_keys(p, tile, group, keys_per_split);
  for (int c0 = keys.lo; c0 < keys.hi; c0 += kKeyChunk) {
    const int c_hi = c0 + kKeyChunk < keys.hi ? c0 + kKeyChunk : keys.hi;

    // Phase 1: score_s[r][j] = logit(q_r . k_{c0 + j}), -inf where row r does not see the key.
    // Lanes of a key group read interleaved packs, so the group reads 64 contiguous bytes at a
    // time and its q_s reads fall in distinct banks. Keys past c_hi re-read key c0 (valid
    // memory) and are masked.
    const int sub = lane % kScoreLanes;
    int js[kScorePasses];
    const T* krow[kScorePasses];
    float dot[kScorePasses][kRowsPerCta];
#pragma unroll
    for (int k = 0; k < kScorePasses; ++k) {
      js[k] = k * kScoreKeysPerPass + warp * (32 / kScoreLanes) + lane / kScoreLanes;
      const int key = c0 + js[k] < c_hi ? c0 + js[k] : c0;
      krow[k] = k_base + cache_slot(tile.block_table, key, p.block_shift) * kv_stride;
#pragma unroll
      for (int r = 0; r < kRowsPerCta; ++r) dot[k][r] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < kPacksPerScoreLane; ++i) {
      if (kPacks % kScoreLanes != 0 && i * kScoreLanes + sub >= kPacks) break;
      const int d = (i * kScoreLanes + sub) * N;
      float kf[kScorePasses][N];
#pragma unroll
      for (int k = 0; k < kScorePasses; ++k) load_floats<T, N>(krow[k] + d, packed, kf[k]);
#pragma unroll
      for (int r = 0; r < kRowsPerCta; ++r) {
        if (r < n_rows) {
#pragma unroll
          for (int e = 0; e < N; e += 4) {
            const float4 q4 = *reinterpret_cast<const float4*>(&q_s[r][d + e]);
#pragma unroll
            for (int k = 0; k < kScorePasses; ++k) {
              dot[k][r] += q4.x * kf[k][e] + q4.y * kf[k][e + 1] + q4.z * kf[k][e + 2] + q4.w * kf[k][e + 3];
            }
          }
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kScorePasses; ++k) {
#pragma unroll
      for (int r = 0; r < kRowsPerCta; ++r) {
        if (r < n_rows) {
          float s = dot[k][r];
#pragma unroll
          for (int offset = 1; offset < kScoreLanes; offset <<= 1) s += __shfl_xor_sync(0xffffffffu, s, offset);
          if (r % kScoreLanes == sub) {
            const int key = c0 + js[k];
            score_s[r][js[k]] =
                key >= lo_s[r] && key < hi_s[r] ? log2_logit(s, p.soft_cap) : -INFINITY;
          }
        }
      }
    }
    __syncthreads();

    // Phase 2: one warp per row: chunk max, new running max, probabilities, running sum.
    for (int r = warp; r < n_rows; r += kRowsWarps) {
      const float s0 = score_s[r][lane];
      const float s1 = score_s[r][lane + 32];
      const float m_old = m_s[r];
      const float m_new = fmaxf(m_old, warp_max(fmaxf(s0, s1)));
      const float m_ref = m_new == -INFINITY ? 0.f : m_new;  // no key seen yet: every p is 0
      const float p0 = exp2f(s0 - m_ref);
      const float p1 = exp2f(s1 - m_ref);
      score_s[r][lane] = p0;
      score_s[r][lane + 32] = p1;
      const float sum = warp_sum(p0 + p1);
      if (lane == 0) {
        const float corr = exp2f(m_old - m_ref);
        m_s[r] = m_new;
        l_s[r] = l_s[r] * corr + sum;
        corr_s[r] = corr;
      }
    }
    __syncthreads();

    // Phase 3: acc = acc * corr + P . V over the chunk. Keys past c_hi have p = 0; they re-read
    // key c0 so that every load is of valid memory.
#pragma unroll
    for (int r = 0; r < kRowsPerCta; ++r) {
      if (r < n_rows) {
        const float corr = corr_s[r];
#pragma unroll
        for (int e = 0; e < kV; ++e) acc[r][e] *= corr;
      }
    }
#pragma unroll 4
    for (int step = 0; step < kValueSteps; ++step) {
      const int j = step * kValueKeys + value_key;
      if (32 % kValueLanes != 0 && (value_key >= kValueKeys || j >= kKeyChunk)) break;
      const int key = c0 + j < c_hi ? c0 + j : c0;
      const T* vrow = v_base + cache_slot(tile.block_table, key, p.block_shift) * kv_stride;
      float vf[kV];
      load_floats<T, kV>(vrow + value_dim, packed, vf);
#pragma unroll
      for (int r = 0; r < kRowsPerCta; ++r) {
        if (r < n_rows) {
          const float pr = score_s[r][j];
#pragma unroll
          for (int e = 0; e < kV; ++e) acc[r][e] += pr * vf[e];
        }
      }
    }
    __syncthreads();  // score_s and corr_s are rewritten by the next chunk
  }

  // Lanes with the same value_dim hold partial sums over different keys: add them up.
#pragma unroll
  for (int r = 0; r < kRowsPerCta; ++r) {
    if (r < n_rows) {
      if constexpr (32 % kValueLanes == 0) {
#pragma unroll
        for (int offset = kValueLanes; offset < 32; offset <<= 1) {
#pragma unroll
          for (int e = 0; e < kV; ++e) acc[r][e] += __shfl_xor_sync(0xffffffffu, acc[r][e], offset);
        }
      } else {
        // A tree over the kValueKeys slices, not a power of two: slice k takes slice k + s when
        // k is a multiple of 2s and k + s exists; slice 0 ends with the sum (idle lanes,
        // value_key == kValueKeys, are never taken).
#pragma unroll
        for (int s = 1; s < kValueKeys; s <<= 1) {
          const bool take = value_key % (2 * s) == 0 && value_key + s < kValueKeys;
#pragma unroll
          for (int e = 0; e < kV; ++e) {
            const float other = __shfl_down_sync(0xffffffffu, acc[r][e], s * kValueLanes);
            if (take) acc[r][e] += other;
          }
        }
      }
    }
  }
  if (value_key != 0) return;
  const bool split = gridDim.z > 1;
#pragma unroll
  for (int r = 0; r < kRowsPerCta; ++r) {
    if (r < n_rows) {
      const int64_t index = row_index(p, tile, group, tile.row_begin + r);
      if (split) {
        float* w = partial_row(p, index, HD);
        if (value_dim == 0) {
          w[0] = m_s[r];
          w[1] = l_s[r];
        }
#pragma unroll
        for (int e = 0; e < kV; e += 2) {
          *reinterpret_cast<float2*>(w + 2 + value_dim + e) = make_float2(acc[r][e], acc[r][e + 1]);
        }
      } else {
        const float inv = l_s[r] > 0.f ? 1.f / l_s[r] : 0.f;
        store_floats<T, kV>(static_cast<T*>(p.out) + index * HD + value_dim, packed, acc[r], inv);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core kernel (float16 / bfloat16, sm_80+).

template <int HD>
constexpr int mma_keys_per_tile() {
  return HD <= 128 ? 64 : 32;  // keeps S (keys / 2 floats per thread) beside O (HD / 2) in registers
}

// Shared-memory rows are padded by 16 bytes so that the 8 rows one ldmatrix phase reads start in
// 8 different 4-bank groups.
template <int HD>
constexpr int mma_pitch() {
  return HD + 8;
}

template <typename T, int HD>
constexpr size_t mma_smem_bytes() {
  return size_t(kMmaRows + 2 * mma_keys_per_tile<HD>()) * mma_pitch<HD>() * sizeof(T);
}

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(void* dst_smem, const void* src_global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_address(dst_smem)), "l"(src_global)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, and register i of
// lane t receives elements (t / 4, 2 (t % 4) .. +1) of matrix i (of its transpose with .trans).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem_row))
               : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem_row))
               : "memory");
}

// c[16x8] += a[16x16] . b[16x8], float32 accumulators. Lane t (g = t / 4, q = t % 4) holds
// a = {(g, 2q..), (g + 8, 2q..), (g, 2q + 8..), (g + 8, 2q + 8..)}, b = {(2q.., g), (2q + 8.., g)},
// c = {(g, 2q), (g, 2q + 1), (g + 8, 2q), (g + 8, 2q + 1)}.
template <typename T>
__device__ __forceinline__ void mma_16x8x16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, float16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<T, bfloat16>, "tensor cores take float16 or bfloat16");
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// (lo, hi) rounded to T, lo in the low 16 bits.
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  uint32_t bits;
  if constexpr (std::is_same_v<T, float16>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    memcpy(&bits, &h, sizeof(bits));
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    memcpy(&bits, &h, sizeof(bits));
  }
  return bits;
}

// Gathers keys [k0, k0 + kKeys) of one kv head from the paged cache into dst [kKeys][pitch] with
// cp.async; keys at or past k_hi are zero-filled (they may have no block).
template <typename T, int HD, int kKeys>
__device__ __forceinline__ void load_kv_tile(T* dst, const T* cache_head,  // cache + kv_head * HD
                                             int64_t kv_stride, const int32_t* block_table, int block_shift,
                                             int k0, int k_hi) {
  constexpr int kChunks = HD / 8;  // 16-byte chunks per row
  static_assert(kKeys * kChunks % kMmaThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int it = 0; it < kKeys * kChunks / kMmaThreads; ++it) {
    const int i = it * kMmaThreads + int(threadIdx.x);
    const int j = i / kChunks;
    const int c = i % kChunks;
    T* d = dst + j * mma_pitch<HD>() + c * 8;
    const int key = k0 + j;
    if (key < k_hi) {
      cp_async_16(d, cache_head + cache_slot(block_table, key, block_shift) * kv_stride + c * 8);
    } else {
      *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
    }
  }
}

template <typename T, int HD>
__global__ void __launch_bounds__(kMmaThreads, kMmaMinCtasPerSm)
    paged_attention_mma_kernel(const PagedAttentionParams p, int tiles_per_request, int keys_per_split) {
  constexpr int kKeys = mma_keys_per_tile<HD>();
  constexpr int kPitch = mma_pitch<HD>();
  constexpr int kChunks = HD / 8;
  constexpr int kKeyTiles8 = kKeys / 8;  // S: n-tiles of 8 keys
  constexpr int kDimTiles8 = HD / 8;     // O: n-tiles of 8 head dims
  static_assert(kMmaRows == 4 * 16 && kMmaThreads == 128, "four warps of 16 rows");
  static_assert(HD % 16 == 0, "head_dim must be whole k16 steps of Q.K^T and pairs of O's n-tiles");

  extern __shared__ __align__(16) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem);  // [kMmaRows][kPitch]
  T* k_s = q_s + kMmaRows * kPitch;     // [kKeys][kPitch]
  T* v_s = k_s + kKeys * kPitch;        // [kKeys][kPitch]

  const int group = p.num_q_heads / p.num_kv_heads;
  RowTile tile;
  if (!find_row_tile<kMmaRows>(p, group, tiles_per_request, tile)) return;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int quad = lane & 3;
  const int64_t kv_stride = int64_t(p.num_kv_heads) * HD;
  const T* k_head = static_cast<const T*>(p.key_cache) + int64_t(blockIdx.y) * HD;
  const T* v_head = static_cast<const T*>(p.value_cache) + int64_t(blockIdx.y) * HD;

  // This lane's two rows of the tile: warp * 16 + lane / 4 (+ 8).
  bool valid[2];
  KeyRange row_range[2];
  int rows[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = tile.row_begin + warp * 16 + (lane >> 2) + 8 * h;
    valid[h] = row < tile.row_end;
    rows[h] = valid[h] ? row : tile.row_begin;
    row_range[h] = row_keys(p, tile, group, rows[h], keys_per_split);
  }

  float o[kDimTiles8][4];
#pragma unroll
  for (int t = 0; t < kDimTiles8; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_part[2] = {0.f, 0.f};  // this lane's share of the row sums; the quad adds them at the end

  const KeyRange keys = tile_keys(p, tile, group, keys_per_split);
  const int n_key_tiles = keys.hi > keys.lo ? (keys.hi - keys.lo + kKeys - 1) / kKeys : 0;
  if (n_key_tiles > 0) {
    static_assert(kMmaRows * kChunks % kMmaThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
    for (int it = 0; it < kMmaRows * kChunks / kMmaThreads; ++it) {
      const int i = it * kMmaThreads + int(threadIdx.x);
      const int m = i / kChunks;
      const int c = i % kChunks;
      T* d = q_s + m * kPitch + c * 8;
      const int row = tile.row_begin + m;
      if (row < tile.row_end) {
        const int token = tile.first_token + row / group;
        const int head = int(blockIdx.y) * group + row % group;
        cp_async_16(d, static_cast<const T*>(p.query) + int64_t(token) * p.q_stride + int64_t(head) * HD + c * 8);
      } else {
        *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
      }
    }
    load_kv_tile<T, HD, kKeys>(k_s, k_head, kv_stride, tile.block_table, p.block_shift, keys.lo, keys.hi);
    cp_async_commit();
  }

  for (int kt = 0; kt < n_key_tiles; ++kt) {
    const int k0 = keys.lo + kt * kKeys;
    load_kv_tile<T, HD, kKeys>(v_s, v_head, kv_stride, tile.block_table, p.block_shift, k0, keys.hi);
    cp_async_commit();
    cp_async_wait<1>();  // Q and this K tile have landed; V may still be in flight
    __syncthreads();

    // S = Q . K^T for this warp's 16 rows.
    float s[kKeyTiles8][4];
#pragma unroll
    for (int t = 0; t < kKeyTiles8; ++t) s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
#pragma unroll
    for (int kd = 0; kd < HD / 16; ++kd) {
      uint32_t a[4];
      ldmatrix_x4(a, q_s + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kPitch + kd * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int np = 0; np < kKeys / 16; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, k_s + (np * 16 + (lane & 7) + (lane >> 4) * 8) * kPitch + kd * 16 + ((lane >> 3) & 1) * 8);
        mma_16x8x16<T>(s[2 * np], a, b[0], b[1]);
        mma_16x8x16<T>(s[2 * np + 1], a, b[2], b[3]);
      }
    }

    // Online softmax of both rows; S becomes P (unnormalised, relative to the running max).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int t = 0; t < kKeyTiles8; ++t) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = k0 + t * 8 + 2 * quad + e;
          float& x = s[t][2 * h + e];
          x = key >= row_range[h].lo && key < row_range[h].hi ? log2_logit(x * p.scale, p.soft_cap) : -INFINITY;
          tile_max = fmaxf(tile_max, x);
        }
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float m_new = fmaxf(m_run[h], tile_max);
      const float m_ref = m_new == -INFINITY ? 0.f : m_new;
      const float corr = exp2f(m_run[h] - m_ref);
      m_run[h] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int t = 0; t < kKeyTiles8; ++t) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[t][2 * h + e];
          x = exp2f(x - m_ref);
          sum += x;
        }
      }
      l_part[h] = l_part[h] * corr + sum;
#pragma unroll
      for (int t = 0; t < kDimTiles8; ++t) {
        o[t][2 * h] *= corr;
        o[t][2 * h + 1] *= corr;
      }
    }

    __syncthreads();  // every warp is done with k_s
    if (kt + 1 < n_key_tiles) {
      load_kv_tile<T, HD, kKeys>(k_s, k_head, kv_stride, tile.block_table, p.block_shift, k0 + kKeys, keys.hi);
      cp_async_commit();
      cp_async_wait<1>();  // this V tile has landed; the next K tile may still be in flight
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    // O += P . V: the S accumulators of two 8-key n-tiles are the A operand of one k16 step.
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const uint32_t a[4] = {pack_pair<T>(s[2 * kk][0], s[2 * kk][1]), pack_pair<T>(s[2 * kk][2], s[2 * kk][3]),
                             pack_pair<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack_pair<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < HD / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_s + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kPitch + dp * 16 + (lane >> 4) * 8);
        mma_16x8x16<T>(o[2 * dp], a, b[0], b[1]);
        mma_16x8x16<T>(o[2 * dp + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with v_s before the next tile overwrites it
  }

  const bool split = gridDim.z > 1;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_part[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (!valid[h]) continue;
    const int64_t index = row_index(p, tile, group, rows[h]);
    if (split) {
      float* w = partial_row(p, index, HD);
      if (quad == 0) {
        w[0] = m_run[h];
        w[1] = l;
      }
#pragma unroll
      for (int t = 0; t < kDimTiles8; ++t) {
        *reinterpret_cast<float2*>(w + 2 + t * 8 + 2 * quad) = make_float2(o[t][2 * h], o[t][2 * h + 1]);
      }
    } else {
      const float inv = l > 0.f ? 1.f / l : 0.f;
      T* dst = static_cast<T*>(p.out) + index * HD;
#pragma unroll
      for (int t = 0; t < kDimTiles8; ++t) {
        *reinterpret_cast<uint32_t*>(dst + t * 8 + 2 * quad) = pack_pair<T>(o[t][2 * h] * inv, o[t][2 * h + 1] * inv);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Merge of the key splits: one warp per (token, head) row.

template <typename T, int HD>
__global__ void __launch_bounds__(kMergeThreads)
    merge_splits_kernel(T* out,                // [num_tokens * num_q_heads, HD]
                        const float* partials,  // [num_splits, num_tokens * num_q_heads, HD + 2]
                        int num_splits, int64_t num_rows) {
  // Lane owns dims lane + 32 i; for head_dim 80, lanes 16..31 own one fewer.
  constexpr int kPerLane = (HD + 31) / 32;
  const int64_t row = int64_t(blockIdx.x) * (kMergeThreads / 32) + (threadIdx.x >> 5);
  if (row >= num_rows) return;
  const int lane = threadIdx.x & 31;
  auto partial = [&](int split) { return partials + (int64_t(split) * num_rows + row) * (HD + 2); };
  float m = -INFINITY;
  for (int split = lane; split < num_splits; split += 32) {
    const float* w = partial(split);
    if (w[1] > 0.f) m = fmaxf(m, w[0]);
  }
  m = warp_max(m);
  float l = 0.f;
  float acc[kPerLane] = {};
  for (int split = 0; split < num_splits; ++split) {
    const float* w = partial(split);
    if (!(w[1] > 0.f)) continue;  // the split saw no key of this row
    const float weight = exp2f(w[0] - m);
    l += w[1] * weight;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (HD % 32 == 0 || lane + 32 * i < HD) acc[i] += weight * w[2 + lane + 32 * i];
    }
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  T* o = out + row * HD;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    if (HD % 32 == 0 || lane + 32 * i < HD) o[lane + 32 * i] = store_float<T>(acc[i] * inv);
  }
}

// ---------------------------------------------------------------------------------------------
// Launch. HD is 64, 80, 96, 128 or 256; T is float, float16 or bfloat16 (tensor cores for the
// 16-bit types only). p.workspace must hold plan.workspace_floats floats, 8-byte aligned.

template <typename T, int HD>
cudaError_t paged_attention(const PagedAttentionParams& p, const PagedAttentionPlan& plan, cudaStream_t stream) {
  static_assert(HD == 64 || HD == 80 || HD == 96 || HD == 128 || HD == 256, "head_dim 64, 80, 96, 128 or 256");
  if (p.num_tokens == 0) return cudaSuccess;
  if (plan.num_splits > 1 && p.workspace == nullptr) return cudaErrorInvalidValue;
  const dim3 grid(unsigned(plan.num_tiles), unsigned(p.num_kv_heads), unsigned(plan.num_splits));
  if (plan.tensor_cores) {
    if constexpr (std::is_same_v<T, float>) {
      return cudaErrorInvalidValue;  // the plan never asks for it
    } else {
      constexpr size_t smem = mma_smem_bytes<T, HD>();
      auto kernel = paged_attention_mma_kernel<T, HD>;
      if constexpr (smem > 48 * 1024) {
        const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
        if (err != cudaSuccess) return err;
      }
      kernel<<<grid, kMmaThreads, smem, stream>>>(p, plan.tiles_per_request, plan.keys_per_split);
    }
  } else {
    paged_attention_rows_kernel<T, HD>
        <<<grid, kRowsThreads, 0, stream>>>(p, plan.tiles_per_request, plan.keys_per_split, plan.packed);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || plan.num_splits == 1) return err;
  const int64_t rows = int64_t(p.num_tokens) * p.num_q_heads;
  const int64_t ctas = ceil_div(rows, kMergeThreads / 32);
  merge_splits_kernel<T, HD><<<unsigned(ctas), kMergeThreads, 0, stream>>>(static_cast<T*>(p.out), p.workspace,
                                                                             plan.num_splits, rows);
  return cudaGetLastError();
}

}  // namespace kvflow::cuda_kernels
