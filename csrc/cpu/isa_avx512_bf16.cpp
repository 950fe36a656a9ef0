// The CPU kernels compiled for AVX-512 (F, BW, VL, DQ) plus the BF16 extension: one instruction
// rounds bfloat16 stores (instead of eight), and vdpbf16ps serves the bf16 paged attention,
// small_linear and packed_linear kernels. Headers shared with the baseline code are included
// before the target pragma so that only this file's own functions use these features.
// GCC 12's AVX-512 unpack intrinsics pass an undefined register through a masked builtin and
// then warn about it once inlined into the transposes here; the warning is about the header.
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kvflow/cpu/kernel_table.h"
#include "kvflow/cpu/vec_scalar.h"
#include "kvflow/numeric.h"

#if defined(__x86_64__)

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")

#include "kvflow/cpu/attention_avx512_bf16.h"
#include "kvflow/cpu/kernels.h"
#include "kvflow/cpu/linear_avx512_bf16.h"
#include "kvflow/cpu/packed_linear_avx512_bf16.h"
#include "kvflow/cpu/vec_avx512_bf16.h"

namespace kvflow::cpu {
namespace {

KernelTable make_avx512_bf16_table() {
  KernelTable table = make_kernel_table<VecAvx512Bf16>("avx512_bf16");
  // vdpbf16ps takes head_dim 32 at a time (16 pairs a transpose): head_dim 80 keeps the table's
  // widening kernel.
  auto& bf16_attention = table.paged_attention[int(DType::kBFloat16)];
  bf16_attention[attention_head_dim_index(64)] = paged_attention_avx512_bf16<64>;
  bf16_attention[attention_head_dim_index(96)] = paged_attention_avx512_bf16<96>;
  bf16_attention[attention_head_dim_index(128)] = paged_attention_avx512_bf16<128>;
  bf16_attention[attention_head_dim_index(256)] = paged_attention_avx512_bf16<256>;
  table.small_linear[int(DType::kBFloat16)] = small_linear_avx512_bf16;
  table.packed_linear = packed_linear_panels<PackedLinearAvx512Bf16>;
  fill_avx512_quantized_entries(table);
  // From these row counts up an interleaved weight's product is at least 5% faster through
  // dequantized panels and vdpbf16ps than through the int8 kernel (measured against the 512-bit
  // vpdpbusd kernels: docs/benchmarks.md); the other formats never are (Q8_0 took panels from
  // 1024 rows until its pair kernel stopped carrying each weight's sign to every input row).
  auto& panel_rows = table.interleaved_panel_rows;
  panel_rows[interleaved_index(QuantFormat::kQ6_K)] = 64;
  return table;
}

}  // namespace

const KernelTable& avx512_bf16_kernels() {
  static const KernelTable table = make_avx512_bf16_table();
  return table;
}

}  // namespace kvflow::cpu

#pragma GCC pop_options

#else  // not x86-64: never selected (supported_isas() does not list it)

namespace kvflow::cpu {
const KernelTable& avx512_bf16_kernels() { return scalar_kernels(); }
}  // namespace kvflow::cpu

#endif
