// Sampling on the GPU: per row of logits, the kept set of tokens (greedy; else top-k, top-p,
// min-p) and one Philox draw over it in token-index order; the same kept set written back as
// logits (apply_sampling_filters); repetition, frequency and presence penalties; log-probabilities
// with the top alternatives. Torch-free.
//
// One thread block per row, and nothing is sorted. Tokens are ranked by an order key, the logit's
// bits mapped so that unsigned comparison follows float comparison; equal keys rank by lower index.
// Top-k and top-p are both "the shortest prefix of that order whose count (k) or probability mass
// (top_p * Z) reaches a target", found by radix select: up to four passes over the row, each a
// 256-bin histogram (count and mass) of the candidates that share the key bits chosen so far, after
// which one warp picks the bin where the running total from the top reaches the target. When the
// target falls inside a run of equal keys, one more pass finds the index where to cut it. The kept
// set is then that prefix of the order (an OrderCut) with min-p tested token by token, and the draw
// walks it in index order: a pass of per-warp segment totals, then one warp scans the segment that
// holds the target. Probabilities are float32, running sums double.
//
// Nothing here reads parameters on the host: invalid values (negative temperature, NaN logits) are
// the CPU path's to reject. Here they give some in-range token, never a fault: a temperature that is
// not > 0 means greedy, NaN logits are never kept, a row with nothing kept draws its argmax.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kvflow/cuda_utils.cuh"
#include "kvflow/numeric.h"
#include "kvflow/philox.h"

namespace kvflow::cuda_kernels {

// 1024 threads give a 262144-token row 256 tokens per thread and per pass.
constexpr int kSamplingMaxThreads = 1024;
constexpr int kPenaltyThreads = 256;
constexpr int kMaxTopLogprobs = 20;
constexpr unsigned kWarpMask = 0xffffffffu;
constexpr int64_t kAllTies = INT64_MAX;
constexpr int kDrawItems = 4;  // consecutive tokens per lane in one step of the draw's scan
constexpr float kNegInf = -__builtin_huge_valf();

// The logit's bits as an unsigned key with the same order; -0 is +0, so equal logits have equal keys.
__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t u = x == 0.f ? 0u : __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_logit(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// A prefix of the order (logit descending, index ascending): every token with a key above `key`,
// and those with `key` itself up to index `last` (kAllTies: all of them).
struct OrderCut {
  uint32_t key;
  int64_t last;
};

__device__ __forceinline__ bool in_cut(const OrderCut& cut, uint32_t key, int64_t i) {
  return key > cut.key || (key == cut.key && i <= cut.last);
}

// The shorter of two prefixes (their intersection).
__device__ __forceinline__ OrderCut tighter(const OrderCut& a, const OrderCut& b) {
  if (a.key != b.key) return a.key > b.key ? a : b;
  return {a.key, a.last < b.last ? a.last : b.last};
}

// p = exp((x - max) / T), 1 for the max itself (also when the max is infinite).
__device__ __forceinline__ float token_weight(float x, float max, float temperature) {
  return x == max ? 1.f : expf((x - max) / temperature);
}

struct SamplingShared {
  uint32_t hist_count[256];
  double hist_mass[256];
  double staging[kSamplingMaxThreads];  // one value per thread, for warp-aggregated histogram adds
  double warp_total[32];
  int64_t warp_index[32];
  float warp_value[32];
  uint32_t warp_count[32];
  // Written by one thread, read by all after a barrier.
  float max;
  int64_t argmax;
  uint32_t prefix;
  int state;
  uint32_t n;
  int sel_warp;
  double carry;
  double target;
  double sum;
  int64_t result;
  int slots;
  uint32_t top_key[kMaxTopLogprobs];
  int64_t top_index[kMaxTopLogprobs];
};

__device__ __forceinline__ bool ranks_before(float v, int64_t i, float best_v, int64_t best_i) {
  return v > best_v || (v == best_v && i < best_i);
}

// The row's max logit and its lowest index. Every thread of the block calls it.
template <typename T>
__device__ void row_argmax(const T* x, int64_t vocab, SamplingShared& sh, float* max, int64_t* argmax) {
  float bv = kNegInf;
  int64_t bi = kAllTies;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float v = load_float(x[i]);
    if (ranks_before(v, i, bv, bi)) {
      bv = v;
      bi = i;
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float ov = __shfl_xor_sync(kWarpMask, bv, offset);
    const int64_t oi = __shfl_xor_sync(kWarpMask, bi, offset);
    if (ranks_before(ov, oi, bv, bi)) {
      bv = ov;
      bi = oi;
    }
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) {
    sh.warp_value[threadIdx.x >> 5] = bv;
    sh.warp_index[threadIdx.x >> 5] = bi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < int(blockDim.x >> 5); ++w) {
      if (ranks_before(sh.warp_value[w], sh.warp_index[w], bv, bi)) {
        bv = sh.warp_value[w];
        bi = sh.warp_index[w];
      }
    }
    sh.max = bv;
    sh.argmax = bi < vocab ? bi : 0;  // all NaN: some index
  }
  __syncthreads();
  *max = sh.max;
  *argmax = sh.argmax;
}

// The block's sum of v, in double, the same on every thread.
__device__ __forceinline__ double block_sum_double(double v, SamplingShared& sh) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kWarpMask, v, offset);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.warp_total[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    double sum = 0.0;
    for (int w = 0; w < int(blockDim.x >> 5); ++w) sum += sh.warp_total[w];
    sh.sum = sum;
  }
  __syncthreads();
  return sh.sum;
}

__device__ __forceinline__ double warp_inclusive_scan(double v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const double t = __shfl_up_sync(kWarpMask, v, d);
    if (lane >= d) v += t;
  }
  return v;
}

// Each warp owns one contiguous segment of the row, a multiple of `granule` long.
__device__ __forceinline__ void warp_segment(int64_t vocab, int64_t granule, int64_t* begin, int64_t* end) {
  const int64_t warps = blockDim.x >> 5;
  const int64_t seg = ((vocab + warps - 1) / warps + granule - 1) / granule * granule;
  const int64_t b = int64_t(threadIdx.x >> 5) * seg;
  *begin = b < vocab ? b : vocab;
  *end = b + seg < vocab ? b + seg : vocab;
}

// The index of the n-th token (from 1, in index order) that satisfies pred; kAllTies if there are
// fewer. Per-warp counts of the segments, then the warp whose segment holds it finds it.
template <class Pred>
__device__ int64_t nth_in_index_order(int64_t vocab, uint32_t n, Pred pred, SamplingShared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int64_t begin, end;
  warp_segment(vocab, 32, &begin, &end);
  uint32_t count = 0;
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t i = base + lane;
    count += __popc(__ballot_sync(kWarpMask, i < end && pred(i)));
  }
  __syncthreads();
  if (lane == 0) sh.warp_count[warp] = count;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t before = 0;
    int sel = -1;
    for (int w = 0; w < int(blockDim.x >> 5); ++w) {
      if (before + sh.warp_count[w] >= n) {
        sel = w;
        break;
      }
      before += sh.warp_count[w];
    }
    sh.sel_warp = sel;
    sh.n = n - before;
    sh.result = kAllTies;
  }
  __syncthreads();
  if (warp == sh.sel_warp) {
    uint32_t rest = sh.n;
    for (int64_t base = begin; base < end; base += 32) {
      const int64_t i = base + lane;
      unsigned bits = __ballot_sync(kWarpMask, i < end && pred(i));
      const uint32_t c = __popc(bits);
      if (c >= rest) {
        for (uint32_t k = 1; k < rest; ++k) bits &= bits - 1;
        if (lane == 0) sh.result = base + __ffs(bits) - 1;
        break;
      }
      rest -= c;
    }
  }
  __syncthreads();
  return sh.result;
}

// Of cnt tokens of equal weight p after `above`, how many reach `target` (at least 1, at most cnt).
__device__ __forceinline__ uint32_t ties_needed(double above, double target, double p, uint32_t cnt) {
  if (!(p > 0.0)) return cnt;
  const double r = (target - above) / p;
  uint32_t m = !(r > 1.0) ? 1u : (r >= double(cnt) ? cnt : uint32_t(ceil(r)));
  for (int step = 0; step < 4 && m > 1 && above + double(m - 1) * p >= target; ++step) --m;
  for (int step = 0; step < 4 && m < cnt && above + double(m) * p < target; ++step) ++m;
  return m;
}

// Warp 0, after a histogram pass: the bin where the running total from the top (bin 255) first
// reaches `target`; if rounding leaves the total short of it, the lowest non-empty bin. Lane l
// holds bins 8l..8l+7. Writes prefix | bin << shift and what comes next (state: 0 another pass,
// 1 every tie at this key is kept, 2 cut the ties after the n-th) to sh. `above` (the total above
// the bins of this pass) and `target` live in warp 0's registers across passes.
template <bool kMass, class Weight>
__device__ void pick_bin(int shift, uint32_t prefix, float top_p, Weight weight, double& above, double& target,
                         SamplingShared& sh) {
  const int lane = threadIdx.x;
  double v[8];
  uint32_t c[8];
  double group = 0.0;
#pragma unroll
  for (int j = 7; j >= 0; --j) {
    c[j] = sh.hist_count[8 * lane + j];
    v[j] = kMass ? sh.hist_mass[8 * lane + j] : double(c[j]);
    group += v[j];
  }
  double incl = group;  // sum over lanes >= lane
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const double t = __shfl_down_sync(kWarpMask, incl, d);
    if (lane + d < 32) incl += t;
  }
  if (kMass && shift == 24) target = double(top_p) * __shfl_sync(kWarpMask, incl, 0);  // top_p * Z
  double excl = __shfl_down_sync(kWarpMask, incl, 1);
  if (lane == 31) excl = 0.0;
  double run = above + excl;
  int hit = -1, low = -1;
  double hit_above = 0.0, low_above = 0.0;
#pragma unroll
  for (int j = 7; j >= 0; --j) {
    if (c[j] == 0) continue;
    if (hit < 0 && run + v[j] >= target) {
      hit = j;
      hit_above = run;
    }
    low = j;
    low_above = run;
    run += v[j];
  }
  const unsigned hits = __ballot_sync(kWarpMask, hit >= 0);
  const unsigned nonempty = __ballot_sync(kWarpMask, low >= 0);
  if (nonempty == 0) {  // no candidate left: cannot happen, end the search
    if (lane == 0) {
      sh.prefix = prefix;
      sh.state = 1;
      sh.n = 0;
    }
    return;
  }
  const int src = hits ? 31 - __clz(hits) : __ffs(nonempty) - 1;
  const int j = __shfl_sync(kWarpMask, hits ? hit : low, src);
  above = __shfl_sync(kWarpMask, hits ? hit_above : low_above, src);
  const int bin = 8 * src + j;
  const uint32_t key = prefix | (uint32_t(bin) << shift);
  const uint32_t count = sh.hist_count[bin];
  int state = 0;
  uint32_t n = 0;
  if constexpr (kMass) {
    if (count == 1) {
      state = 1;
    } else if (shift == 0) {
      n = ties_needed(above, target, weight(key_logit(key)), count);
      state = n == count ? 1 : 2;
    }
  } else {
    if (above + double(count) == target) {
      state = 1;
    } else if (shift == 0) {
      n = uint32_t(target - above);
      state = 2;
    }
  }
  if (lane == 0) {
    sh.prefix = key;
    sh.state = state;
    sh.n = n;
  }
}

// The shortest prefix of the order, within `within`, whose token count reaches count_target
// (kMass false) or whose mass sum of weight(logit) reaches top_p * (mass of within) (kMass true).
template <bool kMass, typename T, class Weight>
__device__ OrderCut select_prefix(const T* x, int64_t vocab, const OrderCut& within, double count_target,
                                  float top_p, Weight weight, SamplingShared& sh) {
  const int lane = threadIdx.x & 31;
  uint32_t prefix = 0, prefix_mask = 0, n = 0;
  int state = 0;
  double above = 0.0, target = count_target;
  for (int shift = 24; shift >= 0; shift -= 8) {
    __syncthreads();
    for (int b = threadIdx.x; b < 256; b += blockDim.x) {
      sh.hist_count[b] = 0;
      sh.hist_mass[b] = 0.0;
    }
    __syncthreads();
    for (int64_t base = 0; base < vocab; base += blockDim.x) {
      const int64_t i = base + threadIdx.x;
      bool candidate = false;
      uint32_t bin = 0xffffffffu;
      double w = 0.0;
      if (i < vocab) {
        const float v = load_float(x[i]);
        const uint32_t key = order_key(v);
        if ((key & prefix_mask) == prefix && in_cut(within, key, i)) {
          candidate = true;
          bin = (key >> shift) & 0xffu;
          if constexpr (kMass) w = weight(v);
        }
      }
      if (__ballot_sync(kWarpMask, candidate) == 0) continue;
      // Lanes with the same bin add once, through their lowest lane: logits crowd into few bins.
      const unsigned peers = __match_any_sync(kWarpMask, bin);
      const bool leader = candidate && __ffs(peers) - 1 == lane;
      if constexpr (kMass) {
        sh.staging[threadIdx.x] = w;
        __syncwarp();
        if (leader) {
          double sum = 0.0;
          for (unsigned m = peers; m != 0; m &= m - 1) sum += sh.staging[(threadIdx.x & ~31u) + __ffs(m) - 1];
          atomicAdd(&sh.hist_mass[bin], sum);
        }
        __syncwarp();
      }
      if (leader) atomicAdd(&sh.hist_count[bin], uint32_t(__popc(peers)));
    }
    __syncthreads();
    if (threadIdx.x < 32) pick_bin<kMass>(shift, prefix, top_p, weight, above, target, sh);
    __syncthreads();
    prefix = sh.prefix;
    state = sh.state;
    n = sh.n;
    prefix_mask |= 0xffu << shift;
    if (state != 0) break;
  }
  OrderCut found{prefix, kAllTies};
  if (state == 2) {
    found.last = nth_in_index_order(
        vocab, n,
        [&](int64_t i) {
          const uint32_t key = order_key(load_float(x[i]));
          return key == prefix && in_cut(within, key, i);
        },
        sh);
  }
  return tighter(within, found);
}

// The first kept token, in index order, whose running weight exceeds u * (total kept weight); the
// last kept token if rounding leaves none; -1 if nothing is kept. kept(i, &w) says whether token i
// is kept and its weight.
template <class Kept>
__device__ int64_t draw_in_index_order(int64_t vocab, double u, Kept kept, SamplingShared& sh) {
  constexpr int64_t kStep = 32 * kDrawItems;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int64_t begin, end;
  warp_segment(vocab, kStep, &begin, &end);
  double total = 0.0;
  int64_t last = -1;
  for (int64_t base = begin; base < end; base += kStep) {
    double lane_sum = 0.0;
#pragma unroll
    for (int j = 0; j < kDrawItems; ++j) {
      const int64_t i = base + lane * kDrawItems + j;
      float w;
      if (i < end && kept(i, &w)) {
        lane_sum += w;
        last = i;
      }
    }
    total += __shfl_sync(kWarpMask, warp_inclusive_scan(lane_sum), 31);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const int64_t other = __shfl_xor_sync(kWarpMask, last, offset);
    last = other > last ? other : last;
  }
  __syncthreads();
  if (lane == 0) {
    sh.warp_total[warp] = total;
    sh.warp_index[warp] = last;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double sum = 0.0;
    int64_t last_kept = -1;
    for (int w = 0; w < int(blockDim.x >> 5); ++w) {
      sum += sh.warp_total[w];
      if (sh.warp_index[w] > last_kept) last_kept = sh.warp_index[w];
    }
    const double target = u * sum;
    double carry = 0.0;
    int sel = -1;
    for (int w = 0; w < int(blockDim.x >> 5); ++w) {
      if (carry + sh.warp_total[w] > target) {
        sel = w;
        break;
      }
      carry += sh.warp_total[w];
    }
    sh.sel_warp = sel;
    sh.carry = carry;
    sh.target = target;
    sh.result = sel < 0 ? last_kept : sh.warp_index[sel];
  }
  __syncthreads();
  if (warp == sh.sel_warp) {
    double carry = sh.carry;
    const double target = sh.target;
    for (int64_t base = begin; base < end; base += kStep) {
      float w[kDrawItems];
      bool k[kDrawItems];
      double lane_sum = 0.0;
#pragma unroll
      for (int j = 0; j < kDrawItems; ++j) {
        const int64_t i = base + lane * kDrawItems + j;
        k[j] = i < end && kept(i, &w[j]);
        if (k[j]) lane_sum += w[j];
      }
      const double incl = warp_inclusive_scan(lane_sum);
      const double chunk = __shfl_sync(kWarpMask, incl, 31);
      if (carry + chunk > target) {
        double excl = __shfl_up_sync(kWarpMask, incl, 1);
        if (lane == 0) excl = 0.0;
        const unsigned crossing = __ballot_sync(kWarpMask, carry + incl > target);
        if (lane == __ffs(crossing) - 1) {
          double run = carry + excl;
          int64_t pick = -1, lane_last = -1;
#pragma unroll
          for (int j = 0; j < kDrawItems; ++j) {
            if (!k[j]) continue;
            run += w[j];
            lane_last = base + lane * kDrawItems + j;
            if (pick < 0 && run > target) pick = lane_last;
          }
          if (pick >= 0) {
            sh.result = pick;
          } else if (lane_last >= 0) {
            sh.result = lane_last;
          }
        }
        break;
      }
      carry += chunk;
    }
  }
  __syncthreads();
  return sh.result;
}

// A row's kept set: the argmax alone (single), or the tokens inside `cut` that pass min-p.
struct RowFilter {
  float max;
  int64_t argmax;
  float temperature;
  float min_p;
  bool single;
  OrderCut cut;
};

template <typename T>
__device__ RowFilter row_filter(const T* x, int64_t vocab, float temperature, int32_t top_k, float top_p,
                                float min_p, SamplingShared& sh) {
  RowFilter f;
  row_argmax(x, vocab, sh, &f.max, &f.argmax);
  f.temperature = temperature;
  f.min_p = min_p;
  f.cut = {0u, kAllTies};
  f.single = !(temperature > 0.f) || top_k == 1 || vocab == 1;
  if (f.single) return f;
  const float max = f.max;
  auto weight = [max, temperature](float v) { return double(token_weight(v, max, temperature)); };
  if (top_k > 0 && top_k < vocab) f.cut = select_prefix<false>(x, vocab, f.cut, double(top_k), 1.f, weight, sh);
  if (top_p < 1.f) f.cut = select_prefix<true>(x, vocab, f.cut, 0.0, top_p, weight, sh);
  return f;
}

// Masked (-inf) and NaN logits are never kept; the max always passes min-p.
template <typename T>
__device__ __forceinline__ bool is_kept(const RowFilter& f, const T* x, int64_t i, float* w) {
  const float v = load_float(x[i]);
  if (!(v > kNegInf) || !in_cut(f.cut, order_key(v), i)) return false;
  *w = token_weight(v, f.max, f.temperature);
  return !(f.min_p > 0.f) || *w >= f.min_p || v == f.max;
}

template <typename T>
__global__ void __launch_bounds__(kSamplingMaxThreads)
    sample_kernel(int64_t* out,             // [batch]
                  const T* logits,          // [batch, vocab], row stride logits_stride
                  int64_t logits_stride, int64_t vocab,
                  const float* temperature,  // [batch]
                  const int32_t* top_k,      // [batch]
                  const float* top_p,        // [batch]
                  const float* min_p,        // [batch]
                  const int64_t* seeds,      // [batch]
                  const int64_t* offsets) {  // [batch]
  __shared__ SamplingShared sh;
  const int64_t b = blockIdx.x;
  const T* x = logits + b * logits_stride;
  const RowFilter f = row_filter(x, vocab, temperature[b], top_k[b], top_p[b], min_p[b], sh);
  int64_t token = f.argmax;
  if (!f.single) {
    const double u = philox_uniform(uint64_t(seeds[b]), uint64_t(offsets[b]));
    const int64_t drawn =
        draw_in_index_order(vocab, u, [&](int64_t i, float* w) { return is_kept(f, x, i, w); }, sh);
    if (drawn >= 0) token = drawn;
  }
  if (threadIdx.x == 0) out[b] = token;
}

// In place: kept tokens become x / T (the argmax alone keeps x when T is 0), the rest -inf. Each
// thread rewrites only the tokens it has itself just read, after every pass of row_filter.
__global__ void __launch_bounds__(kSamplingMaxThreads)
    sampling_filter_kernel(float* logits,  // [batch, vocab], row stride logits_stride
                           int64_t logits_stride, int64_t vocab,
                           const float* temperature,  // [batch]
                           const int32_t* top_k,      // [batch]
                           const float* top_p,        // [batch]
                           const float* min_p) {      // [batch]
  __shared__ SamplingShared sh;
  const int64_t b = blockIdx.x;
  float* x = logits + b * logits_stride;
  const RowFilter f = row_filter<float>(x, vocab, temperature[b], top_k[b], top_p[b], min_p[b], sh);
  const bool scale = f.temperature > 0.f;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float v = x[i];
    float w;
    const bool keep = f.single ? i == f.argmax : is_kept(f, x, i, &w);
    x[i] = keep ? (scale ? v / f.temperature : v) : kNegInf;
  }
}

// The scratch word of token t in a row: output occurrences, plus kInPrompt if the prompt has it.
constexpr int32_t kInPrompt = 1 << 30;

// Each row's distinct tokens are penalised once: the first pass marks and counts them in the row's
// scratch, the second walks the lists again and whichever occurrence swaps a token's non-zero word
// back to 0 applies its penalties; the scratch ends all zeros.
__global__ void __launch_bounds__(kPenaltyThreads)
    penalties_kernel(float* logits,  // [batch, vocab], row stride logits_stride
                     int64_t logits_stride, int64_t vocab,
                     const int64_t* prompt_ids,      // [total prompt tokens]
                     const int64_t* prompt_offsets,  // [batch + 1]
                     const int64_t* output_ids,      // [total output tokens]
                     const int64_t* output_offsets,  // [batch + 1]
                     const float* repetition_penalty,  // [batch]
                     const float* frequency_penalty,   // [batch]
                     const float* presence_penalty,    // [batch]
                     int32_t* scratch) {               // [batch, vocab], zeros
  const int64_t b = blockIdx.x;
  float* row = logits + b * logits_stride;
  int32_t* seen = scratch + b * vocab;
  const int64_t p0 = prompt_offsets[b], p1 = prompt_offsets[b + 1];
  const int64_t o0 = output_offsets[b], o1 = output_offsets[b + 1];
  for (int64_t j = p0 + threadIdx.x; j < p1; j += blockDim.x) {
    const int64_t t = prompt_ids[j];
    if (t >= 0 && t < vocab) atomicOr(&seen[t], kInPrompt);
  }
  for (int64_t j = o0 + threadIdx.x; j < o1; j += blockDim.x) {
    const int64_t t = output_ids[j];
    if (t >= 0 && t < vocab) atomicAdd(&seen[t], 1);
  }
  __syncthreads();
  const float rp = repetition_penalty[b], fp = frequency_penalty[b], pp = presence_penalty[b];
  auto penalise = [&](int64_t t) {
    if (t < 0 || t >= vocab) return;
    const int32_t word = atomicExch(&seen[t], 0);
    if (word == 0) return;
    const int32_t count = word & (kInPrompt - 1);
    float l = row[t];
    if (rp != 1.f) l = l > 0.f ? l / rp : l * rp;
    // Rounded step by step (no fused multiply-add), as the CPU path computes it.
    if (count > 0) l = __fsub_rn(l, __fadd_rn(__fmul_rn(fp, float(count)), pp));
    row[t] = l;
  };
  for (int64_t j = p0 + threadIdx.x; j < p1; j += blockDim.x) penalise(prompt_ids[j]);
  for (int64_t j = o0 + threadIdx.x; j < o1; j += blockDim.x) penalise(output_ids[j]);
}

// log_softmax(x)[i] = x[i] - (max + log(sum(exp(x - max)))), in float32 with the sum in double.
template <typename T>
__global__ void __launch_bounds__(kSamplingMaxThreads)
    logprobs_kernel(float* token_logprob,  // [batch]
                    int64_t* top_ids,      // [batch, num_top]
                    float* top_logprobs,   // [batch, num_top]
                    const T* logits,       // [batch, vocab], row stride logits_stride
                    int64_t logits_stride, int64_t vocab,
                    const int64_t* token_ids,  // [batch]
                    int num_top) {
  __shared__ SamplingShared sh;
  const int64_t b = blockIdx.x;
  const T* x = logits + b * logits_stride;
  float max;
  int64_t argmax;
  row_argmax(x, vocab, sh, &max, &argmax);
  float partial = 0.f;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) partial += expf(load_float(x[i]) - max);
  const float log_z = max + float(log(block_sum_double(double(partial), sh)));
  if (threadIdx.x == 0) {
    const int64_t t = token_ids[b];
    token_logprob[b] = t >= 0 && t < vocab ? load_float(x[t]) - log_z : __uint_as_float(0x7fc00000u);
  }
  if (num_top <= 0) return;
  OrderCut cut{0u, kAllTies};
  if (num_top < vocab) {
    cut = select_prefix<false>(x, vocab, cut, double(num_top), 1.f, [](float) { return 0.0; }, sh);
  }
  if (threadIdx.x == 0) sh.slots = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const uint32_t key = order_key(load_float(x[i]));
    if (in_cut(cut, key, i)) {
      const int slot = atomicAdd(&sh.slots, 1);
      if (slot < kMaxTopLogprobs) {
        sh.top_key[slot] = key;
        sh.top_index[slot] = i;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const int found = sh.slots < kMaxTopLogprobs ? sh.slots : kMaxTopLogprobs;
    for (int a = 1; a < found; ++a) {  // insertion sort: key descending, index ascending
      const uint32_t key = sh.top_key[a];
      const int64_t index = sh.top_index[a];
      int c = a;
      for (; c > 0 && (sh.top_key[c - 1] < key || (sh.top_key[c - 1] == key && sh.top_index[c - 1] > index)); --c) {
        sh.top_key[c] = sh.top_key[c - 1];
        sh.top_index[c] = sh.top_index[c - 1];
      }
      sh.top_key[c] = key;
      sh.top_index[c] = index;
    }
    for (int r = 0; r < num_top; ++r) {
      const bool have = r < found;
      top_ids[b * num_top + r] = have ? sh.top_index[r] : 0;
      top_logprobs[b * num_top + r] = have ? load_float(x[sh.top_index[r]]) - log_z : kNegInf;
    }
  }
}

// out[b] = a token of row b drawn as sample() documents (greedy when temperature[b] is 0).
template <typename T>
cudaError_t sample(int64_t* out,             // [batch]
                   const T* logits,          // [batch, vocab], row stride logits_stride
                   int64_t logits_stride, int64_t batch, int64_t vocab,
                   const float* temperature,  // [batch]
                   const int32_t* top_k,      // [batch]
                   const float* top_p,        // [batch]
                   const float* min_p,        // [batch]
                   const int64_t* seeds,      // [batch]
                   const int64_t* offsets,    // [batch]
                   cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  if (batch > INT32_MAX || vocab <= 0 || vocab > INT32_MAX) return cudaErrorInvalidValue;
  sample_kernel<T><<<unsigned(batch), threads_for(vocab, kSamplingMaxThreads), 0, stream>>>(
      out, logits, logits_stride, vocab, temperature, top_k, top_p, min_p, seeds, offsets);
  return cudaGetLastError();
}

// logits[b, :] = the distribution sample() draws row b from, as logits.
inline cudaError_t apply_sampling_filters(float* logits,  // [batch, vocab], row stride logits_stride
                                          int64_t logits_stride, int64_t batch, int64_t vocab,
                                          const float* temperature,  // [batch]
                                          const int32_t* top_k,      // [batch]
                                          const float* top_p,        // [batch]
                                          const float* min_p,        // [batch]
                                          cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  if (batch > INT32_MAX || vocab <= 0 || vocab > INT32_MAX) return cudaErrorInvalidValue;
  sampling_filter_kernel<<<unsigned(batch), threads_for(vocab, kSamplingMaxThreads), 0, stream>>>(
      logits, logits_stride, vocab, temperature, top_k, top_p, min_p);
  return cudaGetLastError();
}

// Repetition penalty on the tokens of prompt and output, then frequency and presence penalties on
// the output's. scratch must be zeros and is left zeros. Token ids outside [0, vocab) are skipped.
inline cudaError_t apply_penalties(float* logits,  // [batch, vocab], row stride logits_stride
                                   int64_t logits_stride, int64_t batch, int64_t vocab,
                                   const int64_t* prompt_ids,        // [total prompt tokens]
                                   const int64_t* prompt_offsets,    // [batch + 1]
                                   const int64_t* output_ids,        // [total output tokens]
                                   const int64_t* output_offsets,    // [batch + 1]
                                   const float* repetition_penalty,  // [batch]
                                   const float* frequency_penalty,   // [batch]
                                   const float* presence_penalty,    // [batch]
                                   int32_t* scratch,                 // [batch, vocab], zeros
                                   cudaStream_t stream) {
  if (batch == 0 || vocab == 0) return cudaSuccess;
  if (batch > INT32_MAX) return cudaErrorInvalidValue;
  penalties_kernel<<<unsigned(batch), kPenaltyThreads, 0, stream>>>(
      logits, logits_stride, vocab, prompt_ids, prompt_offsets, output_ids, output_offsets, repetition_penalty,
      frequency_penalty, presence_penalty, scratch);
  return cudaGetLastError();
}

// token_logprob[b] = log_softmax(logits[b])[token_ids[b]] (NaN for an id outside the vocabulary);
// top_ids[b] / top_logprobs[b]: the num_top (<= 20, <= vocab) largest, descending, ties lower index first.
template <typename T>
cudaError_t compute_logprobs(float* token_logprob,  // [batch]
                             int64_t* top_ids,      // [batch, num_top]
                             float* top_logprobs,   // [batch, num_top]
                             const T* logits,       // [batch, vocab], row stride logits_stride
                             int64_t logits_stride, int64_t batch, int64_t vocab,
                             const int64_t* token_ids,  // [batch]
                             int64_t num_top, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  if (batch > INT32_MAX || vocab <= 0 || vocab > INT32_MAX || num_top < 0 || num_top > kMaxTopLogprobs ||
      num_top > vocab) {
    return cudaErrorInvalidValue;
  }
  logprobs_kernel<T><<<unsigned(batch), threads_for(vocab, kSamplingMaxThreads), 0, stream>>>(
      token_logprob, top_ids, top_logprobs, logits, logits_stride, vocab, token_ids, int(num_top));
  return cudaGetLastError();
}

}  // namespace kvflow::cuda_kernels
