// The quantized GEMV in plain C++: built with no instruction-set flags, it runs on every CPU.
#include "isa_portable.h"

FLOE_QDOT_EXPORT const FloeQdotKernel* floe_qdot_kernel(void) {
  return floe_qdot::kernel<floe_qdot::Portable>("portable");
}
