// The portable CPU kernels: plain C++ that any CPU runs.
#include "kvflow/cpu/kernels.h"

namespace kvflow::cpu {

const KernelTable& scalar_kernels() {
  static const KernelTable table = make_kernel_table<VecScalar>("scalar");
  return table;
}

}  // namespace kvflow::cpu
