// Picks the CPU kernel table at run time: the widest instruction set this CPU and OS support,
// or the one named by KVFLOW_CPU_ISA (scalar, avx2, avx512, avx512_bf16) or set_isa().
#include <atomic>
#include <cstdlib>
#include <stdexcept>

#include "kvflow/cpu/kernel_table.h"

namespace kvflow::cpu {
namespace {

bool cpu_has_avx2() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(__x86_64__)
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

bool cpu_has_avx512_bf16() {
#if defined(__x86_64__)
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

const KernelTable& table_for(const std::string& name) {
  const auto supported = supported_isas();
  bool ok = false;
  for (const auto& s : supported) ok |= (s == name);
  if (!ok) {
    throw std::invalid_argument("CPU instruction set '" + name + "' is not one this CPU supports; choose one of: " +
                                join(supported));
  }
  if (name == "avx512_bf16") return avx512_bf16_kernels();
  if (name == "avx512") return avx512_kernels();
  if (name == "avx2") return avx2_kernels();
  return scalar_kernels();
}

const KernelTable* initial_table() {
  const char* forced = std::getenv("KVFLOW_CPU_ISA");
  if (forced != nullptr && *forced != '\0') {
    try {
      return &table_for(forced);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("KVFLOW_CPU_ISA: ") + e.what());
    }
  }
  return &table_for(supported_isas().back());
}

std::atomic<const KernelTable*> active{nullptr};

}  // namespace

std::vector<std::pair<std::string, bool>> cpu_features() {
  std::vector<std::pair<std::string, bool>> features;
#if defined(__x86_64__)
  // The CPU's own answer (CPUID, and XGETBV for the register state the OS saves), by the names
  // /proc/cpuinfo uses.
  features = {{"avx2", __builtin_cpu_supports("avx2")},
              {"fma", __builtin_cpu_supports("fma")},
              {"f16c", __builtin_cpu_supports("f16c")},
              {"avx512f", __builtin_cpu_supports("avx512f")},
              {"avx512bw", __builtin_cpu_supports("avx512bw")},
              {"avx512vl", __builtin_cpu_supports("avx512vl")},
              {"avx512dq", __builtin_cpu_supports("avx512dq")},
              {"avx512_bf16", __builtin_cpu_supports("avx512bf16")},
              {"avx512_vnni", __builtin_cpu_supports("avx512vnni")},
              {"avx512_fp16", __builtin_cpu_supports("avx512fp16")},
              {"avx_vnni", __builtin_cpu_supports("avxvnni")},
              {"amx_bf16", __builtin_cpu_supports("amx-bf16")}};
#endif
  return features;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> names{"scalar"};
  if (cpu_has_avx2()) names.push_back("avx2");
  if (cpu_has_avx512()) names.push_back("avx512");
  if (cpu_has_avx512_bf16()) names.push_back("avx512_bf16");
  return names;
}

const KernelTable& active_kernels() {
  const KernelTable* table = active.load(std::memory_order_acquire);
  if (table == nullptr) {
    table = initial_table();
    active.store(table, std::memory_order_release);
  }
  return *table;
}

void set_isa(const std::string& name) { active.store(&table_for(name), std::memory_order_release); }

}  // namespace kvflow::cpu
